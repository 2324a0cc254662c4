"""The torch backend's reports room: a corruption found is reported once, with
what was expected and what was read (the value decoded back to the origin, position,
head and token that wrote it) (a mixin of :class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch  # first: without the torch extra, the missing module is torch

from ._kv_common import (
    _CODE_DIMS,
    _PROBE,
    KV_CORRUPTION,
    _fmt,
    _witness,
)
from ._kv_state import (
    KVCorruption,
    _Gen,
    _Worker,
)


class _Reports:
    """Reports of corrupted KV.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    def _emit(self, dedupe: tuple, v: KVCorruption) -> None:
        """Report ``v`` unless the same wrong element was reported already."""
        if dedupe in self._reported:
            return
        self._reported.add(dedupe)
        self._out.append(v)

    def _report_missing(self, g, worker, table, covered, what, line, witness, transfer, ticket) -> None:
        self._emit(
            (g.key, worker, "missing", covered),
            KVCorruption(
                KV_CORRUPTION,
                line,
                f"{what} of {_fmt(g.key)} on {worker!r}: the block table {list(table)} covers positions "
                f"[0, {covered}) only, so position {covered} has no KV (block size {self.layout.block_size})",
                _witness(witness, line),
                request=g.key[0],
                gen=g.key[1],
                worker=worker,
                position=covered,
                transfer=transfer,
                ticket=ticket,
            ),
        )

    def _report_wrong(
        self,
        g: _Gen,
        w: _Worker,
        blk: int,
        bi: int,
        pstart: int,
        count: int,
        what: str,
        line: int,
        witness: Iterable[int | None],
        transfer: str | None,
        ticket: str | None,
    ) -> None:
        """Report the first wrong element of positions ``pstart .. pstart+count-1``
        in ``blk`` over all parts: lowest position, then layer."""
        L = self.layout
        bs = L.block_size
        s0 = pstart % bs
        tags, codes = self._expect(g, w.name, pstart, pstart + count)
        rows = self._rows(tags, pstart, codes)
        best = None
        for i, (l0, l1, hs) in enumerate(w.parts):
            a = w.pools[i][blk, s0 : s0 + count]
            e = self._qpart(l0, l1, hs) + rows
            if L.fp8:
                s = w.scales[i][blk] if L.scale == "per-block" else w.scales[i][0]
                af = self._quant.dequantize(a, s)
                bad = ~self._quant.close(af, e, L.dtype, s)
            else:
                af = a
                bad = ~(a == e)  # NaN counts as wrong
            if not bool(bad.any()):
                continue
            tl = bad.any(dim=4).any(dim=3).any(dim=2)  # [T, L]
            t = int(tl.any(dim=1).nonzero()[0])
            layer = int(tl[t].nonzero()[0])
            kh = bad[t, layer].any(dim=2).nonzero()[0]
            k, h = int(kh[0]), int(kh[1])
            cand = (t, l0 + layer, i, k, h)
            if best is None or cand[:2] < best[0][:2]:
                raw = a[t, layer, k, h, :].float().cpu() if L.fp8 else None
                best = (cand, af[t, layer, k, h, :].float().cpu(), raw, s if L.fp8 else None)
        if best is None:  # pragma: no cover - equal after all
            return
        (t, layer, i, k, h), row, raw, scale = best
        position = pstart + t
        head = w.parts[i][2][h]
        found, found_text = self._decode_row(row)
        if (
            isinstance(found, dict)
            and (found.get("request"), found.get("gen")) == g.key
            and found.get("position_mod") == position % self._radix
            and found.get("head") == head % self._radix
        ):
            found_text = f"its own KV for position {position}, but written for another input token"
        if raw is not None:
            found, found_text = self._rescaled(found, found_text, raw, scale, layer - w.parts[i][0], k, h)
        wrote = w.last_write.get(blk)
        if (
            w.restart_line is not None
            and (wrote is None or w.restart_line > wrote)
            and w.restart_stamp >= w.stamp.get(blk, 0)
        ):
            wrote = w.restart_line
        prompt = self._prompt(g)
        if position < prompt:
            origin = tags[0] if len(tags) == 1 else tags[t]
            expected = (
                "the prompt KV"
                if origin == g.tag
                else (f"the shared prompt KV computed by {_fmt(self._tags[origin])}")
            )
        else:
            expected = (
                f"the KV of input token {g.exp_tok[position]}"
                if position in g.exp_tok
                else "no KV ever written"
            )
        kind = "latent" if L.layout == "mla" else f"{'KV'[k]} head {head}"
        msg = (
            f"{what} of {_fmt(g.key)} on {w.name!r}: block {blk} (table index {bi}) at position "
            f"{position}, layer {layer}, {kind} (rank {i}) should hold {expected} "
            f"of that generation but holds {found_text}"
        )
        if wrote is not None:
            msg += f" (the block was last written at line {wrote})"
        self._emit(
            (g.key, w.name, blk, position),
            KVCorruption(
                KV_CORRUPTION,
                line,
                msg,
                _witness(list(witness) + [wrote], line),
                request=g.key[0],
                gen=g.key[1],
                worker=w.name,
                block=blk,
                layer=layer,
                position=position,
                head=head,
                rank=i,
                found=found,
                transfer=transfer,
                ticket=ticket,
            ),
        )

    def _rescaled(
        self, found: Any, text: str, raw: torch.Tensor, scale: torch.Tensor, layer: int, k: int, h: int
    ) -> tuple[Any, str]:
        """fp8: the element read with the scale its block or worker has; if
        that makes no sense, try the scales KV is written with (whose KV it is,
        read with a wrong scale), and say whether the scale itself is missing."""
        s = scale[0] if scale.shape[0] == 1 else scale
        s = float(s[layer, k, h if s.shape[2] > 1 else 0, 0]) if s.dim() == 4 else float(s.flatten()[0])
        if s != s and not bool(torch.isnan(raw).any()):
            return (
                found,
                "KV without its scale (the block's per-block scale is missing: not written, or "
                "left behind by the transfer)",
            )
        if isinstance(found, dict) or found == "poison":
            return found, text
        candidates = {2.0**-e for e in range(3)} | {wk.static_scale for wk in self._workers.values()}
        for c in sorted(candidates):
            f, t = self._decode_row(raw * c)
            if isinstance(f, dict):
                return f, f"{t}, read with scale {s:g} instead of the {c:g} it was written with"
        return found, text

    def _decode_row(self, row: torch.Tensor) -> tuple[Any, str]:
        vals = row.tolist()
        if any(v != v for v in vals):
            return "poison", "poison (freed, restarted or never written)"
        radix = self._radix
        c = vals[:_CODE_DIMS]
        if not all(float(x).is_integer() and 1 <= x <= radix for x in c):
            if self.layout.fp8:
                return None, "unrecognisable bytes (KV read with a wrong scale, or not KV)"
            return None, "unrecognisable bytes"
        tag = int(c[0] - 1) + radix * int(c[1] - 1)
        pos_code, head = int(c[2] - 1), int(c[3] - 1)
        cands = self._tags[tag :: radix * radix]
        if len(cands) != 1:
            return None, f"KV of an unknown generation (position = {pos_code} mod {radix}, head {head})"
        key = cands[0]
        if key == _PROBE:
            return {
                "request": None,
                "gen": None,
                "probe": True,
            }, "the probe written at the end of the history"
        found = {"request": key[0], "gen": key[1], "position_mod": pos_code, "head": head}
        return found, f"KV of {_fmt(key)} for position {pos_code} (mod {radix}), head {head}"
