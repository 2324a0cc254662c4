"""Replay a history on real paged KV buffers with torch (CPU or CUDA).

The only module of pdproto that imports torch.  See docs/replay.md.

:class:`TorchBackend` executes the events of a history (format v1) on one
paged KV pool per worker and verifies every byte a decode reads.  It is
sans-IO, like the monitor: ``apply(event, line) -> list[Violation]`` per
event, ``finish() -> list[Violation]`` at the end.  Data-level problems are
reported as :class:`KVCorruption` (a :class:`~pdproto.Violation` whose
invariant is ``"kv-corruption"``).

Layout.  A worker of tensor-parallel size ``tp`` holds ``tp`` tensors, one per
rank, each shaped ``[blocks, layers, 2 (K/V), local KV heads, block_size,
head_dim]``.  The prompt token at position ``p`` of a generation lives in
its block list at index ``p // block_size``, slot ``p % block_size``.

Timing (adversarial, deterministic):

- prefill writes positions ``0 .. processed_len-1`` at ``prefill_done`` into
  the blocks its ``prefill_start`` named;
- a transfer reads its source at ``transfer_read_done`` (or at
  ``transfer_write_done`` when that comes first: nothing can be written that
  was not read) and its writes land at ``transfer_write_done``.  When the
  read was done after ``write_done`` in the history and the source changed in
  between, the late read lands again (the writes depended on it);
- ``transfer_failed`` before the writes landed poisons the target (a partial
  write); ``free`` poisons its blocks; ``restart`` poisons the whole pool;
- ``finish()`` lets every transfer still in flight read and write at the end
  of the history (the latest it can), after writing a *probe* into target
  blocks freed or re-allocated under it, and then verifies.

A copy between ``read_done`` and ``write_done`` is lazy: if the source is not
modified in between, the write copies directly from the source (one copy);
the first modification of a source block first materialises a staging copy
(copy-on-write).  So the bytes delivered are always those of the source at
``read_done``.

On CUDA the copies run on a side stream, ordered after the work already
issued on the current stream (``wait_stream``); each records a
``torch.cuda.Event`` and any later work on the current stream that touches
the same worker (free's poison, prefill, decode, verification) first waits
for those events (``wait_event``).

Memory.  The pools a replay needs are computed before they are allocated:
the pools the header declares (and the smallest pool of a worker of each
role) when the backend is made, and each pool's growth when an event names a
block past its end.  Over ``max_memory`` bytes (:data:`DEFAULT_MAX_MEMORY`
unless raised; ``pdproto replay --max-memory``) the backend raises
:class:`~pdproto._errors.LimitError` instead.  Positions a decode or prefill
names beyond its block table are reported, never allocated.  Nothing in the copy path synchronises
the device.  The CPU path executes the same operations at the same points,
synchronously.
"""

from __future__ import annotations

import copy as _copy
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import torch

from .._errors import LimitError, UsageError, parse_int
from ..spec._events import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    Free,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
)
from ..spec._history import HistoryHeader
from ..spec._monitor import Violation

__all__ = [
    "KV_CORRUPTION",
    "KV_CORRUPTION_RULE",
    "DEFAULT_MAX_MEMORY",
    "TORCH_DTYPES",
    "KVCorruption",
    "KVLayout",
    "TorchBackend",
    "rank_heads",
    "parse_tp",
]

KV_CORRUPTION = "kv-corruption"
KV_CORRUPTION_RULE = (
    "(data level, pdproto replay --backend torch) the KV a decode reads, or a commit makes "
    "readable, is not exactly its generation's: some position 0..position-1 holds poison, "
    "another generation's KV, KV of another position, head or input token"
)

#: The KV pools of one replay may take at most this many bytes unless the
#: caller (``max_memory=``, ``pdproto replay --max-memory``) allows more.
DEFAULT_MAX_MEMORY = 4 << 30

#: The torch dtype of each KV dtype name.
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16",
                  "float": "float32", "fp64": "float64", "double": "float64"}

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of a 32-bit value stay inside int64
_CODE = 125  # codes in the first four dims are 1 .. 125: exact in bf16
_HASH_MOD = 251  # hashed dims are (x % 251 - 125) / 64: exact in bf16 (8 bits)
_NO_TOKEN = _M32  # token code of a position no write is expected to have made
_PROMPT = 0  # token code of prompt positions
_CODE_DIMS = 4  # tag lo, tag hi, position, head
_PROBE = ("<probe>", 0)


def _mix_py(*parts: int) -> int:
    x = 0x1234567
    for p in parts:
        x = (x ^ (p & _M32)) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (x >> 16) ^ x
    return x


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def parse_tp(text: str | Sequence[int] | None) -> tuple[int, int]:
    """``"2:1"`` -> ``(2, 1)``: P-side and D-side tensor-parallel sizes."""
    if text is None:
        return (1, 1)
    if not isinstance(text, str):
        a, b = text
        parts = [a, b]
    else:
        bits = text.split(":")
        if len(bits) != 2:
            raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1")
        try:
            parts = [parse_int(b, "--tp", minimum=1) for b in bits]
        except UsageError:
            raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1") from None
    if any(type(p) is not int or p < 1 for p in parts):
        raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1")
    return (parts[0], parts[1])


def rank_heads(tp: int, kv_heads: int) -> list[list[int]]:
    """The global KV heads each rank of a ``tp``-sized worker holds.

    ``tp <= kv_heads``: rank ``r`` holds ``[r*H/tp, (r+1)*H/tp)``; ``tp >
    kv_heads``: heads are replicated, rank ``r`` holds head ``r // (tp/H)``.
    """
    if tp < 1:
        raise UsageError("tensor-parallel size", tp, "an integer >= 1")
    if tp <= kv_heads:
        if kv_heads % tp:
            raise UsageError("tensor-parallel size", tp, f"a divisor or multiple of the {kv_heads} KV heads")
        n = kv_heads // tp
        return [list(range(r * n, (r + 1) * n)) for r in range(tp)]
    if tp % kv_heads:
        raise UsageError("tensor-parallel size", tp, f"a divisor or multiple of the {kv_heads} KV heads")
    rep = tp // kv_heads
    return [[r // rep] for r in range(tp)]


@attrs.frozen
class KVLayout:
    """The shape of every worker's paged KV pool."""

    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 8
    block_size: int = 4
    dtype: str = "bfloat16"

    def __attrs_post_init__(self) -> None:
        for name in ("layers", "kv_heads", "block_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise UsageError(name, v, "an integer >= 1")
        if type(self.head_dim) is not int or self.head_dim < _CODE_DIMS + 1:
            raise UsageError("head_dim", self.head_dim, f"an integer >= {_CODE_DIMS + 1}")
        if self.kv_heads > _CODE:
            raise UsageError("kv_heads", self.kv_heads, f"at most {_CODE}")
        if canonical_dtype(self.dtype) != self.dtype:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all heads (all ranks of a tp=1 worker)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.block_size * self.head_dim * elem


def canonical_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in TORCH_DTYPES:
        raise UsageError("dtype", name, "one of " + ", ".join(TORCH_DTYPES) + " (or bf16, fp16, fp32)")
    return name


def _heads_per_rank(tp: int, kv_heads: int) -> int:
    """KV heads each rank of a ``tp``-sized worker holds (see :func:`rank_heads`)."""
    return kv_heads // tp if tp <= kv_heads else 1


@attrs.frozen
class KVCorruption(Violation):
    """A data-level violation: the bytes a decode (or commit) reads are wrong.

    Besides the fields of :class:`~pdproto.Violation`: ``layer``,
    ``position``, ``head`` (global KV head) and ``rank`` of the first wrong
    element, and ``found``: what is there instead (``"poison"``, ``{"request",
    "gen", "position", "head"}`` decoded from the element, or None when it
    cannot tell).
    """

    layer: int | None = attrs.field(default=None, kw_only=True)
    position: int | None = attrs.field(default=None, kw_only=True)
    head: int | None = attrs.field(default=None, kw_only=True)
    rank: int | None = attrs.field(default=None, kw_only=True)
    found: Any = attrs.field(default=None, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "invariant": self.invariant,
            "line": self.line,
            "message": self.message,
            "witness": list(self.witness),
        }
        for name in ("request", "gen", "worker", "block", "layer", "position", "head", "rank",
                     "transfer", "ticket", "found"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class _Worker:
    __slots__ = ("name", "role", "tp", "heads", "pools", "nblocks", "stamp", "restart_stamp",
                 "restart_line", "last_write")

    def __init__(self, name: str, role: str, tp: int, heads: list[list[int]]) -> None:
        self.name = name
        self.role = role
        self.tp = tp
        self.heads = heads
        self.pools: list[torch.Tensor] = []
        self.nblocks = 0
        self.stamp: dict[int, int] = {}  # block -> clock of its last modification
        self.restart_stamp = 0
        self.restart_line: int | None = None
        self.last_write: dict[int, int] = {}  # block -> line of its last write or poison

    def copy(self) -> "_Worker":
        n = object.__new__(_Worker)
        n.name, n.role, n.tp, n.heads = self.name, self.role, self.tp, self.heads
        n.pools = [p.clone() for p in self.pools]
        n.nblocks = self.nblocks
        n.stamp = dict(self.stamp)
        n.restart_stamp, n.restart_line = self.restart_stamp, self.restart_line
        n.last_write = dict(self.last_write)
        return n


class _Gen:
    __slots__ = ("key", "tag", "prompt_len", "processed_len", "first_token", "prefill",
                 "prefill_line", "exp_tok", "terminal", "committed", "last_decode", "transfers")

    def __init__(self, key: tuple[str, int], tag: int) -> None:
        self.key = key
        self.tag = tag
        self.prompt_len: int | None = None
        self.processed_len: int | None = None
        self.first_token: int | None = None
        self.prefill: dict[str, tuple[int, ...]] = {}  # worker -> blocks of prefill_start
        self.prefill_line: int | None = None
        self.exp_tok: dict[int, int] = {}  # position >= prompt_len -> token expected there
        self.terminal = False
        self.committed: tuple[str, tuple[int, ...], int] | None = None  # worker, table, line
        self.last_decode: tuple[str, tuple[int, ...], int, int] | None = None  # worker, table, pos, line
        self.transfers: list[str] = []

    def copy(self) -> "_Gen":
        n = object.__new__(_Gen)
        for name in _Gen.__slots__:
            setattr(n, name, getattr(self, name))
        n.prefill = dict(self.prefill)
        n.exp_tok = dict(self.exp_tok)
        n.transfers = list(self.transfers)
        return n


class _Xfer:
    __slots__ = ("tid", "key", "ticket", "src", "src_blocks", "dst", "dst_blocks", "line",
                 "read", "read_line", "staged", "wrote", "write_stamp", "failed", "lost",
                 "early_freed", "drained")

    def __init__(self, ev: TransferStart, line: int) -> None:
        self.tid = ev.transfer
        self.key = (ev.request, ev.gen)
        self.ticket = ev.ticket
        self.src = ev.src
        self.src_blocks = ev.src_blocks
        self.dst = ev.dst
        self.dst_blocks = ev.dst_blocks
        self.line = line
        self.read = False  # the read happened (lazily: see staged)
        self.read_line: int | None = None
        self.staged: list[torch.Tensor] | None = None  # per source rank, once materialised
        self.wrote = False
        self.write_stamp = 0  # clock when the writes landed (to spot later source changes)
        self.failed = False
        self.lost = False  # its source or target worker restarted while in flight
        self.early_freed: set[int] = set()  # target blocks freed while the writes were in flight
        self.drained = False

    def copy(self) -> "_Xfer":
        n = object.__new__(_Xfer)
        for name in _Xfer.__slots__:
            setattr(n, name, getattr(self, name))
        if self.staged is not None:
            n.staged = list(self.staged)  # snapshots are never written in place
        n.early_freed = set(self.early_freed)
        return n


class TorchBackend:
    """Execute a history on real paged KV pools and verify what decode reads.

    ``TorchBackend(header, device="cpu", dtype="bfloat16", tp=(1, 1), layers=2,
    kv_heads=4, head_dim=8, block_size=4)``; ``apply(event, line)`` returns
    the :class:`KVCorruption` violations the event made visible;
    ``finish()`` lets in-flight transfers land and verifies what is left.
    ``violations`` accumulates them.  ``head_map`` (a sequence: destination
    global head -> source global head) deliberately mis-routes heads, for
    tests.  The block size comes from ``block_size`` or, when None, from the
    header's ``block_size`` key, else 4.
    """

    def __init__(
        self,
        header: HistoryHeader | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str = "bfloat16",
        tp: tuple[int, int] | str = (1, 1),
        layers: int = 2,
        kv_heads: int = 4,
        head_dim: int = 8,
        block_size: int | None = None,
        head_map: Sequence[int] | None = None,
        min_blocks: int = 8,
        max_memory: int | None = DEFAULT_MAX_MEMORY,
    ) -> None:
        header = header if header is not None else HistoryHeader()
        if block_size is None:
            hb = header.extra.get("block_size") if header.extra else None
            block_size = hb if type(hb) is int and hb >= 1 else 4
        self.layout = KVLayout(layers, kv_heads, head_dim, block_size, canonical_dtype(dtype))
        self.header = header
        self.tp = parse_tp(tp)
        if max_memory is not None and (type(max_memory) is not int or max_memory < 1):
            raise UsageError("max_memory", max_memory, "a number of bytes >= 1, or None for no limit")
        self.max_memory = max_memory
        self.min_blocks = min_blocks
        self.memory = self._fixed_bytes()  # bytes allocated: the pools and the value table
        self._check_sizes(header)
        self.device = _device(device)
        self.cuda = self.device.type == "cuda"
        self._heads = {"prefill": rank_heads(self.tp[0], kv_heads), "decode": rank_heads(self.tp[1], kv_heads)}
        if head_map is not None:
            head_map = list(head_map)
            if len(head_map) != kv_heads or any(type(h) is not int or not 0 <= h < kv_heads for h in head_map):
                raise UsageError("head_map", head_map, f"{kv_heads} head indices in [0, {kv_heads})")
        self.head_map = head_map
        self.violations: list[Violation] = []
        self.events = 0
        self.line = 0
        self.bytes_copied = 0
        self._out: list[Violation] = []
        self._clock = 0
        self._workers: dict[str, _Worker] = {}
        self._owner: dict[tuple[str, int], tuple[str, int]] = {}
        self._gens: dict[tuple[str, int], _Gen] = {}
        self._tags: list[tuple[str, int]] = []
        self._tickets: dict[str, tuple[tuple[str, int], str, tuple[int, ...]]] = {}
        self._xfers: dict[str, _Xfer] = {}
        self._lazy: dict[tuple[str, int], set[str]] = {}  # source block -> transfers read lazily
        self._writers: dict[tuple[str, int], set[str]] = {}  # target block -> transfers not landed
        self._final: dict[tuple[str, int], tuple[str, int]] = {}  # decode block -> gen to check
        self._segments: dict[tuple[str, str], list[list[tuple[int, int, int, int]]]] = {}
        self._pending_events: dict[str, list[Any]] = {}
        self._reported: set[tuple] = set()
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._q = self._make_q()
        self._probe_tag = self._tag_of(_PROBE)

    # -- public --------------------------------------------------------------

    def apply(self, event: Event, line: int | None = None) -> list[Violation]:
        """Execute one event; return the data-level violations it made visible."""
        handler = _DISPATCH.get(type(event))
        if handler is None:  # refused before anything changes, as the monitor does
            raise UsageError("event", event, "one of the event classes " + ", ".join(c.__name__ for c in _DISPATCH))
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
                    self._verify(g, worker, table, g.prompt_len or 0, line,
                                 "end of the history: committed KV", [cline, g.prefill_line])
            else:
                for tid in reversed(g.transfers):
                    t = self._xfers[tid]
                    if t.wrote and not t.failed and not t.lost:
                        self._verify_transfer(t, line, "end of the history: KV of transfer")
                        break
        probes: list[tuple[str, int, _Xfer]] = []
        for t in self._xfers.values():
            if t.failed or t.wrote:
                continue
            for b in set(t.dst_blocks):
                owner = self._owner.get((t.dst, b))
                if b in t.early_freed or (owner is not None and owner != t.key):
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

    def copy(self) -> "TorchBackend":
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
        d["_owner"] = dict(self._owner)
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
        if self.cuda:
            d["_stream"] = torch.cuda.Stream(device=self.device)
        new.__dict__ = d
        return new

    def deepcopy(self) -> "TorchBackend":
        """:func:`copy.deepcopy` of the backend (CPU only; the reference for :meth:`copy`)."""
        if self.cuda:
            raise UsageError("TorchBackend.deepcopy", str(self.device), "a CPU backend")
        return _copy.deepcopy(self)

    def pool(self, worker: str, rank: int = 0) -> torch.Tensor:
        """The KV pool tensor of ``worker``'s rank ``rank`` (for tests and tools)."""
        return self._workers[worker].pools[rank]

    def expected(self, request: str, gen: int, position: int, token: int | None = None) -> torch.Tensor:
        """The KV of one position of a generation, ``[layers, 2, kv_heads, head_dim]``:
        the prompt KV, or with ``token`` the KV a decode fed ``token`` writes."""
        g = self._gens[(request, gen)]
        code = _PROMPT if token is None else (token + 1) & _M32
        return self._values(g.tag, position, [code], list(range(self.layout.kv_heads)))[:, :, :, 0]

    # -- memory --------------------------------------------------------------

    def block_bytes(self, role: str) -> int:
        """Bytes of one block over every rank of a worker of ``role``."""
        L = self.layout
        tp = self.tp[0] if role == "prefill" else self.tp[1]
        elem = torch.empty((), dtype=L.torch_dtype).element_size()
        return tp * _heads_per_rank(tp, L.kv_heads) * L.layers * 2 * L.block_size * L.head_dim * elem

    def _fixed_bytes(self) -> int:
        """Bytes the backend holds besides the pools (the hash table of values)."""
        L = self.layout
        return L.layers * 2 * L.kv_heads * (L.head_dim - _CODE_DIMS) * 8

    def _check_sizes(self, header: HistoryHeader) -> None:
        """Before allocating anything: the pools the header declares, and at
        least one pool of each role, must fit in ``max_memory``."""
        if self.max_memory is None:
            return
        need = self._fixed_bytes()
        roles = set()
        for spec in (header.workers or {}).values():
            need += max(spec.blocks, self.min_blocks) * self.block_bytes(spec.role)
            roles.add(spec.role)
        for role in ("prefill", "decode"):
            if role not in roles:
                need += self.min_blocks * self.block_bytes(role)
        if need > self.max_memory:
            L = self.layout
            raise LimitError(
                f"replay with {L.layers} layers x {L.kv_heads} KV heads x head dim {L.head_dim}, "
                f"block size {L.block_size}, {L.dtype}, tp {self.tp[0]}:{self.tp[1]}, "
                + ("the header's pools " + ", ".join(
                    f"{n} {_amount(s.blocks)} blocks" for n, s in list((header.workers or {}).items())[:4])
                   + (" ..." if len(header.workers or {}) > 4 else "") if header.workers else "a pool per role"),
                need, self.max_memory, "--max-memory (max_memory=)",
            )

    def _reserve(self, w: _Worker, nblocks: int, top: int) -> int:
        """The block count to grow ``w`` to (at least ``nblocks``, ideally
        ``top``), within ``max_memory``; LimitError when even ``nblocks`` is over."""
        if self.max_memory is None:
            return top
        per = self.block_bytes(w.role)
        base = self.memory - w.nblocks * per
        if base + top * per <= self.max_memory:
            return top
        if base + nblocks * per <= self.max_memory:
            return nblocks
        raise LimitError(
            f"the pool of worker {w.name!r}, {_amount(nblocks)} blocks for block id {_amount(nblocks - 1)},",
            base + nblocks * per, self.max_memory, "--max-memory (max_memory=)", line=self.line,
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
            heads = self._heads[role]
            w = _Worker(name, role, len(heads), heads)
            size = declared.blocks if declared is not None else 0
            first = max(size, self.min_blocks)
            self._grow(w, self._reserve(w, first, first))
            self._workers[name] = w
            self._pending_events[name] = []
        need = list(need)
        if need:
            top = max(need)
            if top >= w.nblocks:
                self._grow(w, self._reserve(w, top + 1, max(2 * w.nblocks, top + 1)))
        return w

    def _grow(self, w: _Worker, nblocks: int) -> None:
        L = self.layout
        self._main_touch(w.name)
        new = []
        for r in range(w.tp):
            t = torch.full(
                (nblocks, L.layers, 2, len(w.heads[r]), L.block_size, L.head_dim),
                float("nan"),
                dtype=L.torch_dtype,
                device=self.device,
            )
            if w.pools:
                t[: w.nblocks].copy_(w.pools[r])
            new.append(t)
        w.pools = new
        self.memory += (nblocks - w.nblocks) * self.block_bytes(w.role)
        w.nblocks = nblocks

    def _touch(self, w: _Worker, blocks: Iterable[int], line: int) -> None:
        self._clock += 1
        for b in blocks:
            w.stamp[b] = self._clock
            w.last_write[b] = line

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

    # -- values --------------------------------------------------------------

    def _make_q(self) -> torch.Tensor:
        L = self.layout
        nh = L.head_dim - _CODE_DIMS
        dev = self.device
        l = torch.arange(L.layers, device=dev, dtype=torch.int64).view(-1, 1, 1, 1)
        k = torch.arange(2, device=dev, dtype=torch.int64).view(1, 2, 1, 1)
        h = torch.arange(L.kv_heads, device=dev, dtype=torch.int64).view(1, 1, -1, 1)
        d = torch.arange(nh, device=dev, dtype=torch.int64).view(1, 1, 1, -1)
        x = _mix(l * 1_000_003 + k * 7_919 + h * 104_729 + d * 15_485_863 + 12_345)
        x = _mix(x ^ (d * 0x3C6EF372))
        return x % _HASH_MOD  # [L, 2, H, nh]

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

    def _values(self, tag: int, start: int, codes: Sequence[int], heads: Sequence[int]) -> torch.Tensor:
        """KV of positions ``start .. start+len(codes)-1`` (token code per
        position), for global ``heads``: ``[L, 2, len(heads), T, D]``."""
        L = self.layout
        dev = self.device
        T = len(codes)
        nh = L.head_dim - _CODE_DIMS
        pos = torch.arange(start, start + T, device=dev, dtype=torch.int64)
        tok = torch.tensor(list(codes), device=dev, dtype=torch.int64)
        seed = _mix_py(tag, 0x51ED)
        x = _mix((pos * 0x2545F491 + seed) & _M32)
        x = _mix(x ^ ((tok * 0x6F4F2A45) & _M32))
        d = torch.arange(nh, device=dev, dtype=torch.int64)
        c = _mix(x.view(T, 1) ^ ((d * 0x9E3779B1) & _M32).view(1, nh)) % _HASH_MOD  # [T, nh]
        hi = torch.tensor(list(heads), device=dev, dtype=torch.int64)
        q = self._q.index_select(2, hi)  # [L, 2, Hs, nh]
        hashed = (q.unsqueeze(3) + c.view(1, 1, 1, T, nh)) % _HASH_MOD - 125
        out = torch.empty((L.layers, 2, len(heads), T, L.head_dim), dtype=L.torch_dtype, device=dev)
        out[..., _CODE_DIMS:] = (hashed.to(torch.float32) / 64).to(L.torch_dtype)
        out[..., 0] = float(1 + tag % _CODE)
        out[..., 1] = float(1 + (tag // _CODE) % _CODE)
        out[..., 2] = ((pos % _CODE) + 1).to(L.torch_dtype).view(1, 1, 1, T)
        out[..., 3] = ((hi % _CODE) + 1).to(L.torch_dtype).view(1, 1, -1, 1)
        return out

    def _write_positions(self, w: _Worker, table: Sequence[int], tag: int, start: int,
                         codes: Sequence[int], line: int) -> None:
        """Write KV of positions start.. into ``table`` on every rank of ``w``
        (current stream).  Positions past the table are dropped."""
        bs = self.layout.block_size
        end = start + len(codes)
        blocks = []
        spans = []
        p = start
        while p < end:
            bi = p // bs
            if bi >= len(table):
                break
            q = min(end, (bi + 1) * bs)
            blocks.append(table[bi])
            spans.append((table[bi], p, q))
            p = q
        if not spans:
            return
        self._worker(w.name, need=blocks)
        self._before_modify(w, blocks, line)
        chunk = max(bs, (8 << 20) // max(1, self.layout.layers * 2 * self.layout.kv_heads * self.layout.head_dim) // bs * bs)
        for c0 in range(start, spans[-1][2], chunk):
            c1 = min(c0 + chunk, spans[-1][2])
            vals = {}
            for r in range(w.tp):
                vals[r] = self._values(tag, c0, codes[c0 - start: c1 - start], w.heads[r])
            for blk, p0, p1 in spans:
                a, b = max(p0, c0), min(p1, c1)
                if a >= b:
                    continue
                for r in range(w.tp):
                    w.pools[r][blk, :, :, :, a % bs: a % bs + (b - a), :] = vals[r][:, :, :, a - c0: b - c0, :]
        self._touch(w, blocks, line)

    def _poison(self, w: _Worker, blocks: Sequence[int], line: int) -> None:
        blocks = [b for b in blocks if b < w.nblocks]
        if not blocks:
            return
        self._before_modify(w, blocks, line)
        idx = torch.tensor(blocks, device=self.device, dtype=torch.int64)
        for r in range(w.tp):
            w.pools[r].index_fill_(0, idx, float("nan"))
        self._touch(w, blocks, line)

    def _before_modify(self, w: _Worker, blocks: Iterable[int], line: int) -> None:
        """Before the current stream modifies ``blocks`` of ``w``: materialise
        lazy reads of them, and wait for side-stream copies touching ``w``."""
        tids: set[str] = set()
        for b in blocks:
            s = self._lazy.get((w.name, b))
            if s:
                tids |= s
        for tid in sorted(tids):
            self._materialise(self._xfers[tid])
        self._main_touch(w.name)

    # -- transfers -----------------------------------------------------------

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

    def _materialise(self, t: _Xfer) -> None:
        """Copy-on-write: snapshot ``t``'s source into staging now."""
        if t.staged is not None:
            return
        src = self._workers[t.src]
        idx = torch.tensor(t.src_blocks, device=self.device, dtype=torch.int64)

        ids = t.src_blocks
        run = len(ids) > 0 and all(ids[i] == ids[0] + i for i in range(len(ids)))

        def gather() -> list[torch.Tensor]:
            if run:  # one contiguous slice: a plain copy
                return [pool[ids[0]: ids[0] + len(ids)].clone() for pool in src.pools]
            return [pool.index_select(0, idx) for pool in src.pools]

        t.staged = self._side(gather, [t.src])
        self._unregister_lazy(t)

    def _head_segments(self, src: _Worker, dst: _Worker) -> list[list[tuple[int, int, int, int]]]:
        """Per destination rank: (source rank, source local head, dest local head, count)."""
        key = (src.role, dst.role)
        segs = self._segments.get(key)
        if segs is not None:
            return segs
        owner: dict[int, tuple[int, int]] = {}
        for r, hs in enumerate(src.heads):
            for i, h in enumerate(hs):
                owner.setdefault(h, (r, i))
        segs = []
        for hs in dst.heads:
            runs: list[list[int]] = []
            for j, h in enumerate(hs):
                sh = self.head_map[h] if self.head_map is not None else h
                rp, i = owner[sh]
                if runs and runs[-1][0] == rp and runs[-1][1] + runs[-1][3] == i and runs[-1][2] + runs[-1][3] == j:
                    runs[-1][3] += 1
                else:
                    runs.append([rp, i, j, 1])
            segs.append([tuple(r) for r in runs])  # type: ignore[misc]
        self._segments[key] = segs
        return segs

    def _write(self, t: _Xfer, line: int) -> None:
        """The writes of ``t`` land now."""
        src = self._worker(t.src, "prefill", t.src_blocks)
        dst = self._worker(t.dst, "decode", t.dst_blocks)
        t.wrote = True
        self._drop_writer(t)
        n = min(len(t.src_blocks), len(t.dst_blocks))
        if src is None or dst is None or n == 0:
            self._unregister_lazy(t)
            return
        # other lazy reads of the target blocks (and t's own, on overlap) snapshot first
        tids: set[str] = set()
        for b in t.dst_blocks[:n]:
            tids |= self._lazy.get((t.dst, b), set())
        for tid in sorted(tids):
            self._materialise(self._xfers[tid])
        if t.staged is not None:
            sources = t.staged
            src_ids = list(range(n))
        else:
            sources = src.pools
            src_ids = list(t.src_blocks[:n])
        dst_ids = list(t.dst_blocks[:n])
        segs = self._head_segments(src, dst)
        Hs = [len(h) for h in src.heads]
        Hd = [len(h) for h in dst.heads]

        def copy() -> None:
            for rd, runs in enumerate(segs):
                for rp, i, j, cnt in runs:
                    full = cnt == Hd[rd] and cnt == Hs[rp]
                    _copy_blocks(dst.pools[rd], dst_ids, sources[rp], src_ids,
                                 None if full else (j, j + cnt), None if full else (i, i + cnt))

        self._side(copy, [t.src, t.dst])
        self.bytes_copied += n * sum(p[0].numel() * p.element_size() for p in dst.pools)
        self._unregister_lazy(t)
        t.staged = None
        self._clock += 1
        t.write_stamp = self._clock
        for b in dst_ids:
            dst.stamp[b] = self._clock
            dst.last_write[b] = line

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
            t.staged = None
            self._write(t, line)

    def _drop_writer(self, t: _Xfer) -> None:
        for b in set(t.dst_blocks):
            s = self._writers.get((t.dst, b))
            if s is not None:
                s.discard(t.tid)
                if not s:
                    del self._writers[(t.dst, b)]

    # -- verification --------------------------------------------------------

    def _owned(self, key: tuple[str, int], worker: str, blocks: Iterable[int]) -> bool:
        return all(self._owner.get((worker, b)) == key for b in blocks)

    def _expect_codes(self, g: _Gen, upto: int) -> list[int]:
        prompt = g.prompt_len if g.prompt_len is not None else (g.processed_len or 0)
        codes = []
        for p in range(upto):
            if p < prompt:
                codes.append(_PROMPT)
            else:
                tok = g.exp_tok.get(p)
                codes.append(_NO_TOKEN if tok is None else (tok + 1) & _M32)
        return codes

    def _verify(self, g: _Gen, worker: str, table: Sequence[int], upto: int, line: int,
                what: str, witness: Iterable[int | None] = (), transfer: str | None = None,
                ticket: str | None = None) -> bool:
        """Check positions ``0..upto-1`` of ``g`` in ``table`` on ``worker``;
        report the first wrong element.  Returns True when all is right."""
        if upto <= 0:
            return True
        w = self._workers.get(worker)
        bs = self.layout.block_size
        need_blocks = -(-upto // bs)
        if w is None or len(table) < need_blocks:  # before any list of upto codes is made
            have = 0 if w is None else len(table)
            self._report_missing(g, worker, table, have * bs, what, line, witness, transfer, ticket)
            return False
        codes = self._expect_codes(g, upto)
        self._worker(worker, need=table[:need_blocks])
        self._main_touch(worker)
        for bi in range(need_blocks):
            blk = table[bi]
            p0, p1 = bi * bs, min(upto, (bi + 1) * bs)
            seg = codes[p0:p1]
            for r in range(w.tp):
                exp = self._values(g.tag, p0, seg, w.heads[r])  # [L,2,Hl,T,D]
                act = w.pools[r][blk, :, :, :, 0: p1 - p0, :]
                if torch.equal(act, exp):
                    continue
                self._report_wrong(g, w, blk, bi, p0, r, act, exp, what, line, witness, transfer, ticket)
                return False
        return True

    def _emit(self, dedupe: tuple, v: KVCorruption) -> None:
        """Report ``v`` unless the same wrong element was reported already."""
        if dedupe in self._reported:
            return
        self._reported.add(dedupe)
        self._out.append(v)

    def _report_missing(self, g, worker, table, covered, what, line, witness, transfer, ticket) -> None:
        self._emit((g.key, worker, "missing", covered), KVCorruption(
            KV_CORRUPTION, line,
            f"{what} of {_fmt(g.key)} on {worker!r}: the block table {list(table)} covers positions "
            f"[0, {covered}) only, so position {covered} has no KV (block size {self.layout.block_size})",
            _witness(witness, line),
            request=g.key[0], gen=g.key[1], worker=worker, position=covered,
            transfer=transfer, ticket=ticket,
        ))

    def _report_wrong(self, g: _Gen, w: _Worker, blk: int, bi: int, p0: int, r: int,
                      act: torch.Tensor, exp: torch.Tensor, what: str, line: int,
                      witness: Iterable[int | None], transfer: str | None, ticket: str | None) -> None:
        # the first wrong element over all ranks: lowest position, then layer
        best = None
        for rr in range(w.tp):
            if rr == r:
                a, e = act, exp
            else:
                a = w.pools[rr][blk, :, :, :, 0: act.shape[3], :]
                e = self._values(g.tag, p0, self._expect_codes(g, p0 + act.shape[3])[p0:], w.heads[rr])
            bad = ~(a == e)  # NaN counts as wrong
            if not bool(bad.any()):
                continue
            lt = bad.any(dim=4).any(dim=2).any(dim=1)  # [L, T]
            ts = lt.any(dim=0).nonzero()
            t = int(ts[0])
            layer = int(lt[:, t].nonzero()[0])
            kh = bad[layer, :, :, t, :].any(dim=2).nonzero()[0]
            k, h = int(kh[0]), int(kh[1])
            cand = (t, layer, rr, k, h)
            if best is None or cand[:2] < best[0][:2]:
                best = (cand, a[layer, k, h, t, :].float().cpu())
        if best is None:  # pragma: no cover - equal after all
            return
        (t, layer, rr, k, h), row = best
        position = p0 + t
        head = w.heads[rr][h]
        found, found_text = self._decode_row(row)
        if (isinstance(found, dict) and (found.get("request"), found.get("gen")) == g.key
                and found.get("position_mod") == position % _CODE and found.get("head") == head):
            found_text = f"its own KV for position {position}, but written for another input token"
        wrote = w.last_write.get(blk)
        if w.restart_line is not None and (wrote is None or w.restart_line > wrote) and w.restart_stamp >= w.stamp.get(blk, 0):
            wrote = w.restart_line
        expected = "the prompt KV" if position < (g.prompt_len or 0) else (
            f"the KV of input token {g.exp_tok[position]}" if position in g.exp_tok else "no KV ever written")
        msg = (
            f"{what} of {_fmt(g.key)} on {w.name!r}: block {blk} (table index {bi}) at position "
            f"{position}, layer {layer}, {'KV'[k]} head {head} (rank {rr}) should hold {expected} "
            f"of that generation but holds {found_text}"
        )
        if wrote is not None:
            msg += f" (the block was last written at line {wrote})"
        self._emit((g.key, w.name, blk, position), KVCorruption(
            KV_CORRUPTION, line, msg, _witness(list(witness) + [wrote], line),
            request=g.key[0], gen=g.key[1], worker=w.name, block=blk,
            layer=layer, position=position, head=head, rank=rr, found=found,
            transfer=transfer, ticket=ticket,
        ))

    def _decode_row(self, row: torch.Tensor) -> tuple[Any, str]:
        vals = row.tolist()
        if any(v != v for v in vals):
            return "poison", "poison (freed, restarted or never written)"
        c = vals[:_CODE_DIMS]
        if not all(float(x).is_integer() and 1 <= x <= _CODE for x in c):
            return None, "unrecognisable bytes"
        tag = int(c[0] - 1) + _CODE * int(c[1] - 1)
        pos_code, head = int(c[2] - 1), int(c[3] - 1)
        cands = self._tags[tag::_CODE * _CODE]
        if len(cands) != 1:
            return None, f"KV of an unknown generation (position = {pos_code} mod {_CODE}, head {head})"
        key = cands[0]
        if key == _PROBE:
            return {"request": None, "gen": None, "probe": True}, "the probe written at the end of the history"
        found = {"request": key[0], "gen": key[1], "position_mod": pos_code, "head": head}
        return found, f"KV of {_fmt(key)} for position {pos_code} (mod {_CODE}), head {head}"

    def _final_check(self, g: _Gen, line: int) -> None:
        if g.last_decode is None:
            return
        worker, table, pos, dline = g.last_decode
        g.last_decode = None
        for b in table:
            if self._final.get((worker, b)) == g.key:
                del self._final[(worker, b)]
        self._verify(g, worker, table, pos + 1, line,
                     f"final check (after the last decode at line {dline})", [dline, g.prefill_line])

    def _write_probe(self, worker: str, b: int, line: int) -> None:
        w = self._worker(worker, "decode", [b])
        if w is None:
            return
        bs = self.layout.block_size
        self._write_positions(w, [b], self._probe_tag, 0, [_PROMPT] * bs, line)

    def _verify_probe(self, worker: str, b: int, t: _Xfer, line: int) -> None:
        w = self._workers[worker]
        probe = self._gens[_PROBE]
        owner = self._owner.get((worker, b))
        bs = self.layout.block_size
        for r in range(w.tp):
            exp = self._values(probe.tag, 0, [_PROMPT] * bs, w.heads[r])
            self._main_touch(worker)
            if torch.equal(w.pools[r][b], exp):
                continue
            who = "free" if owner is None else f"now owned by {_fmt(owner)}"
            self._emit(("probe", t.tid), KVCorruption(
                KV_CORRUPTION, line,
                f"transfer {t.tid!r} of {_fmt(t.key)} writes into block {b} on {worker!r}, which was "
                f"freed or re-allocated while the write was in flight ({who}): the write, landing at "
                f"the end of the history (the latest it can), overwrote the KV the block held then "
                f"(a probe standing for its next owner's KV)",
                _witness([t.line, w.last_write.get(b)], line),
                request=t.key[0], gen=t.key[1], worker=worker, block=b, rank=r,
                transfer=t.tid, ticket=t.ticket, found={"request": t.key[0], "gen": t.key[1]},
            ))
            return

    def _verify_transfer(self, t: _Xfer, line: int, what: str) -> None:
        """Does ``t``'s target hold its generation's prompt KV where its
        source's prefill put it (as the commit that may follow would read)?"""
        g = self._gens.get(t.key)
        if g is None or g.prefill_line is None or t.lost:
            return
        pre = g.prefill.get(t.src)
        if pre is None or not self._owned(t.key, t.dst, t.dst_blocks):
            return
        prompt = g.prompt_len if g.prompt_len is not None else (g.processed_len or 0)
        bs = self.layout.block_size
        n = min(len(t.src_blocks), len(t.dst_blocks))
        # target table in prompt order, when the transfer covers a prefix
        index = {b: i for i, b in enumerate(pre)}
        table: list[int] = []
        for i in range(n):
            j = index.get(t.src_blocks[i])
            if j != len(table):
                break
            table.append(t.dst_blocks[i])
        upto = min(prompt, len(table) * bs)
        self._verify(g, t.dst, table, upto, line, f"{what} {t.tid!r}", [t.line, g.prefill_line],
                     transfer=t.tid, ticket=t.ticket)

    # -- one handler per event kind -----------------------------------------

    def _on_submit(self, ev: Submit, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        g.prompt_len = ev.prompt_len

    def _allocate(self, key: tuple[str, int], worker: str, blocks: Sequence[int], role: str) -> None:
        self._worker(worker, role, blocks)
        for b in blocks:
            self._owner[(worker, b)] = key

    def _on_reserve(self, ev: Reserve, line: int) -> None:
        key = (ev.request, ev.gen)
        self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "decode")
        self._tickets[ev.ticket] = (key, ev.worker, ev.blocks)

    def _on_prefill_start(self, ev: PrefillStart, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "prefill")
        g.prefill[ev.worker] = ev.blocks

    def _on_prefill_done(self, ev: PrefillDone, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        g.processed_len = ev.processed_len
        g.first_token = ev.first_token
        if g.prompt_len is None:
            g.prompt_len = ev.processed_len
        g.exp_tok[g.prompt_len] = ev.first_token
        g.prefill_line = line
        table = g.prefill.get(ev.worker)
        w = self._worker(ev.worker, "prefill")
        if table is None or w is None:
            return
        # positions past the table are dropped: never make more codes than it holds
        n = min(ev.processed_len, len(table) * self.layout.block_size)
        self._write_positions(w, table, g.tag, 0, [_PROMPT] * n, line)

    def _on_alloc(self, ev: Alloc, line: int) -> None:
        key = (ev.request, ev.gen)
        self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "decode")

    def _on_transfer_start(self, ev: TransferStart, line: int) -> None:
        old = self._xfers.get(ev.transfer)
        if old is not None:  # id reuse: the old one is over
            self._unregister_lazy(old)
            self._drop_writer(old)
        t = _Xfer(ev, line)
        self._xfers[ev.transfer] = t
        self._gen(t.key).transfers.append(ev.transfer)
        self._worker(ev.src, "prefill", ev.src_blocks)
        self._worker(ev.dst, "decode", ev.dst_blocks)
        for b in set(ev.dst_blocks):
            self._writers.setdefault((ev.dst, b), set()).add(ev.transfer)

    def _on_transfer_read_done(self, ev: TransferReadDone, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed or t.read:
            return
        if t.wrote:
            if t.lost:
                return  # the source memory is gone: no read can land any more
            self._late_read(t, line)
        else:
            self._read(t, line)

    def _on_transfer_write_done(self, ev: TransferWriteDone, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed or t.wrote:
            return
        # nothing is written that was not read: without a read_done yet, the
        # source is read now (and again at a later read_done if it changed)
        self._write(t, line)

    def _on_transfer_failed(self, ev: TransferFailed, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed:
            return
        t.failed = True
        self._unregister_lazy(t)
        t.staged = None
        if not t.wrote:
            w = self._workers.get(t.dst)
            if w is not None:
                self._worker(t.dst, need=t.dst_blocks)
                self._poison(w, t.dst_blocks, line)  # a partial write: garbage
        self._drop_writer(t)

    def _on_transfer_abort(self, ev: TransferAbort, line: int) -> None:
        pass  # an abort is a request, not a fence

    def _on_commit(self, ev: Commit, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        table: tuple[int, ...] | None = None
        tline = None
        for tid in reversed(g.transfers):
            t = self._xfers[tid]
            if t.ticket == ev.ticket and t.dst == ev.worker and t.wrote and not t.failed:
                table, tline = t.dst_blocks, t.line
                break
        if table is None:
            info = self._tickets.get(ev.ticket)
            if info is not None and info[1] == ev.worker and info[0] == key:
                table = info[2]
        if table is None:
            return  # nothing to read: the monitor reports the commit itself
        g.committed = (ev.worker, table, line)
        if g.prefill_line is None:
            return
        self._verify(g, ev.worker, table, g.prompt_len or 0, line,
                     "commit (KV made readable for decode)", [tline, g.prefill_line], ticket=ev.ticket)

    def _on_decode(self, ev: Decode, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        if g.last_decode is not None:
            # superseded by this step's check
            worker, table, _pos, _l = g.last_decode
            for b in table:
                if self._final.get((worker, b)) == key:
                    del self._final[(worker, b)]
            g.last_decode = None
        self._verify(g, ev.worker, ev.blocks, ev.position, line,
                     f"decode at position {ev.position}", [g.committed[2] if g.committed else None, g.prefill_line])
        w = self._worker(ev.worker, "decode", ev.blocks)
        if w is None:
            return
        bs = self.layout.block_size
        if ev.position // bs >= len(ev.blocks):
            self._report_missing(g, ev.worker, ev.blocks, len(ev.blocks) * bs,
                                 f"decode at position {ev.position} (its own KV)", line, [], None, None)
        else:
            self._write_positions(w, ev.blocks, g.tag, ev.position, [(ev.input_token + 1) & _M32], line)
        prompt = g.prompt_len if g.prompt_len is not None else (g.processed_len or 0)
        if ev.position + 1 >= prompt:
            g.exp_tok[ev.position + 1] = ev.output_token
        g.last_decode = (ev.worker, ev.blocks, ev.position, line)
        for b in ev.blocks:
            self._final[(ev.worker, b)] = key

    def _on_end(self, ev: Finish | Cancel | Fail, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        self._final_check(g, line)
        g.terminal = True

    def _on_free(self, ev: Free, line: int) -> None:
        w = self._workers.get(ev.worker)
        if w is None:
            return
        keys = {self._final[(ev.worker, b)] for b in ev.blocks if (ev.worker, b) in self._final}
        for key in sorted(keys):
            self._final_check(self._gens[key], line)
        for b in ev.blocks:
            self._owner.pop((ev.worker, b), None)
            for tid in self._writers.get((ev.worker, b), ()):
                self._xfers[tid].early_freed.add(b)
        self._poison(w, ev.blocks, line)

    def _on_restart(self, ev: Restart, line: int) -> None:
        w = self._workers.get(ev.worker)
        for wb in [wb for wb in self._owner if wb[0] == ev.worker]:
            del self._owner[wb]
        for wb in [wb for wb in self._final if wb[0] == ev.worker]:
            key = self._final.pop(wb)
            g = self._gens[key]
            if g.last_decode is not None and g.last_decode[0] == ev.worker:
                g.last_decode = None  # the memory is gone; nothing more to read
        for t in self._xfers.values():
            # a read still to come reads poison; writes still to come land
            # (the monitor quarantines their blocks); either way the data is lost
            if not t.failed and ((t.src == ev.worker and not t.read) or (t.dst == ev.worker and not t.wrote)):
                t.lost = True
        if w is None:
            return
        self._before_modify(w, range(w.nblocks), line)
        for pool in w.pools:
            pool.fill_(float("nan"))
        self._clock += 1
        w.restart_stamp = self._clock
        w.restart_line = line
        w.stamp.clear()
        w.last_write.clear()


def _copy_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
                 dheads: tuple[int, int] | None, sheads: tuple[int, int] | None) -> None:
    """dst[dst_ids[i], :, :, dheads] = src[src_ids[i], :, :, sheads] for each i."""
    runs: list[list[int]] = []
    for d, s in zip(dst_ids, src_ids):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    if len(runs) <= 16 or len(set(dst_ids)) != len(dst_ids):
        for d, s, n in runs:
            if dheads is None:
                dst[d: d + n].copy_(src[s: s + n])
            else:
                dst[d: d + n, :, :, dheads[0]: dheads[1]].copy_(src[s: s + n, :, :, sheads[0]: sheads[1]])
        return
    di = torch.tensor(dst_ids, device=dst.device, dtype=torch.int64)
    si = torch.tensor(src_ids, device=src.device, dtype=torch.int64)
    if dheads is None:
        dst.index_copy_(0, di, src.index_select(0, si))
    else:
        dst[di, :, :, dheads[0]: dheads[1]] = src.index_select(0, si)[:, :, :, sheads[0]: sheads[1]]


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError("device", str(device), "cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device", str(device), "cpu (no CUDA device is available here)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError("device", str(device), "cpu or cuda (cuda:N)")
    return dev


def _amount(n: int) -> str:
    """An integer for a message, huge ones shortened."""
    return f"{n:,}" if n < 10**15 else f"~10**{len(str(n)) - 1}"


def _fmt(key: tuple[str, int]) -> str:
    return f"request {key[0]!r} gen {key[1]}"


def _witness(lines: Iterable[int | None], line: int) -> tuple[int, ...]:
    return tuple(sorted({w for w in lines if w is not None and w != line and w > 0}))


_DISPATCH: dict[type, Callable[[TorchBackend, Any, int], None]] = {
    Submit: TorchBackend._on_submit,
    Reserve: TorchBackend._on_reserve,
    PrefillStart: TorchBackend._on_prefill_start,
    PrefillDone: TorchBackend._on_prefill_done,
    Alloc: TorchBackend._on_alloc,
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
