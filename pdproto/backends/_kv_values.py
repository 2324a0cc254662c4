"""The torch backend's values room: the KV every position is expected to hold
(one function of origin, layer, K/V, position, head, dim and token) and the
writes that store it, fp8 scales and poison included (a mixin of
:class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np  # noqa: I001 - the torch extra brings it (torch.from_numpy needs it too)
import torch  # first: without the torch extra, the missing module is torch

from ._kv_common import (
    _CODE_DIMS,
    _M32,
    _MUL,
    _PROMPT,
    _bytes,
    _mix,
    _position_hash,
)
from ._kv_state import (
    _POISON,
    _WRITE,
    _Gen,
    _Worker,
)


class _Values:
    """Expected values and the writes that store them.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    # -- values --------------------------------------------------------------

    def _qpart(self, l0: int, l1: int, hs: Sequence[int]) -> torch.Tensor:
        """The position-independent values of layers ``l0..l1`` and heads ``hs`` (contiguous)."""
        key = (l0, l1, hs[0], hs[-1])
        q = self._qcache.get(key)
        if q is None:
            q = self._qcache[key] = self._qf[:, l0:l1, :, hs[0] : hs[-1] + 1]
        return q

    def _make_q(self) -> torch.Tensor:
        """The position-independent part of every value, ``[1, L, K/V, H, D]``:
        dims 0-2 zero, dim 3 the head code, hashed dims ``(q - A) / S``."""
        L = self.layout
        radix, half, div = L.encoding
        nh = L.head_dim - _CODE_DIMS
        dev = self.device
        li = torch.arange(L.layers, device=dev, dtype=torch.int64).view(-1, 1, 1, 1)
        k = torch.arange(L.kv, device=dev, dtype=torch.int64).view(1, -1, 1, 1)
        h = torch.arange(L.kv_heads, device=dev, dtype=torch.int64).view(1, 1, -1, 1)
        d = torch.arange(nh, device=dev, dtype=torch.int64).view(1, 1, 1, -1)
        x = _mix(li * 1_000_003 + k * 7_919 + h * 104_729 + d * 15_485_863 + 12_345)
        x = _mix(x ^ (d * 0x3C6EF372))
        q = torch.zeros((1, L.layers, L.kv, L.kv_heads, L.head_dim), dtype=torch.float32, device=dev)
        q[0, :, :, :, _CODE_DIMS:] = ((x % (half + 1)) - half).to(torch.float32) / div
        q[0, :, :, :, 3] = (torch.arange(L.kv_heads, device=dev) % radix + 1).to(torch.float32).view(1, 1, -1)
        # exact in every wide dtype, and so is every sum with a row (see _ENCODING)
        return q.to(self._vdtype)

    def _tag_of(self, key: tuple[str, int]) -> int:
        g = self._gens.get(key)
        if g is not None:
            return g.tag
        tag = len(self._tags)
        self._tags.append(key)
        self._gens[key] = _Gen(key, tag)
        return tag

    def _gen(self, key: tuple[str, int]) -> _Gen:
        g = self._gens.get(key)
        if g is None:
            self._tag_of(key)
            g = self._gens[key]
        return g

    def _rows(self, tags: Sequence[int], start: int, codes: Sequence[int]) -> torch.Tensor:
        """The position-dependent part, ``[T, 1, 1, 1, D]``: dims 0-2 the tag
        and position codes, dim 3 zero, hashed dims ``k / S`` (k in 0..A)."""
        radix = self._radix
        mults = self._mults
        if len(codes) > 16 or len(codes) * len(mults) > 512:
            if len(tags) != 1 or len(codes) > 4096 or codes.count(codes[0]) != len(codes):
                return self._rows_wide(tags, start, codes)
            # one generation, one token code (a prompt): memoised, since prefill
            # writes and commit verifies the same rows
            key = (tags[0], start, len(codes), codes[0])
            rows = self._row_memo.get(key)
            if rows is None:
                if len(self._row_memo) >= 32:
                    del self._row_memo[next(iter(self._row_memo))]
                rows = self._row_memo[key] = self._rows_wide(tags, start, codes)
            return rows
        enc = self._enc  # value code -> its bits in the value dtype
        one = len(tags) == 1
        buf = array.array(self._acode)
        mod = self._half + 1
        for i, code in enumerate(codes):
            tag = tags[0] if one else tags[i]
            p = start + i
            x = _position_hash(tag, p, code)
            buf.extend((enc[1 + tag % radix], enc[1 + (tag // radix) % radix], enc[1 + p % radix], enc[0]))
            buf.extend([enc[radix + 1 + (((x * m) & _M32) >> 20) % mod] for m in mults])
        out = torch.frombuffer(buf, dtype=self._vdtype).view(len(codes), 1, 1, 1, self.layout.head_dim)
        return out if not self.cuda else out.to(self.device, non_blocking=False)

    def _rows_wide(self, tags: Sequence[int], start: int, codes: Sequence[int]) -> torch.Tensor:
        """:meth:`_rows` computed with numpy for many positions at once: the
        same bits (:func:`_position_hash` in unsigned 64-bit integers, whose
        products wrap; only their low 32 bits are kept, as in Python), each
        value looked up in the bit table."""
        radix = self._radix
        T = len(codes)
        enc = self._enc_np
        u = np.uint64
        i = np.arange(T, dtype=u)
        if len(tags) == 1:
            tag = tags[0]
            base: Any = u((tag * 0x9E3779B1 + 0x51ED) & _M32)
            lo: Any = enc[1 + tag % radix]
            hi: Any = enc[1 + (tag // radix) % radix]
        else:
            t = np.array(tags, dtype=np.int64)
            base = t.astype(u) * u(0x9E3779B1) + u(0x51ED)
            lo, hi = enc[1 + t % radix], enc[1 + (t // radix) % radix]
        if codes.count(codes[0]) == T:
            code: Any = u(((codes[0] & _M32) * 0xC2B2AE3D) & _M32)
        else:
            code = (np.array([c & _M32 for c in codes], dtype=u)) * u(0xC2B2AE3D)
        m32, mul = u(_M32), u(_MUL)
        x = (((i + u(start & _M32)) * u(0x85EBCA77)) + code + base) & m32
        x = (((x >> u(16)) ^ x) * mul) & m32
        x = (((x >> u(16)) ^ x) * mul) & m32
        x = (x >> u(16)) ^ x
        mod = self._half + 1
        if mod & (mod - 1) == 0:  # a power of two (every encoding's): bits 20.. of the low 32
            k = ((x[:, None] * self._mults_np) >> u(20)) & u(mod - 1)
        else:  # pragma: no cover - no such encoding
            k = (((x[:, None] * self._mults_np) & m32) >> u(20)) % u(mod)
        out = np.empty((T, self.layout.head_dim), dtype=enc.dtype)
        out[:, 0] = lo
        out[:, 1] = hi
        out[:, 2] = enc[1 + (np.arange(T, dtype=np.int64) + start % radix) % radix]
        out[:, 3] = enc[0]
        out[:, _CODE_DIMS:] = enc[(radix + 1) + k.astype(np.int64)]
        rows = torch.from_numpy(out).view(self._vdtype).view(T, 1, 1, 1, self.layout.head_dim)
        return rows if not self.cuda else rows.to(self.device)

    def _values(
        self,
        tags: Sequence[int],
        start: int,
        codes: Sequence[int],
        part: tuple[int, int, tuple[int, ...]],
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """KV of positions ``start ..`` (a tag and token code per position, or
        one tag for all) for one part: ``[T, layers, K/V, heads, D]``, in the
        pool dtype (fp8: float32, before quantization)."""
        l0, l1, hs = part
        if layers is not None:
            l0, l1 = max(l0, layers[0]), min(l1, layers[1])
        return self._qpart(l0, l1, hs) + self._rows(tags, start, codes)

    def _static_scale(self, w: _Worker) -> float:
        return w.static_scale

    @staticmethod
    def _fresh_scales(row: torch.Tensor, tag: int, blk: int) -> torch.Tensor:
        """The per-block scales a block's first writer sets: powers of two
        (1, 1/2, 1/4: every value stays exact) that differ between
        neighbouring blocks, layers and K/V, so a scale copied to the wrong
        block, layer or K/V reads back as another value."""
        idx = torch.zeros(row.shape, dtype=torch.int64, device=row.device)
        for d, n in enumerate(row.shape):
            if n > 1:
                shape = [1] * row.dim()
                shape[d] = n
                idx = idx + torch.arange(n, device=row.device).view(shape)
        return torch.pow(2.0, -((idx + tag + blk) % 3).to(row.dtype))

    def _store(self, w: _Worker, i: int, blk: int, s0: int, s1: int, vals: torch.Tensor, tag: int) -> None:
        """pool part ``i`` [blk, :, :, :, s0:s1] = ``vals`` (float32, quantized for fp8)."""
        L = self.layout
        if not L.fp8:
            f = blk * L.block_size
            w.flats[i][f + s0 : f + s1].copy_(vals)
            return
        pool = w.pools[i]
        scales = w.scales[i]
        if L.scale == "per-block":
            row = scales[blk]
            if bool(torch.isnan(row).any()):  # a fresh block: its scale is set by its first writer
                row.copy_(self._fresh_scales(row, tag, blk))
            s = row
        else:
            s = scales[0]
        q, _ = self._quant.quantize(vals, L.dtype, scale=s)
        pool[blk, s0:s1] = q

    def _write_positions(
        self,
        w: _Worker,
        table: Sequence[int],
        tags: Sequence[int],
        start: int,
        codes: Sequence[int],
        line: int,
    ) -> None:
        """Write KV of positions start.. into ``table`` on every part of ``w``
        (current stream).  Positions past the table are dropped."""
        bs = self.layout.block_size
        end = start + len(codes)
        spans = []
        p = start
        while p < end:
            bi = p // bs
            if bi >= len(table):
                break
            q = min(end, (bi + 1) * bs)
            spans.append((table[bi], p, q))
            p = q
        if not spans:
            return
        blocks = [s[0] for s in spans]
        self._worker(w.name, need=blocks)
        self._before_modify(w, blocks, line)
        t_start = self._timer()
        L = self.layout
        one = len(tags) == 1
        if len(codes) > 1 and not L.fp8:
            self._write_runs(w, spans, tags, start, codes)
        else:
            self._write_chunks(w, spans, tags, start, codes)
        self._sec[_WRITE] += self._timer() - t_start
        self._nbytes[_WRITE] += (spans[-1][2] - start) * w.pos_bytes
        if len(spans) == 1:
            self._touch(
                w, blocks, line, start % bs, (end - 1) % bs + 1 if end <= (start // bs + 1) * bs else bs
            )
        else:
            self._touch(w, blocks, line)
        if self._shares:
            for blk, p0, p1 in spans:
                o = w.origin.setdefault(blk, [None] * bs)
                for p in range(p0, p1):
                    o[p % bs] = (tags[0] if one else tags[p - start]) if codes[p - start] == _PROMPT else None

    def _write_runs(
        self,
        w: _Worker,
        spans: list[tuple[int, int, int]],
        tags: Sequence[int],
        start: int,
        codes: Sequence[int],
    ) -> None:
        """Write ``spans`` (block, first position, end position): the values are
        built straight into the pool, one add per run of slots that follow
        each other in the pool and in positions (whole consecutive blocks)."""
        bs = self.layout.block_size
        runs: list[list[int]] = []  # [first pool slot, first position, slots]
        for blk, p0, p1 in spans:
            f = blk * bs + p0 % bs
            if runs and runs[-1][0] + runs[-1][2] == f and runs[-1][1] + runs[-1][2] == p0:
                runs[-1][2] += p1 - p0
            else:
                runs.append([f, p0, p1 - p0])
        count = spans[-1][2] - start
        rows = self._rows(tags if len(tags) == 1 else tags[:count], start, codes[:count])
        for i, (l0, l1, hs) in enumerate(w.parts):
            q = self._qpart(l0, l1, hs)
            flat = w.flats[i]
            for f, p, n in runs:
                torch.add(q, rows[p - start : p - start + n], out=flat[f : f + n])

    def _write_chunks(
        self,
        w: _Worker,
        spans: list[tuple[int, int, int]],
        tags: Sequence[int],
        start: int,
        codes: Sequence[int],
    ) -> None:
        """Write ``spans`` a chunk of positions at a time (fp8: quantized per
        block; one position: its values are kept for the check that follows)."""
        bs = self.layout.block_size
        L = self.layout
        one = len(tags) == 1
        chunk = max(bs, (8 << 20) // max(1, L.layers * L.kv * L.kv_heads * L.head_dim) // bs * bs)
        tag0 = tags[0]
        for c0 in range(start, spans[-1][2], chunk):
            c1 = min(c0 + chunk, spans[-1][2])
            t = tags if one else tags[c0 - start : c1 - start]
            rows = self._rows(t, c0, codes[c0 - start : c1 - start])
            last = []
            for i, (l0, l1, hs) in enumerate(w.parts):
                vals = self._qpart(l0, l1, hs) + rows
                last.append(vals)
                for blk, p0, p1 in spans:
                    a, b = max(p0, c0), min(p1, c1)
                    if a < b:
                        self._store(
                            w,
                            i,
                            blk,
                            a % bs,
                            a % bs + (b - a),
                            vals if (a == c0 and b == c1) else vals[a - c0 : b - c0],
                            tag0,
                        )
        if len(codes) == 1 and not L.fp8:
            w.lastw[spans[0][0]] = (start % bs, (tag0, start, codes[0]), last)

    def _poison(
        self, w: _Worker, blocks: Sequence[int], line: int, lo: int = 0, hi: int | None = None
    ) -> None:
        blocks = [b for b in blocks if b < w.nblocks]
        if not blocks:
            return
        self._before_modify(w, blocks, line)
        t_start = self._timer()
        L = self.layout
        full = lo == 0 and (hi is None or hi >= L.block_size)
        for b in blocks:
            w.lastw.pop(b, None)
        runs: list[list[int]] = []  # consecutive block ids: one fill_ (a memset) each
        for b in sorted(set(blocks)):
            if runs and runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, b + 1])
        for i, pool in enumerate(w.pools):
            raw = _bytes(pool)
            if full and len(runs) > 16:
                idx = torch.tensor(blocks, device=self.device, dtype=torch.int64)
                raw.index_fill_(0, idx, self._nan)
            else:
                for b0, b1 in runs:
                    (raw[b0:b1] if full else raw[b0:b1, lo:hi]).fill_(self._nan)
            if L.fp8 and L.scale == "per-block" and full:
                for b in blocks:
                    w.scales[i][b].fill_(float("nan"))
        self._sec[_POISON] += self._timer() - t_start
        self._nbytes[_POISON] += len(blocks) * ((hi if hi is not None else L.block_size) - lo) * w.pos_bytes
        self._touch(w, blocks, line, lo, hi)
        if self._shares:
            for b in blocks:
                o = w.origin.get(b)
                if o is not None:
                    for s in range(lo, L.block_size if hi is None else hi):
                        o[s] = None

    def _before_modify(self, w: _Worker, blocks: Iterable[int], line: int) -> None:
        """Before the current stream modifies ``blocks`` of ``w``: materialise
        lazy reads of them, and wait for side-stream copies touching ``w``."""
        if self._lazy:
            tids: set[str] = set()
            for b in blocks:
                s = self._lazy.get((w.name, b))
                if s:
                    tids |= s
            for tid in sorted(tids):
                self._materialise(self._xfers[tid])
        if w.stash:
            for b in blocks:
                w.stash.pop(b, None)
        self._main_touch(w.name)
