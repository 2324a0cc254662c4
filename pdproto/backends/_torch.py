"""Replay a history on real paged KV buffers with torch (CPU or CUDA).

This module and its rooms are the only ones of pdproto that import torch
(with :mod:`._quant`, which they load for fp8).  See docs/replay.md.

:class:`TorchBackend` composes one room per concept, each a mixin in its own
module: :mod:`._kv_memory` (pool sizes, workers and their pools, CUDA
streams), :mod:`._kv_values` (the expected KV and the writes that store it),
:mod:`._kv_transfers` (a transfer's plan, read, staging and landing),
:mod:`._kv_verify` (what a commit or a decode reads, checked),
:mod:`._kv_report` (the corruption reports) and :mod:`._kv_handlers` (one
handler per event kind; :data:`_DISPATCH` below maps each kind to one).  The
vocabulary they share is in :mod:`._kv_common` (dtypes, the value encoding,
the layout) and :mod:`._kv_state` (a worker, a generation, a transfer in
flight).  This module keeps the constructor, the public methods and the
dispatch table.

:class:`TorchBackend` executes the events of a history (format v1 and 1.1) on
paged KV pools, one tensor per (pipeline stage, tensor-parallel rank) of each
worker, and verifies every byte a commit makes readable and a decode reads.
It is sans-IO, like the monitor: ``apply(event, line) -> list[Violation]``
per event, ``finish() -> list[Violation]`` at the end.  Data-level problems
are reported as :class:`KVCorruption` (a :class:`~pdproto.Violation` whose
invariant is ``"kv-corruption"``).

Layout.  A worker holds one tensor per *part* (stage ``s`` of ``pp``, rank
``r`` of ``tp``), shaped ``[blocks, block_size, stage layers, K/V (2, or 1
for MLA), local KV heads (1 for MLA), head_dim]`` (slot-major, like a
flash-attention paged cache).  The prompt token at
position ``p`` of a generation lives in its block table at index
``p // block_size``, slot ``p % block_size``; a generation's table on a worker
is its shared blocks (``share``) followed by the blocks it allocated there.

Expected content.  Each position's KV is a function of (origin tag, layer,
K/V, position, head, dim, token code): the origin of a prompt position is the
generation whose prefill computed it (itself, or, through a ``share``, the
generation the shared block's KV came from, snapshotted at the share).

Timing (adversarial, deterministic):

- prefill writes the positions it processed at ``prefill_done``;
- a transfer reads its source at ``transfer_read_done`` (or at
  ``transfer_write_done`` when that comes first) and its writes land at
  ``transfer_write_done``: only the layers and token positions (slots) of its
  range move.  A read done after ``write_done`` lands again if the source
  changed in between;
- ``transfer_failed`` before the writes landed poisons the target slots;
  ``free`` of a block's last reference poisons it; ``restart`` poisons the
  whole pool;
- ``finish()`` lets every transfer still in flight read and write at the end
  of the history, after writing a *probe* into target blocks freed or
  re-allocated under it, and then verifies.

Verification is linear in the KV written: every block carries a version (the
clock of its last modification, and the slots that modification touched); a
generation remembers, per table index, the version and slots it verified, and
re-checks only the slots modified since.

A copy between ``read_done`` and ``write_done`` is lazy: if the source is not
modified in between, the write copies directly from the source; the first
modification of a source block first copies the source into a staging buffer
(copy-on-write), taken from a free list that is reused across handoffs.

On CUDA the copies run on a side stream, ordered after the work already issued
on the current stream (``wait_stream``); each records a ``torch.cuda.Event`` and
later work on the current stream touching the same worker first waits for it.

Memory.  Pools are allocated lazily, to the blocks the history touches (a
declared pool size caps the doubling, it is not allocated up front).  Before
anything grows, the bytes are computed; over ``max_memory``
(:data:`DEFAULT_MAX_MEMORY` unless raised; ``pdproto replay --max-memory``) the
backend raises :class:`~pdproto._errors.LimitError` instead.  Positions a
decode or prefill names beyond its block table are reported, never allocated.
"""

from __future__ import annotations

import array
import copy as _copy
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np  # noqa: I001 - the torch extra brings it (torch.from_numpy needs it too)
import torch  # first: without the torch extra, the missing module is torch

from .._errors import UsageError
from ..spec import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    Free,
    HistoryHeader,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Share,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    Violation,
)
from ._kv_common import _CODE_DIMS, _M32, _NP_BITS, _PROBE, _PROMPT, _bit_table, _device, _mix_py, _nan_bits
from ._kv_common import DEFAULT_MAX_MEMORY as DEFAULT_MAX_MEMORY
from ._kv_common import FP8 as FP8
from ._kv_common import KV_CORRUPTION as KV_CORRUPTION
from ._kv_common import KV_CORRUPTION_RULE as KV_CORRUPTION_RULE
from ._kv_common import LAYOUTS as LAYOUTS
from ._kv_common import SCALES as SCALES
from ._kv_common import TIMINGS as TIMINGS
from ._kv_common import TORCH_DTYPES as TORCH_DTYPES
from ._kv_common import KVLayout as KVLayout
from ._kv_common import _fmt as _fmt
from ._kv_common import _witness as _witness
from ._kv_common import canonical_dtype as canonical_dtype
from ._kv_common import parse_tp as parse_tp
from ._kv_common import rank_heads as rank_heads
from ._kv_common import torch_threads as torch_threads
from ._kv_handlers import _Handlers
from ._kv_memory import _Memory
from ._kv_report import _Reports
from ._kv_state import _COPY, _POISON, _VERIFY, _WRITE, _Gen, _opt, _Worker, _Xfer
from ._kv_state import BackendStatistics as BackendStatistics
from ._kv_state import KVCorruption as KVCorruption
from ._kv_transfers import _Transfers
from ._kv_values import _Values
from ._kv_verify import _Verification
from ._registry import make_transport
from ._transport import CopyTransport, Transport

__all__ = [
    "KV_CORRUPTION",
    "KV_CORRUPTION_RULE",
    "DEFAULT_MAX_MEMORY",
    "TORCH_DTYPES",
    "BackendStatistics",
    "KVCorruption",
    "KVLayout",
    "TorchBackend",
    "rank_heads",
    "parse_tp",
]


class TorchBackend(_Handlers, _Verification, _Reports, _Transfers, _Values, _Memory):
    """Execute a history on real paged KV pools and verify what decode reads.

    ``TorchBackend(header, device="cpu", dtype=None, tp=None, layers=None,
    kv_heads=None, head_dim=None, block_size=None)``: every shape option left
    None comes from the header (format 1.1 ``kv``; the tensor-parallel and
    pipeline sizes from each worker's ``tp`` / ``pp``), else from the
    defaults (bfloat16, tp 1:1, 2 layers, 4 KV heads, head dim 8, block size
    4).  An option given explicitly overrides the header.  ``apply(event,
    line)`` returns the :class:`KVCorruption` violations the event made
    visible; ``finish()`` lets in-flight transfers land and verifies what is
    left.  ``violations`` accumulates them.  ``head_map`` (destination global
    head -> source global head) deliberately mis-routes heads, and
    ``drop_scales`` makes transfers leave fp8 per-block scales behind, and
    ``static_scales`` ({worker: scale}) gives a worker another per-tensor /
    per-head scale: for tests.  ``clock`` (default ``time.perf_counter``;
    e.g. ``time.process_time``) times the data work that :meth:`statistics`
    reports.  ``transport``: how transfers move KV between pools, ``"copy"``
    (default), ``"nixl"``, ``"mooncake"`` or a
    :class:`~pdproto.backends._transport.Transport` (shared by the backend's
    copies; see docs/replay.md, "Transports").  ``timing``: ``"adversarial"``
    (default: a transfer reads at ``transfer_read_done`` and its writes land
    at ``transfer_write_done``, the latest they can) or ``"eager"`` (it is
    posted at ``transfer_start`` and the replay waits for it to complete
    before the next event: the earliest, as a transfer library on an idle
    host does).  ``policy`` (``"push"`` / ``"pull"``): who initiates a
    transfer through the transport, default the header's (``replay
    --policy`` passes the one the monitor judges by).
    """

    def __init__(
        self,
        header: HistoryHeader | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        tp: tuple[int, int] | str | None = None,
        layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        block_size: int | None = None,
        layout: str | None = None,
        scale: str | None = None,
        head_map: Sequence[int] | None = None,
        drop_scales: bool = False,
        static_scales: Mapping[str, float] | None = None,
        min_blocks: int = 8,
        max_memory: int | None = DEFAULT_MAX_MEMORY,
        clock: Callable[[], float] | None = None,
        transport: str | Transport | None = None,
        timing: str = "adversarial",
        policy: str | None = None,
    ) -> None:
        header = header if header is not None else HistoryHeader()
        kv = getattr(header, "kv", None)
        if getattr(header, "version", 1) == 1:
            kv = None  # a version 1 header's kv key is ignored
        if block_size is None:
            block_size = header.block_size  # kv.block_size, else a version 1 block_size key

        def pick(flag: Any, key: str, default: Any) -> Any:
            if flag is not None:
                return flag
            value = getattr(kv, key, None) if kv is not None else None
            return default if value is None else value

        lay = pick(layout, "layout", "mha")
        dt = pick(dtype, "dtype", "bfloat16")
        sc = (
            scale
            if scale is not None
            else (kv.scale if kv is not None and canonical_dtype(dt) in FP8 else None)
        )
        self.layout = KVLayout(
            _opt(pick(layers, "layers", 2), "layers"),
            1 if lay == "mla" else _opt(pick(kv_heads, "kv_heads", 4), "kv_heads"),
            pick(head_dim, "head_dim", 8),
            _opt(block_size if block_size is not None else 4, "block_size"),
            canonical_dtype(dt),
            lay,
            sc,
        )
        self.header = header
        self.transport = make_transport(transport)
        if timing not in TIMINGS:
            raise UsageError("--transfer-timing", timing, "one of " + ", ".join(TIMINGS))
        self.timing = timing
        if policy not in (None, "push", "pull"):
            raise UsageError("--policy", policy, "push or pull")
        self._pull = (policy if policy is not None else getattr(header, "policy", "push")) == "pull"
        self._fail_targets: dict[
            tuple, torch.Tensor
        ] = {}  # (worker, shape, dtype) -> a failed transfer's target
        self._recompute = getattr(header, "boundary", "sampled") == "recompute"
        self.tp = parse_tp(tp)
        self._tp_flag = tp is not None
        if max_memory is not None and (type(max_memory) is not int or max_memory < 1):
            raise UsageError("max_memory", max_memory, "a number of bytes >= 1, or None for no limit")
        self.max_memory = max_memory
        self.min_blocks = min_blocks
        self._par: dict[str, tuple[int, int]] = {}  # worker -> (tp, pp)
        self.memory = self._fixed_bytes()  # bytes allocated: the pools, the value table, staging
        self._check_sizes(header)
        self.device = _device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not isinstance(self.transport, CopyTransport):
            raise UsageError(
                f"--device with --transport {self.transport.name}",
                str(self.device),
                "cpu (the transports move host memory)",
            )
        L = self.layout
        if head_map is not None:
            head_map = list(head_map)
            if len(head_map) != L.kv_heads or any(
                type(h) is not int or not 0 <= h < L.kv_heads for h in head_map
            ):
                raise UsageError("head_map", head_map, f"{L.kv_heads} head indices in [0, {L.kv_heads})")
        self.head_map = head_map
        self.drop_scales = drop_scales
        self.static_scales = dict(static_scales or {})
        self._quant = importlib.import_module("pdproto.backends._quant") if L.fp8 else None
        self._shares = "share" in (getattr(header, "features", None) or ())
        self.violations: list[Violation] = []
        self.events = 0
        self.line = 0
        self.bytes_copied = 0
        self.bytes_verified = 0
        self._timer = clock if clock is not None else time.perf_counter
        self._sec = [0.0, 0.0, 0.0, 0.0]  # write, copy, verify, poison (see statistics())
        self._nbytes = [0, 0, 0, 0]  # write, staged copies, (bytes_verified), poison
        self._out: list[Violation] = []
        self._clock = 0
        self._workers: dict[str, _Worker] = {}
        self._owner: dict[tuple[str, int], list[tuple[str, int]]] = {}  # block -> owners (references)
        self._alloc: dict[tuple[str, int], dict[str, list[int]]] = {}  # gen -> worker -> allocated blocks
        self._gens: dict[tuple[str, int], _Gen] = {}
        self._tags: list[tuple[str, int]] = []
        self._tickets: dict[str, tuple[tuple[str, int], str, tuple[int, ...]]] = {}
        self._xfers: dict[str, _Xfer] = {}
        self._lazy: dict[tuple[str, int], set[str]] = {}  # source block -> transfers read lazily
        self._writers: dict[tuple[str, int], set[str]] = {}  # target block -> transfers not landed
        self._final: dict[tuple[str, int], tuple[str, int]] = {}  # decode block -> gen to check
        self._segments: dict[tuple, list] = {}
        self._pending_events: dict[str, list[Any]] = {}
        self._reported: set[tuple] = set()
        self._staging: dict[tuple, list[torch.Tensor]] = {}  # free staging buffers by row shape
        self._scratch: dict[tuple, torch.Tensor] = {}  # expected values are built here (see _scratch_for)
        self._row_memo: dict[tuple, torch.Tensor] = {}  # (tag, start, count, code) -> rows (never written to)
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._vdtype = torch.float32 if L.fp8 else L.torch_dtype  # the dtype values are made in
        self._nan = 0x7F if L.fp8 else _nan_bits(L.torch_dtype)
        self._qcache: dict[tuple, torch.Tensor] = {}
        self._qf = self._make_q()
        radix, half, div = L.encoding
        self._radix, self._half, self._div = radix, half, float(div)
        self._mults = [(_mix_py(d, 0x77) | 1) for d in range(L.head_dim - _CODE_DIMS)]
        self._mults_t = torch.tensor(self._mults, dtype=torch.int64, device=self.device).view(1, -1)
        # the bits of every value a row holds: codes 0..R, then hashed k / S for k in 0..A
        values = [float(c) for c in range(radix + 1)] + [k / div for k in range(half + 1)]
        self._acode, self._enc = _bit_table(values, self._vdtype)
        self._enc_np = np.array(array.array(self._acode, self._enc)).view(_NP_BITS[self._acode])
        self._mults_np = np.array(self._mults, dtype=np.uint64).reshape(1, -1)
        self._probe_tag = self._tag_of(_PROBE)

    # -- public --------------------------------------------------------------

    def apply(self, event: Event, line: int | None = None) -> list[Violation]:
        """Execute one event; return the data-level violations it made visible."""
        handler = _DISPATCH.get(type(event))
        if handler is None:  # refused before anything changes, as the monitor does
            raise UsageError(
                "event", event, "one of the event classes " + ", ".join(c.__name__ for c in _DISPATCH)
            )
        self.line = self.line + 1 if line is None else line
        self.events += 1
        out = self._out = []
        handler(self, event, self.line)
        if out:
            self.violations.extend(out)
        return out

    def finish(self) -> list[Violation]:
        """End of the history: every transfer still in flight reads and writes
        now (the latest it can); blocks freed or re-allocated under a write
        still in flight get a probe first; then every probe, every drained
        transfer's target and every live generation's readable KV is
        verified."""
        out = self._out = []
        line = self.line
        # what is readable now, before the late writes land
        for g in list(self._gens.values()):
            if g.terminal or g.key == _PROBE:
                continue
            if g.last_decode is not None:
                self._final_check(g, line)
            elif g.committed is not None:
                worker, table, cline = g.committed
                if self._owned(g.key, worker, table):
                    self._verify(
                        g,
                        worker,
                        table,
                        self._prompt(g),
                        line,
                        "end of the history: committed KV",
                        [cline, g.prefill_line],
                    )
            else:
                for tid in reversed(g.transfers):
                    t = self._xfers[tid]
                    if t.wrote and not t.failed and not t.lost and not t.cancelled:
                        self._verify_transfer(t, line, "end of the history: KV of transfer")
                        break
        probes: list[tuple[str, int, _Xfer]] = []
        for t in self._xfers.values():
            if t.failed or t.wrote:
                continue
            for b in set(t.dst_blocks):
                owners = self._owner.get((t.dst, b))
                if b in t.early_freed or (owners and t.key not in owners):
                    probes.append((t.dst, b, t))
        for worker, b, _t in probes:
            self._write_probe(worker, b, line)
        drained = []
        for t in list(self._xfers.values()):
            if t.failed:
                continue
            if not t.wrote:
                if not t.read:
                    self._read(t, line)
                self._write(t, line)
                t.drained = True
                drained.append(t)
            elif not t.read and not t.lost:
                self._late_read(t, line)
                t.drained = True
                drained.append(t)
        seen = set()
        for worker, b, t in probes:
            if (worker, b) in seen:
                continue
            seen.add((worker, b))
            self._verify_probe(worker, b, t, line)
        for t in drained:
            self._verify_transfer(t, line, "end of the history: transfer landing at the end")
        self.violations.extend(out)
        return out

    @property
    def ok(self) -> bool:
        return not self.violations

    def statistics(self) -> BackendStatistics:
        """A snapshot of the seconds and bytes of the data work so far
        (:class:`BackendStatistics`)."""
        sec, nb = self._sec, self._nbytes
        return BackendStatistics(
            getattr(self._timer, "__qualname__", repr(self._timer)),
            sec[_WRITE],
            nb[_WRITE],
            sec[_COPY],
            self.bytes_copied + nb[_COPY],
            sec[_VERIFY],
            self.bytes_verified,
            sec[_POISON],
            nb[_POISON],
        )

    def copy(self) -> TorchBackend:
        """An independent backend in the same state.  On CUDA the copy is made on
        the current stream after the side stream's pending copies (the new
        backend has none pending)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._stream)
            for evs in self._pending_events.values():
                evs.clear()
        new = object.__new__(TorchBackend)
        d = self.__dict__.copy()
        d["violations"] = list(self.violations)
        d["_out"] = []
        d["_workers"] = {k: w.copy() for k, w in self._workers.items()}
        d["_owner"] = {k: list(v) for k, v in self._owner.items()}
        d["_alloc"] = {k: {w: list(b) for w, b in v.items()} for k, v in self._alloc.items()}
        d["_gens"] = {k: g.copy() for k, g in self._gens.items()}
        d["_tags"] = list(self._tags)
        d["_tickets"] = dict(self._tickets)
        d["_xfers"] = {k: t.copy() for k, t in self._xfers.items()}
        d["_lazy"] = {k: set(v) for k, v in self._lazy.items()}
        d["_writers"] = {k: set(v) for k, v in self._writers.items()}
        d["_final"] = dict(self._final)
        d["_segments"] = dict(self._segments)
        d["_pending_events"] = {k: [] for k in self._pending_events}
        d["_reported"] = set(self._reported)
        d["_staging"] = {}
        d["_scratch"] = {}
        d["_row_memo"] = dict(self._row_memo)
        d["_sec"] = list(self._sec)
        d["_nbytes"] = list(self._nbytes)
        if self.cuda:
            d["_stream"] = torch.cuda.Stream(device=self.device)
        new.__dict__ = d
        return new

    def deepcopy(self) -> TorchBackend:
        """:func:`copy.deepcopy` of the backend (CPU only; the reference for :meth:`copy`)."""
        if self.cuda:
            raise UsageError("TorchBackend.deepcopy", str(self.device), "a CPU backend")
        return _copy.deepcopy(self)

    def pool(self, worker: str, rank: int = 0) -> torch.Tensor:
        """The KV pool tensor of ``worker``'s part ``rank`` (stage * tp + tensor-parallel rank)."""
        return self._workers[worker].pools[rank]

    def expected(self, request: str, gen: int, position: int, token: int | None = None) -> torch.Tensor:
        """The KV of one position of a generation, ``[layers, K/V, kv_heads, head_dim]``
        in the pool dtype (fp8: before quantization, float32): the prompt KV,
        or with ``token`` the KV a decode fed ``token`` writes."""
        g = self._gens[(request, gen)]
        code = _PROMPT if token is None else (token + 1) & _M32
        L = self.layout
        return self._values([g.tag], position, [code], (0, L.layers, tuple(range(L.kv_heads))))[0]


_DISPATCH: dict[type, Callable[[TorchBackend, Any, int], None]] = {
    Submit: TorchBackend._on_submit,
    Reserve: TorchBackend._on_reserve,
    PrefillStart: TorchBackend._on_prefill_start,
    PrefillDone: TorchBackend._on_prefill_done,
    Alloc: TorchBackend._on_alloc,
    Share: TorchBackend._on_share,
    TransferStart: TorchBackend._on_transfer_start,
    TransferReadDone: TorchBackend._on_transfer_read_done,
    TransferWriteDone: TorchBackend._on_transfer_write_done,
    TransferFailed: TorchBackend._on_transfer_failed,
    TransferAbort: TorchBackend._on_transfer_abort,
    Commit: TorchBackend._on_commit,
    Decode: TorchBackend._on_decode,
    Finish: TorchBackend._on_end,
    Cancel: TorchBackend._on_end,
    Fail: TorchBackend._on_end,
    Free: TorchBackend._on_free,
    Restart: TorchBackend._on_restart,
}
