"""The torch backend's transfers room: a transfer's plan, its read (lazy,
copy-on-write staging), the writes that land and late reads (a mixin of
:class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch  # first: without the torch extra, the missing module is torch

from ._kv_common import (
    _bytes,
)
from ._kv_state import (
    _COPY,
    _LOG_MAX,
    _Gen,
    _Worker,
    _Xfer,
)
from ._transport import BlockMove, Transfer


class _Transfers:
    """Transfers: plan, read, stage, land.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    # -- transfers -----------------------------------------------------------

    def _table(self, g: _Gen, worker: str, own: Sequence[int] | None = None) -> list[int]:
        """``g``'s block table on ``worker``: its shared blocks, then ``own``
        (default: the blocks it allocated there)."""
        shared = g.shared.get(worker)
        if own is None:
            own = self._alloc.get(g.key, {}).get(worker, [])
        return (list(shared[0]) if shared else []) + list(own)

    def _plan(self, t: _Xfer) -> None:
        """The moves of ``t``: per block pair, the first position it holds and
        the slots that move (its token range, else the whole block)."""
        bs = self.layout.block_size
        n = min(len(t.src_blocks), len(t.dst_blocks))
        moves = []
        if t.tokens is not None:
            lo, hi = t.tokens
            k = lo // bs
            for i in range(n):
                p0 = (k + i) * bs
                a, b = max(lo, p0), min(hi, p0 + bs)
                if a < b:
                    moves.append((i, t.src_blocks[i], t.dst_blocks[i], p0, a - p0, b - p0))
        else:
            g = self._gens.get(t.key)
            index: dict[int, int] = {}
            if g is not None:
                pre = g.prefill.get(t.src)
                table = self._table(g, t.src, pre if pre is not None else None)
                for j, b in enumerate(table):
                    index.setdefault(b, j)
            for i in range(n):
                j = index.get(t.src_blocks[i], i)
                moves.append((i, t.src_blocks[i], t.dst_blocks[i], j * bs, 0, bs))
        t.moves = moves

    def _read(self, t: _Xfer, line: int) -> None:
        """The read of ``t`` happens now: register it as a lazy read."""
        t.read = True
        t.read_line = line
        src = self._worker(t.src, "prefill", t.src_blocks)
        if src is None:
            return
        for b in set(t.src_blocks):
            self._lazy.setdefault((t.src, b), set()).add(t.tid)

    def _unregister_lazy(self, t: _Xfer) -> None:
        for b in set(t.src_blocks):
            s = self._lazy.get((t.src, b))
            if s is not None:
                s.discard(t.tid)
                if not s:
                    del self._lazy[(t.src, b)]

    def _buffer(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """A staging buffer of ``n`` rows shaped like ``like``'s, from the free list."""
        key = (tuple(like.shape[1:]), like.dtype)
        free = self._staging.get(key)
        if free:
            for j, buf in enumerate(free):
                if buf.shape[0] >= n:
                    return free.pop(j)[:n]
        rows = max(n, 1)
        buf = torch.empty((rows,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
        self.memory += buf.numel() * buf.element_size()
        return buf

    def _release(self, t: _Xfer) -> None:
        """Give ``t``'s staging buffers back to the free list (stream order keeps them safe)."""
        if t.staged is None:
            return
        for buf in t.staged[0]:
            base = buf._base if buf._base is not None else buf
            if base.dtype != buf.dtype:  # never happens: buffers are made in their dtype
                continue
            self._staging.setdefault((tuple(base.shape[1:]), base.dtype), []).append(base)
        t.staged = None

    def _materialise(self, t: _Xfer) -> None:
        """Copy-on-write: snapshot ``t``'s source into (reused) staging buffers now."""
        if t.staged is not None:
            return
        src = self._workers[t.src]
        ids = list(t.src_blocks)
        n = len(ids)
        run = n > 0 and all(ids[i] == ids[0] + i for i in range(n))
        per_block = self.layout.fp8 and self.layout.scale == "per-block"

        def gather() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            idx = None if run else torch.tensor(ids, device=self.device, dtype=torch.int64)
            rows, scales = [], []
            for pool in src.pools:
                buf = self._buffer(pool, n)
                if run:
                    buf.copy_(pool[ids[0] : ids[0] + n])
                else:
                    torch.index_select(_bytes(pool), 0, idx, out=_bytes(buf))
                rows.append(buf)
            if per_block:
                for s in src.scales:
                    scales.append(s[ids[0] : ids[0] + n].clone() if run else s.index_select(0, idx))
            return rows, scales

        t_start = self._timer()
        t.staged = self._side(gather, [t.src])
        self._sec[_COPY] += self._timer() - t_start
        self._nbytes[_COPY] += n * self.layout.block_size * src.pos_bytes
        self._unregister_lazy(t)

    def _head_segments(self, src: _Worker, dst: _Worker) -> list:
        """Per destination part: (source part, first layer, end layer, runs of
        (source local head, dest local head, count))."""
        key = (tuple(src.parts), tuple(dst.parts))
        segs = self._segments.get(key)
        if segs is not None:
            return segs
        segs = []
        for dl0, dl1, dhs in dst.parts:
            out = []
            for pi, (sl0, sl1, shs) in enumerate(src.parts):
                a, b = max(dl0, sl0), min(dl1, sl1)
                if a >= b:
                    continue
                runs: list[list[int]] = []
                for j, h in enumerate(dhs):
                    sh = self.head_map[h] if self.head_map is not None else h
                    # the first part of this stage holding the head serves it
                    owner = next(q for q, (ql0, ql1, qhs) in enumerate(src.parts) if ql0 == sl0 and sh in qhs)
                    if owner != pi:
                        continue
                    i = shs.index(sh)
                    if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
                        runs[-1][2] += 1
                    else:
                        runs.append([i, j, 1])
                if runs:
                    out.append((pi, a, b, [tuple(r) for r in runs]))
            segs.append(out)
        self._segments[key] = segs
        return segs

    def _write(self, t: _Xfer, line: int) -> None:
        """The writes of ``t`` land now: its layers and slots, block by block."""
        src = self._worker(t.src, "prefill", t.src_blocks)
        dst = self._worker(t.dst, "decode", t.dst_blocks)
        t.wrote = True
        self._drop_writer(t)
        if not t.moves:
            self._plan(t)
        moves = t.moves
        if src is None or dst is None or not moves:
            self._unregister_lazy(t)
            self._release(t)
            return
        dst_ids = [m[2] for m in moves]
        # other lazy reads of the target blocks (and t's own, on overlap) snapshot first
        if self._lazy:
            tids: set[str] = set()
            for b in dst_ids:
                tids |= self._lazy.get((t.dst, b), set())
            for tid in sorted(tids):
                self._materialise(self._xfers[tid])
        if dst.stash:
            for b in dst_ids:
                dst.stash.pop(b, None)
        L = self.layout
        bs = L.block_size
        if t.staged is not None:
            sources, ssc = t.staged
            src_ids = [m[0] for m in moves]
        else:
            sources, ssc = src.pools, src.scales
            src_ids = [m[1] for m in moves]
        segs = self._head_segments(src, dst)
        lr = t.layers
        full_ids = [(d, s) for (d, s, m) in zip(dst_ids, src_ids, moves) if m[4] == 0 and m[5] == bs]
        part_ids = [
            (d, s, m[4], m[5]) for (d, s, m) in zip(dst_ids, src_ids, moves) if not (m[4] == 0 and m[5] == bs)
        ]
        per_block = L.fp8 and L.scale == "per-block" and not self.drop_scales
        moved = [0]
        landed = [True]

        def copy() -> None:
            x = Transfer(t.tid, t.src, t.dst, self._pull, staged=t.staged is not None)
            for di, out in enumerate(segs):
                dl0 = dst.parts[di][0]
                nd = len(dst.parts[di][2])
                for pi, a, b, runs in out:
                    if lr is not None:
                        a, b = max(a, lr[0]), min(b, lr[1])
                        if a >= b:
                            continue
                    sl0 = src.parts[pi][0]
                    ns = len(src.parts[pi][2])
                    dl = (a - dl0, b - dl0)
                    sl = (a - sl0, b - sl0)
                    for i, j, cnt in runs:
                        heads = None if (cnt == nd and cnt == ns) else ((j, j + cnt), (i, i + cnt))
                        if full_ids:
                            x.moves.append(
                                BlockMove(
                                    dst.pools[di],
                                    [d for d, _ in full_ids],
                                    sources[pi],
                                    [s for _, s in full_ids],
                                    dl,
                                    sl,
                                    heads,
                                    None,
                                )
                            )
                        for d, s, s0, s1 in part_ids:
                            x.moves.append(
                                BlockMove(dst.pools[di], [d], sources[pi], [s], dl, sl, heads, (s0, s1))
                            )
                        moved[0] += (b - a) * cnt
                    if per_block:
                        for d, s in [(d, s) for d, s in full_ids] + [(d, s) for d, s, _, _ in part_ids]:
                            x.pairs.append(
                                (dst.scales[di][d, :, dl[0] : dl[1]], ssc[pi][s, :, sl[0] : sl[1]])
                            )
            landed[0] = self.transport.run(x, aborted=t.aborted)

        t_start = self._timer()
        self._side(copy, [t.src, t.dst])
        self._sec[_COPY] += self._timer() - t_start
        slots = sum(m[5] - m[4] for m in moves)
        self.bytes_copied += slots * moved[0] * L.kv * L.head_dim * dst.pools[0].element_size()
        self._unregister_lazy(t)
        self._release(t)
        if not landed[0]:
            # the library cancelled the aborted transfer: its bytes did not land, and
            # the target keeps what it held (the transport counts it: aborts_cancelled)
            t.cancelled = True
            return
        self._clock += 1
        t.write_stamp = self._clock
        for _i, _sb, db, _p0, s0, s1 in moves:
            dst.mod[db] = (dst.stamp.get(db, 0), s0, s1)
            dst.stamp[db] = self._clock
            dst.last_write[db] = line
            dst.log.append(db)
        if len(dst.log) > _LOG_MAX:
            self._restart_log(dst)
        self._landed(t, src, dst)

    def _landed(self, t: _Xfer, src: _Worker, dst: _Worker) -> None:
        """After ``t``'s writes: the target slots hold the source's prompt KV (origins)."""
        g = self._gens.get(t.key)
        if g is None:
            return
        so = g.orig.get(t.src)
        do = g.orig.get(t.dst)
        bs = self.layout.block_size
        if so is None and do is None and not self._shares:
            return
        for _i, _sb, db, p0, s0, s1 in t.moves:
            for s in range(s0, s1):
                p = p0 + s
                tag = so.get(p, g.tag) if so is not None else g.tag
                if do is not None or tag != g.tag:
                    d = g.orig.setdefault(t.dst, {})
                    do = d
                    if d.get(p, g.tag) != tag:
                        if tag == g.tag:
                            d.pop(p, None)
                        else:
                            d[p] = tag
                        g.invalidate(t.dst, p // bs)
                if self._shares:
                    o = dst.origin.setdefault(db, [None] * bs)
                    o[s] = tag if p < self._prompt(g) else None

    def _late_read(self, t: _Xfer, line: int) -> None:
        """A read that the history ends after the writes: if the source changed
        since the writes landed, the changed bytes land again."""
        t.read = True
        t.read_line = line
        src = self._workers.get(t.src)
        if src is None:
            return
        changed = src.restart_stamp > t.write_stamp or any(
            src.stamp.get(b, 0) > t.write_stamp for b in t.src_blocks
        )
        if changed:
            self._release(t)
            self._write(t, line)

    def _drop_writer(self, t: _Xfer) -> None:
        for b in set(t.dst_blocks):
            s = self._writers.get((t.dst, b))
            if s is not None:
                s.discard(t.tid)
                if not s:
                    del self._writers[(t.dst, b)]
