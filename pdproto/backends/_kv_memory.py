"""The torch backend's memory room: pool sizes and the memory limit, workers and
their lazily grown pools, the CUDA stream discipline (a mixin of
:class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch  # first: without the torch extra, the missing module is torch

from .._errors import LimitError, UsageError
from ..spec import (
    HistoryHeader,
)
from ._kv_common import (
    _amount,
    _bytes,
    _heads_per_rank,
    _slots,
    rank_heads,
)
from ._kv_state import (
    _LOG_MAX,
    _Worker,
)


class _Memory:
    """Memory, workers and pools, CUDA streams.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    # -- memory --------------------------------------------------------------

    def _parallel(self, name: str, role: str) -> tuple[int, int]:
        """(tp, pp) of a worker: the flag when given, else the header's, else 1."""
        par = self._par.get(name)
        if par is not None:
            return par
        spec = self.header.workers.get(name) if self.header.workers else None
        tp = self.tp[0] if role == "prefill" else self.tp[1]
        if not self._tp_flag and spec is not None and getattr(spec, "tp", None) is not None:
            tp = spec.tp
        pp = getattr(spec, "pp", None) if spec is not None else None
        pp = pp or 1
        if pp > self.layout.layers or self.layout.layers % pp:
            raise UsageError(f"pp of worker {name!r}", pp, f"a divisor of the {self.layout.layers} layers")
        self._par[name] = (tp, pp)
        return tp, pp

    def _part_bytes(self, tp: int, pp: int) -> int:
        """Bytes of one block over every part of a worker with ``tp`` ranks and ``pp`` stages."""
        L = self.layout
        heads = 1 if L.layout == "mla" else _heads_per_rank(tp, L.kv_heads)
        scale = 4 * L.kv * L.layers * tp if L.fp8 and L.scale == "per-block" else 0
        return tp * heads * L.layers * L.kv * L.block_size * L.head_dim * L.elem_bytes + scale

    def block_bytes(self, role: str) -> int:
        """Bytes of one block over every rank of a worker of ``role`` (at the flag's tp)."""
        return self._part_bytes(self.tp[0] if role == "prefill" else self.tp[1], 1)

    def _fixed_bytes(self) -> int:
        """Bytes the backend holds besides the pools (the table of values)."""
        L = self.layout
        return L.layers * L.kv * L.kv_heads * L.head_dim * 4

    def _check_sizes(self, header: HistoryHeader) -> None:
        """Before allocating anything: the smallest pool of each role (and of
        each declared worker) must fit in ``max_memory``.  Declared pool sizes
        are not allocated up front: pools grow to the blocks the history
        touches."""
        if self.max_memory is None:
            return
        need = self._fixed_bytes()
        roles = set()
        for name, spec in (header.workers or {}).items():
            tp, pp = self._parallel(name, spec.role)
            need += min(spec.blocks, self.min_blocks) * self._part_bytes(tp, pp)
            roles.add(spec.role)
        for role in ("prefill", "decode"):
            if role not in roles:
                need += self.min_blocks * self.block_bytes(role)
        if need > self.max_memory:
            L = self.layout
            raise LimitError(
                f"replay with {L.layers} layers x {L.kv_heads} KV heads x head dim {L.head_dim}, "
                f"block size {L.block_size}, {L.dtype}, tp {self.tp[0]}:{self.tp[1]}, a pool per worker",
                need,
                self.max_memory,
                "--max-memory (max_memory=)",
            )

    def _reserve(self, w: _Worker, nblocks: int, top: int) -> int:
        """The block count to grow ``w`` to (at least ``nblocks``, ideally
        ``top``), within ``max_memory``; LimitError when even ``nblocks`` is over."""
        if self.max_memory is None:
            return top
        per = self._part_bytes(w.tp, w.pp)
        base = self.memory - w.nblocks * per
        if base + top * per <= self.max_memory:
            return top
        if base + nblocks * per <= self.max_memory:
            return nblocks
        raise LimitError(
            f"the pool of worker {w.name!r}, {_amount(nblocks)} blocks for block id {_amount(nblocks - 1)},",
            base + nblocks * per,
            self.max_memory,
            "--max-memory (max_memory=)",
            line=self.line,
        )

    # -- workers and pools ---------------------------------------------------

    def _worker(self, name: str, role: str | None = None, need: Iterable[int] = ()) -> _Worker | None:
        w = self._workers.get(name)
        if w is None:
            declared = self.header.workers.get(name) if self.header.workers else None
            if declared is not None:
                role = declared.role
            if role is None:
                return None
            tp, pp = self._parallel(name, role)
            L = self.layout
            heads = [[0]] * tp if L.layout == "mla" else rank_heads(tp, L.kv_heads)
            per = L.layers // pp
            parts = [(s * per, (s + 1) * per, tuple(hs)) for s in range(pp) for hs in heads]
            w = _Worker(name, role, tp, pp, parts, heads, declared.blocks if declared is not None else None)
            w.static_scale = float(self.static_scales.get(name, 1.0))
            w.pos_bytes = sum((l1 - l0) * len(hs) for l0, l1, hs in parts) * L.kv * L.head_dim * L.elem_bytes
            first = min(self.min_blocks, w.cap) if w.cap is not None else self.min_blocks
            self._grow(w, self._reserve(w, max(first, 1), max(first, 1)))
            self._workers[name] = w
            self._pending_events[name] = []
        need = list(need)
        if need:
            top = max(need)
            if top >= w.nblocks:
                want = 2 * w.nblocks
                if w.cap is not None and top < w.cap:
                    want = min(want, w.cap)
                self._grow(w, self._reserve(w, top + 1, max(want, top + 1)))
        return w

    def _grow(self, w: _Worker, nblocks: int) -> None:
        L = self.layout
        self._main_touch(w.name)
        new, scales = [], []
        for i, (l0, l1, hs) in enumerate(w.parts):
            shape = (nblocks, L.block_size, l1 - l0, L.kv, len(hs), L.head_dim)
            t = torch.empty(shape, dtype=L.torch_dtype, device=self.device)
            _bytes(t).fill_(self._nan)  # poison, as a free leaves it
            if w.pools:
                _bytes(t)[: w.nblocks].copy_(_bytes(w.pools[i]))
            new.append(t)
            if L.fp8:
                if L.scale == "per-block":
                    s = torch.full((nblocks, 1, l1 - l0, L.kv, 1, 1), float("nan"), device=self.device)
                    if w.scales:
                        s[: w.nblocks].copy_(w.scales[i])
                elif w.scales:
                    s = w.scales[i]
                else:
                    s = torch.full(
                        (1, 1, l1 - l0, L.kv, len(hs) if L.scale == "per-head" else 1, 1),
                        self._static_scale(w),
                        device=self.device,
                    )
                scales.append(s)
        w.pools = new
        w.flats = [_slots(t) for t in new]
        w.scales = scales
        self.memory += (nblocks - w.nblocks) * self._part_bytes(w.tp, w.pp)
        w.nblocks = nblocks

    def _touch(
        self, w: _Worker, blocks: Iterable[int], line: int, lo: int = 0, hi: int | None = None
    ) -> None:
        """``blocks`` of ``w`` were modified (slots ``lo..hi``): a new version."""
        self._clock += 1
        c = self._clock
        hi = self.layout.block_size if hi is None else hi
        stamp, mod, log = w.stamp, w.mod, w.log
        for b in blocks:
            mod[b] = (stamp.get(b, 0), lo, hi)
            stamp[b] = c
            w.last_write[b] = line
            log.append(b)
        if len(log) > _LOG_MAX:
            self._restart_log(w)

    @staticmethod
    def _restart_log(w: _Worker) -> None:
        """Start ``w``'s modification log afresh: verifications look at every block once more."""
        w.log = []
        w.epoch += 1

    def _version(self, w: _Worker, b: int) -> int:
        s = w.stamp.get(b, 0)
        return s if s >= w.restart_stamp else w.restart_stamp

    # -- CUDA stream discipline ---------------------------------------------

    def _main_touch(self, *workers: str) -> None:
        """Before current-stream work on ``workers``: wait for side-stream copies."""
        if not self.cuda:
            return
        cur = torch.cuda.current_stream(self.device)
        for name in workers:
            evs = self._pending_events.get(name)
            if evs:
                for e in evs:
                    cur.wait_event(e)
                evs.clear()

    def _side(self, fn: Callable[[], Any], workers: Iterable[str]) -> Any:
        """Run copy work ``fn`` on the side stream (CUDA) or now (CPU)."""
        if not self.cuda:
            return fn()
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            result = fn()
            e = torch.cuda.Event()
            e.record(s)
        for name in workers:
            self._pending_events.setdefault(name, []).append(e)
        return result
