"""Replay a history on real paged KV buffers with torch (CPU or CUDA).

The only module of pdproto that imports torch (with :mod:`._quant`, which it
loads for fp8).  See docs/replay.md.

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
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np  # noqa: I001 - the torch extra brings it (torch.from_numpy needs it too)
import torch  # first: without the torch extra, the missing module is torch

from .._errors import LimitError, UsageError, parse_int
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
from ._registry import make_transport
from ._transport import RAW, BlockMove, CopyTransport, Transfer, Transport

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
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FP8 = ("float8_e4m3fn", "float8_e5m2")
SCALES = ("per-tensor", "per-block", "per-head")
LAYOUTS = ("mha", "mla")
#: when a transfer's bytes move (TorchBackend(timing=...), pdproto replay --transfer-timing)
TIMINGS = ("adversarial", "eager")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of a 32-bit value stay inside int64
_NO_TOKEN = _M32  # token code of a position no write is expected to have made
_PROMPT = 0  # token code of prompt positions
_CODE_DIMS = 4  # tag lo, tag hi, position, head
_PROBE = ("<probe>", 0)
#: the value encoding of each dtype family: code radix R (codes 1..R in dims
#: 0-3), hashed half-range A and divisor S (hashed dims (k - A) / S, k in
#: 0..2A).  Every value is exact in the dtype (fp8: with a power-of-two scale).
_ENCODING = {"wide": (125, 127, 64), "float8_e4m3fn": (15, 15, 8), "float8_e5m2": (7, 7, 4)}


def _mix_py(*parts: int) -> int:
    x = 0x1234567
    for p in parts:
        x = (x ^ (p & _M32)) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (x >> 16) ^ x
    return x


def _position_hash(tag: int, position: int, code: int) -> int:
    """32 bits of (tag, position, token code): the seed of a row's hashed dims."""
    x = (tag * 0x9E3779B1 + position * 0x85EBCA77 + (code & _M32) * 0xC2B2AE3D + 0x51ED) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def torch_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count to ``threads`` (None: leave it) and
    return the count it had before (to set it back)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return before


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
    if type(tp) is not int or tp < 1:
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
    """The shape of every worker's paged KV pool.  ``layout`` ``"mla"``: one
    latent vector of ``head_dim`` per token and layer (no heads, no separate
    K and V).  ``scale`` (fp8 dtypes only): ``"per-tensor"``, ``"per-block"``
    or ``"per-head"``."""

    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 8
    block_size: int = 4
    dtype: str = "bfloat16"
    layout: str = "mha"
    scale: str | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("layers", "kv_heads", "block_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise UsageError(name, v, "an integer >= 1")
        if type(self.head_dim) is not int or self.head_dim < _CODE_DIMS + 1:
            raise UsageError("head_dim", self.head_dim, f"an integer >= {_CODE_DIMS + 1}")
        if canonical_dtype(self.dtype) != self.dtype:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.layout not in LAYOUTS:
            raise UsageError("layout", self.layout, "one of " + ", ".join(LAYOUTS))
        if self.layout == "mla" and self.kv_heads != 1:
            object.__setattr__(self, "kv_heads", 1)
        radix = self.encoding[0]
        if self.kv_heads > radix:
            raise UsageError("kv_heads", self.kv_heads, f"at most {radix} with {self.dtype}")
        if self.dtype in FP8:
            if self.scale is None:
                object.__setattr__(self, "scale", "per-tensor")
            if self.scale not in SCALES:
                raise UsageError("scale", self.scale, "one of " + ", ".join(SCALES))
        elif self.scale is not None:
            raise UsageError("scale", self.scale, "no scale: only an fp8 dtype has scales")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def kv(self) -> int:
        """K and V (2), or the one latent of MLA (1)."""
        return 1 if self.layout == "mla" else 2

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8

    @property
    def encoding(self) -> tuple[int, int, int]:
        return _ENCODING.get(self.dtype, _ENCODING["wide"])

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all heads (all ranks of a tp=1 worker)."""
        return self.layers * self.kv * self.kv_heads * self.block_size * self.head_dim * self.elem_bytes


def canonical_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in TORCH_DTYPES:
        raise UsageError("dtype", name, "one of " + ", ".join(TORCH_DTYPES) + " (or bf16, fp16, fp32, fp8)")
    return name


def _heads_per_rank(tp: int, kv_heads: int) -> int:
    """KV heads each rank of a ``tp``-sized worker holds (see :func:`rank_heads`)."""
    return kv_heads // tp if tp <= kv_heads else 1


@attrs.frozen
class KVCorruption(Violation):
    """A data-level violation: the bytes a decode (or commit) reads are wrong.

    Besides the fields of :class:`~pdproto.Violation`: ``layer``,
    ``position``, ``head`` (global KV head) and ``rank`` (the part: stage *
    tp + tensor-parallel rank) of the first wrong element, and ``found``:
    what is there instead (``"poison"``, ``{"request", "gen", "position_mod",
    "head"}`` decoded from the element, or None when it cannot tell).
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
        for name in (
            "request",
            "gen",
            "worker",
            "block",
            "layer",
            "position",
            "head",
            "rank",
            "transfer",
            "ticket",
            "found",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@attrs.frozen
class BackendStatistics:
    """What a :class:`TorchBackend`'s data work has cost so far
    (:meth:`TorchBackend.statistics`, a snapshot).

    Seconds are measured with the backend's ``clock`` (named by ``clock``;
    default ``time.perf_counter``) around the tensor work only, not the
    bookkeeping: ``write`` the KV that prefill, decode and probes write
    (building the values and storing them), ``copy`` the transfers' copies
    (and copy-on-write staging), ``verify`` commit, decode, final and
    end-of-history checks (building the expected values, gathering and
    comparing), ``poison`` frees, failed transfers and restarts.  Bytes are
    the KV bytes each moved (``verify_bytes`` is ``bytes_verified``).  On
    CUDA the seconds are host time (launching the work), not device time.
    """

    clock: str
    write_seconds: float
    write_bytes: int
    copy_seconds: float
    copy_bytes: int
    verify_seconds: float
    verify_bytes: int
    poison_seconds: float
    poison_bytes: int

    @property
    def verify_bytes_per_s(self) -> float:
        """Verification throughput: verified KV bytes per second of verification."""
        return self.verify_bytes / self.verify_seconds if self.verify_seconds > 0 else 0.0


_WRITE, _COPY, _VERIFY, _POISON = range(4)
#: the blocks a free stashes are gathered at once when they take at most this
#: many bytes (an entry's views keep the whole gather alive)
_STASH_BATCH = 64 << 10
#: a worker's modification log restarts past this many entries
_LOG_MAX = 1 << 20
#: expected values are built and compared this many bytes at a time
_CHUNK_BYTES = 2 << 20


class _Worker:
    """One worker's pools: ``parts[i] = (first layer, end layer, global heads)``
    and ``pools[i]`` its tensor (``scales[i]`` its fp8 scales)."""

    __slots__ = (
        "name",
        "role",
        "tp",
        "pp",
        "heads",
        "parts",
        "pools",
        "scales",
        "nblocks",
        "cap",
        "stamp",
        "mod",
        "restart_stamp",
        "restart_line",
        "last_write",
        "origin",
        "stash",
        "static_scale",
        "lastw",
        "pos_bytes",
        "log",
        "epoch",
        "flats",
    )

    def __init__(
        self,
        name: str,
        role: str,
        tp: int,
        pp: int,
        parts: list[tuple[int, int, tuple[int, ...]]],
        heads: list[list[int]],
        cap: int | None,
    ) -> None:
        self.name = name
        self.role = role
        self.tp = tp
        self.pp = pp
        self.heads = heads  # per tensor-parallel rank
        self.parts = parts
        self.pools: list[torch.Tensor] = []
        self.flats: list[
            torch.Tensor
        ] = []  # each pool viewed as [blocks * block_size, layers, K/V, heads, D]
        self.scales: list[torch.Tensor] = []
        self.nblocks = 0
        self.cap = cap  # the declared pool size (caps the doubling), or None
        self.stamp: dict[int, int] = {}  # block -> clock of its last modification
        self.mod: dict[int, tuple[int, int, int]] = {}  # block -> (previous stamp, first slot, end slot)
        self.restart_stamp = 0
        self.restart_line: int | None = None
        self.last_write: dict[int, int] = {}  # block -> line of its last write or poison
        self.origin: dict[int, list[int | None]] = {}  # block -> origin tag of each slot's prompt KV
        self.stash: dict[int, tuple] = {}  # freed block -> (stamp, rows, scale rows, origin)
        self.static_scale = 1.0
        self.lastw: dict[
            int, tuple
        ] = {}  # block -> (slot, (tag, position, code), values per part) of a 1-slot write
        self.pos_bytes = 0  # bytes of one position over every part
        self.log: list[int] = []  # every block modified, in order (see TorchBackend._verify)
        self.epoch = 0  # bumped when the log restarts (a restart, or a long log)

    def copy(self) -> _Worker:
        n = object.__new__(_Worker)
        for name in _Worker.__slots__:
            setattr(n, name, getattr(self, name))
        n.pools = [p.clone() for p in self.pools]
        n.flats = [_slots(p) for p in n.pools]
        n.scales = [s.clone() for s in self.scales]
        n.stamp = dict(self.stamp)
        n.mod = dict(self.mod)
        n.last_write = dict(self.last_write)
        n.origin = {b: list(o) for b, o in self.origin.items()}
        n.stash = dict(self.stash)
        n.lastw = dict(self.lastw)
        n.log = list(self.log)
        return n


class _Gen:
    __slots__ = (
        "key",
        "tag",
        "prompt_len",
        "processed_len",
        "first_token",
        "prefill",
        "prefill_line",
        "exp_tok",
        "terminal",
        "committed",
        "last_decode",
        "transfers",
        "shared",
        "orig",
        "checked",
        "fast",
    )

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
        self.shared: dict[str, tuple[tuple[int, ...], int]] = {}  # worker -> (shared blocks, tokens)
        self.orig: dict[str, dict[int, int]] = {}  # worker -> position -> origin tag (if not own)
        self.checked: dict[
            tuple[str, int], tuple[int, int, int]
        ] = {}  # (worker, index) -> (block, stamp, slots)
        # worker -> (table, positions, log length, epoch, block -> table indices) of the last verify
        self.fast: dict[str, tuple] = {}

    def copy(self) -> _Gen:
        n = object.__new__(_Gen)
        for name in _Gen.__slots__:
            setattr(n, name, getattr(self, name))
        n.prefill = dict(self.prefill)
        n.exp_tok = dict(self.exp_tok)
        n.transfers = list(self.transfers)
        n.shared = dict(self.shared)
        n.orig = {w: dict(o) for w, o in self.orig.items()}
        n.checked = dict(self.checked)
        n.fast = dict(self.fast)
        return n

    def invalidate(self, worker: str | None, index: int) -> None:
        """Expectations at table ``index`` changed: forget what was verified there."""
        for k in [k for k in self.checked if k[1] == index and (worker is None or k[0] == worker)]:
            del self.checked[k]
        if worker is None:
            self.fast.clear()
        else:
            self.fast.pop(worker, None)


class _Xfer:
    __slots__ = (
        "tid",
        "key",
        "ticket",
        "src",
        "src_blocks",
        "dst",
        "dst_blocks",
        "line",
        "read",
        "read_line",
        "staged",
        "wrote",
        "write_stamp",
        "failed",
        "lost",
        "early_freed",
        "drained",
        "layers",
        "tokens",
        "moves",
        "aborted",
        "cancelled",
    )

    def __init__(self, ev: TransferStart, line: int) -> None:
        self.tid = ev.transfer
        self.key = (ev.request, ev.gen)
        self.ticket = ev.ticket
        self.src = ev.src
        self.src_blocks = ev.src_blocks
        self.dst = ev.dst
        self.dst_blocks = ev.dst_blocks
        self.layers: tuple[int, int] | None = getattr(ev, "layers", None)
        self.tokens: tuple[int, int] | None = getattr(ev, "tokens", None)
        # per moved block: (i, src block, dst block, first position, first slot, end slot)
        self.moves: list[tuple[int, int, int, int, int, int]] = []
        self.line = line
        self.read = False  # the read happened (lazily: see staged)
        self.read_line: int | None = None
        self.staged: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # rows, scale rows
        self.wrote = False
        self.write_stamp = 0  # clock when the writes landed (to spot later source changes)
        self.failed = False
        self.lost = False  # its source or target worker restarted while in flight
        self.early_freed: set[int] = set()  # target blocks freed while the writes were in flight
        self.drained = False
        self.aborted = False  # a transfer_abort came before its writes landed
        self.cancelled = False  # aborted, and the transport's library did not land its bytes

    def copy(self) -> _Xfer:
        n = object.__new__(_Xfer)
        for name in _Xfer.__slots__:
            setattr(n, name, getattr(self, name))
        if self.staged is not None:  # staging buffers are reused: the twin gets its own
            n.staged = ([t.clone() for t in self.staged[0]], [t.clone() for t in self.staged[1]])
        n.early_freed = set(self.early_freed)
        return n


def _opt(value: Any, name: str, low: int = 1) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < low:
        raise UsageError(name, value, f"an integer >= {low}")
    return value


class TorchBackend:
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

    # -- verification --------------------------------------------------------

    def _owned(self, key: tuple[str, int], worker: str, blocks: Iterable[int]) -> bool:
        owner = self._owner
        for b in blocks:
            o = owner.get((worker, b))
            if not o or key not in o:
                return False
        return True

    @staticmethod
    def _prompt(g: _Gen) -> int:
        return g.prompt_len if g.prompt_len is not None else (g.processed_len or 0)

    def _expect(self, g: _Gen, worker: str, p0: int, p1: int) -> tuple[list[int], list[int]]:
        """Origin tag and token code expected at positions ``p0 .. p1-1`` of ``g`` on ``worker``."""
        prompt = self._prompt(g)
        orig = g.orig.get(worker)
        tag = g.tag
        if p1 <= prompt and not orig:
            return [tag], [_PROMPT] * (p1 - p0)
        tags, codes = [], []
        for p in range(p0, p1):
            if p < prompt:
                codes.append(_PROMPT)
                tags.append(orig.get(p, tag) if orig else tag)
            else:
                tok = g.exp_tok.get(p)
                codes.append(_NO_TOKEN if tok is None else (tok + 1) & _M32)
                tags.append(tag)
        if len(set(tags)) == 1:
            tags = tags[:1]
        return tags, codes

    def _check(
        self,
        w: _Worker,
        i: int,
        blk: int,
        s0: int,
        s1: int,
        exp: torch.Tensor,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        """Does part ``i`` of block ``blk``, slots ``s0..s1``, hold ``exp`` (float32)?"""
        L = self.layout
        if layers is None and not L.fp8:
            f = blk * L.block_size
            act = w.flats[i][f + s0 : f + s1]
            self.bytes_verified += act.numel() * act.element_size()
            return _same(act, exp)
        pool = w.pools[i]
        act = pool[blk][s0:s1] if layers is None else pool[blk, s0:s1, layers[0] : layers[1]]
        self.bytes_verified += act.numel() * act.element_size()
        if not L.fp8:
            return _same(act, exp)
        s = w.scales[i][blk] if L.scale == "per-block" else w.scales[i][0]
        if layers is not None:
            s = s[:, layers[0] : layers[1]]
        return bool(self._quant.close(self._quant.dequantize(act, s), exp, L.dtype, s).all())

    def _verify(
        self,
        g: _Gen,
        worker: str,
        table: Sequence[int],
        upto: int,
        line: int,
        what: str,
        witness: Iterable[int | None] = (),
        transfer: str | None = None,
        ticket: str | None = None,
    ) -> bool:
        """Check positions ``0..upto-1`` of ``g`` in ``table`` on ``worker``;
        report the first wrong element.  Only slots modified since ``g`` last
        verified them are checked again.  Returns True when all is right."""
        if upto <= 0:
            return True
        w = self._workers.get(worker)
        bs = self.layout.block_size
        need_blocks = -(-upto // bs)
        if w is None or len(table) < need_blocks:  # before any list of upto codes is made
            have = 0 if w is None else len(table)
            self._report_missing(g, worker, table, have * bs, what, line, witness, transfer, ticket)
            return False
        table = tuple(table)
        checked_get = g.checked.get
        stamp_get, mod_get, rs = w.stamp.get, w.mod.get, w.restart_stamp
        todo = []  # (table index, block, first slot, end slot, version)
        last = need_blocks - 1
        indices, imap = self._to_scan(g, w, table, need_blocks)
        for bi in indices:
            blk = table[bi]
            n = bs if bi < last else upto - bi * bs
            stamp = stamp_get(blk, 0)
            st = stamp if stamp >= rs else rs  # the block's version (see _version)
            rec = checked_get((worker, bi))
            lo = 0
            if rec is not None and rec[0] == blk:
                if rec[1] == st:
                    lo = rec[2]
                else:
                    m = mod_get(blk)
                    if m is not None and m[0] == rec[1] and stamp == st:
                        lo = min(rec[2], m[1])
            if lo < n:
                todo.append((bi, blk, lo, n, st))
        if not todo:
            g.fast[worker] = (table, upto, len(w.log), w.epoch, imap)
            return True
        self._worker(worker, need=[t[1] for t in todo])  # the pool covers what is read
        self._main_touch(worker)
        t_start = self._timer()
        ok = self._check_many(g, w, todo)
        self._sec[_VERIFY] += self._timer() - t_start
        if ok is not None:
            bi, blk, lo, n, _st = todo[ok]
            self._report_wrong(g, w, blk, bi, bi * bs + lo, n - lo, what, line, witness, transfer, ticket)
            return False
        checked = g.checked
        for bi, blk, _lo, n, st in todo:
            checked[(worker, bi)] = (blk, st, n)
        g.fast[worker] = (table, upto, len(w.log), w.epoch, imap)
        return True

    def _to_scan(self, g: _Gen, w: _Worker, table: tuple[int, ...], need: int) -> tuple[Iterable[int], dict]:
        """The table indices below ``need`` whose verified state may be stale,
        and the table's block -> indices map.  Since ``g``'s last verification
        on ``w`` through the same table (or a table it extends), only the
        indices of blocks modified since (``w.log``) and those at or past the
        last block it verified can be: the others hold the version ``g``
        verified.  Otherwise every index."""
        fs = g.fast.get(w.name)
        if fs is not None and fs[3] == w.epoch:
            old, upto, pos, _epoch, imap = fs
            same = table == old
            if same or (len(table) > len(old) and table[: len(old)] == old):
                if not same:
                    imap = {b: list(ix) for b, ix in imap.items()}
                    for i in range(len(old), len(table)):
                        imap.setdefault(table[i], []).append(i)
                log = w.log
                first = max(0, -(-upto // self.layout.block_size) - 1)
                if len(log) - pos < need:
                    idx = {i for b in set(log[pos:]) for i in imap.get(b, ()) if i < first}
                    return sorted(idx) + list(range(first, need)), imap
                return range(need), imap
        imap = {}
        for i, b in enumerate(table):
            imap.setdefault(b, []).append(i)
        return range(need), imap

    def _check_many(self, g: _Gen, w: _Worker, todo: list[tuple[int, int, int, int, int]]) -> int | None:
        """Check the slots of ``todo`` (see :meth:`_verify`); the index in
        ``todo`` of the first wrong one, or None."""
        bs = self.layout.block_size
        first, last = todo[0], todo[-1]
        if len(todo) == 1 and first[3] - first[2] == 1:
            bi, blk, lo, n, _st = first
            hit = w.lastw.pop(blk, None)
            if hit is not None:
                tags, codes = self._expect(g, w.name, bi * bs + lo, bi * bs + n)
                if hit[0] == lo and hit[1] == (tags[0], bi * bs + lo, codes[0]):
                    for i in range(len(w.parts)):
                        if not self._check(w, i, blk, lo, n, hit[2][i]):
                            return 0
                    return None
        p0, p1 = first[0] * bs + first[2], last[0] * bs + last[3]
        tags, codes = self._expect(g, w.name, p0, p1)
        rows = self._rows(tags, p0, codes)
        if self.layout.fp8:
            return self._check_each(w, todo, rows, p0)
        # runs of entries whose slots follow each other both in the pool and
        # in positions: [first entry, end entry, first pool slot, first position, slots]
        groups: list[list[int]] = []
        for k, (bi, blk, lo, n, _st) in enumerate(todo):
            f, p = blk * bs + lo, bi * bs + lo
            if groups:
                gr = groups[-1]
                if gr[2] + gr[4] == f and gr[3] + gr[4] == p:
                    gr[1] = k + 1
                    gr[4] += n - lo
                    continue
            groups.append([k, k + 1, f, p, n - lo])
        for i, (l0, l1, hs) in enumerate(w.parts):
            q = self._qpart(l0, l1, hs)
            flat = w.flats[i]  # [slots, layers, K/V, heads, D]
            chunk, scratch = self._scratch_for(flat)
            per = flat[0].numel() * flat.element_size()
            for k0, k1, f, p, n in groups:
                # expected values built in a reused buffer, compared with the pool's slots in place
                for c0 in range(0, n, chunk):
                    c = min(chunk, n - c0)
                    e = p + c0 - p0
                    exp = torch.add(q, rows[e : e + c], out=scratch[:c])
                    self.bytes_verified += c * per
                    if not _same(flat[f + c0 : f + c0 + c], exp):
                        bad = self._check_each(w, todo[k0:k1], rows, p0, only=i)
                        return k0 + (bad or 0)
        return None

    def _check_each(
        self,
        w: _Worker,
        todo: list[tuple[int, int, int, int, int]],
        rows: torch.Tensor,
        p0: int,
        only: int | None = None,
    ) -> int | None:
        """Check the entries of ``todo`` one by one (``rows``: the
        position-dependent values from position ``p0``), on every part or
        part ``only``: the index of the first wrong one (None if all hold)."""
        bs = self.layout.block_size
        for i, (l0, l1, hs) in enumerate(w.parts):
            if only is not None and i != only:
                continue
            q = self._qpart(l0, l1, hs)
            for k, (bi, blk, lo, n, _st) in enumerate(todo):
                e0 = bi * bs + lo - p0
                if not self._check(w, i, blk, lo, n, q + rows[e0 : e0 + n - lo]):
                    return k
        return None

    def _scratch_for(self, flat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(slots per chunk, a reused buffer of that many slots shaped like
        ``flat``'s): expected values are built a chunk at a time (a few MiB,
        so they are compared while still in cache, and never faulted in anew)."""
        key = (tuple(flat.shape[1:]), flat.dtype)
        buf = self._scratch.get(key)
        if buf is None:
            per = flat[0].numel() * flat.element_size()
            rows = max(1, _CHUNK_BYTES // per)
            buf = self._scratch[key] = torch.empty((rows,) + key[0], dtype=flat.dtype, device=flat.device)
            self.memory += rows * per
        return buf.shape[0], buf

    def _verify_items(
        self,
        g: _Gen,
        worker: str,
        items: list[tuple[int, int, int, int]],
        layers: tuple[int, int] | None,
        line: int,
        what: str,
        witness: Iterable[int | None],
        transfer: str | None,
        ticket: str | None,
    ) -> bool:
        """:meth:`_verify_slots` of each item (block, first position, slots,
        first slot), in order, batched: the positions of consecutive items
        follow each other, so one row build serves them all, and items whose
        slots also follow each other in the pool are compared in one go."""
        w = self._workers.get(worker)
        if w is None or not items:
            return True
        contiguous = all(items[k][1] == items[k - 1][1] + items[k - 1][2] for k in range(1, len(items)))
        if contiguous and not self.layout.fp8:
            self._worker(worker, need=[it[0] for it in items])
            self._main_touch(worker)
            t_start = self._timer()
            ok = self._same_items(g, w, items, layers)
            self._sec[_VERIFY] += self._timer() - t_start
            if ok:
                return True
        for blk, p, n, s0 in items:  # one by one: the first wrong item is reported
            if not self._verify_slots(
                g, worker, blk, p - s0, s0, s0 + n, layers, line, what, witness, transfer, ticket
            ):
                return False
        return True

    def _same_items(
        self, g: _Gen, w: _Worker, items: list[tuple[int, int, int, int]], layers: tuple[int, int] | None
    ) -> bool:
        """Do the items (see :meth:`_verify_items`) hold what ``g`` expects in ``layers``?"""
        bs = self.layout.block_size
        P0 = items[0][1]
        tags, codes = self._expect(g, w.name, P0, items[-1][1] + items[-1][2])
        rows = self._rows(tags, P0, codes)
        runs: list[list[int]] = []  # [first pool slot, first position, slots]
        for blk, p, n, s0 in items:
            f = blk * bs + s0
            if runs and runs[-1][0] + runs[-1][2] == f:
                runs[-1][2] += n
            else:
                runs.append([f, p, n])
        for i, (l0, l1, hs) in enumerate(w.parts):
            a, b = (l0, l1) if layers is None else (max(l0, layers[0]), min(l1, layers[1]))
            if a >= b:
                continue
            q = self._qpart(a, b, hs)
            flat = w.flats[i] if (a, b) == (l0, l1) else w.flats[i][:, a - l0 : b - l0]
            chunk, scratch = self._scratch_for(flat)
            per = flat[0].numel() * flat.element_size()
            for f, p, n in runs:
                for c0 in range(0, n, chunk):
                    c = min(chunk, n - c0)
                    exp = torch.add(q, rows[p - P0 + c0 : p - P0 + c0 + c], out=scratch[:c])
                    self.bytes_verified += c * per
                    if not _same(flat[f + c0 : f + c0 + c], exp):
                        return False
        return True

    def _verify_slots(
        self,
        g: _Gen,
        worker: str,
        blk: int,
        p0: int,
        s0: int,
        s1: int,
        layers: tuple[int, int] | None,
        line: int,
        what: str,
        witness: Iterable[int | None],
        transfer: str | None,
        ticket: str | None,
    ) -> bool:
        """Check slots ``s0..s1`` of ``blk`` (positions ``p0+s0 ..``), ``layers`` only."""
        w = self._workers.get(worker)
        if w is None or s0 >= s1:
            return True
        self._worker(worker, need=[blk])
        self._main_touch(worker)
        t_start = self._timer()
        tags, codes = self._expect(g, worker, p0 + s0, p0 + s1)
        rows = self._rows(tags, p0 + s0, codes)
        for i, (l0, l1, hs) in enumerate(w.parts):
            a, b = (l0, l1) if layers is None else (max(l0, layers[0]), min(l1, layers[1]))
            if a >= b:
                continue
            exp = self._qpart(a, b, hs) + rows
            ok = self._check(w, i, blk, s0, s1, exp, (a - l0, b - l0))
            self._sec[_VERIFY] += self._timer() - t_start
            t_start = self._timer()
            if not ok:
                self._report_wrong(
                    g,
                    w,
                    blk,
                    (p0 + s0) // self.layout.block_size,
                    p0 + s0,
                    s1 - s0,
                    what,
                    line,
                    witness,
                    transfer,
                    ticket,
                )
                return False
        return True

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

    def _final_check(self, g: _Gen, line: int) -> None:
        if g.last_decode is None:
            return
        worker, table, pos, dline = g.last_decode
        g.last_decode = None
        for b in table:
            if self._final.get((worker, b)) == g.key:
                del self._final[(worker, b)]
        self._verify(
            g,
            worker,
            table,
            pos + 1,
            line,
            f"final check (after the last decode at line {dline})",
            [dline, g.prefill_line],
        )

    def _write_probe(self, worker: str, b: int, line: int) -> None:
        w = self._worker(worker, "decode", [b])
        if w is None:
            return
        bs = self.layout.block_size
        self._write_positions(w, [b], [self._probe_tag], 0, [_PROMPT] * bs, line)

    def _verify_probe(self, worker: str, b: int, t: _Xfer, line: int) -> None:
        w = self._workers[worker]
        owners = self._owner.get((worker, b))
        bs = self.layout.block_size
        rows = self._rows([self._probe_tag], 0, [_PROMPT] * bs)
        self._main_touch(worker)
        for i, (l0, l1, hs) in enumerate(w.parts):
            if self._check(w, i, b, 0, bs, self._qpart(l0, l1, hs) + rows):
                continue
            who = "free" if not owners else f"now owned by {_fmt(owners[0])}"
            self._emit(
                ("probe", t.tid),
                KVCorruption(
                    KV_CORRUPTION,
                    line,
                    f"transfer {t.tid!r} of {_fmt(t.key)} writes into block {b} on {worker!r}, which was "
                    f"freed or re-allocated while the write was in flight ({who}): the write, landing at "
                    f"the end of the history (the latest it can), overwrote the KV the block held then "
                    f"(a probe standing for its next owner's KV)",
                    _witness([t.line, w.last_write.get(b)], line),
                    request=t.key[0],
                    gen=t.key[1],
                    worker=worker,
                    block=b,
                    rank=i,
                    transfer=t.tid,
                    ticket=t.ticket,
                    found={"request": t.key[0], "gen": t.key[1]},
                ),
            )
            return

    def _verify_transfer(self, t: _Xfer, line: int, what: str) -> None:
        """Does ``t``'s target hold its generation's prompt KV in the layers and
        slots it moved (as the commit that may follow would read)?"""
        g = self._gens.get(t.key)
        if g is None or g.prefill_line is None or t.lost:
            return
        if t.src not in g.prefill or not self._owned(t.key, t.dst, t.dst_blocks):
            return
        if not t.moves:
            self._plan(t)
        prompt = self._prompt(g)
        for _i, _sb, db, p0, s0, s1 in t.moves:
            s1 = min(s1, prompt - p0)
            if s0 >= s1:
                continue
            if not self._verify_slots(
                g,
                t.dst,
                db,
                p0,
                s0,
                s1,
                t.layers,
                line,
                f"{what} {t.tid!r}",
                [t.line, g.prefill_line],
                t.tid,
                t.ticket,
            ):
                return

    # -- one handler per event kind -----------------------------------------

    def _on_submit(self, ev: Submit, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        g.prompt_len = ev.prompt_len

    def _allocate(self, key: tuple[str, int], worker: str, blocks: Sequence[int], role: str) -> None:
        self._worker(worker, role, blocks)
        for b in blocks:
            self._owner[(worker, b)] = [key]
        self._alloc.setdefault(key, {}).setdefault(worker, []).extend(blocks)

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
        if not self._recompute:  # recompute (vLLM's convention): P's sampled token is discarded
            self._expect_token(g, g.prompt_len, ev.first_token)
        g.prefill_line = line
        shared = g.shared.get(ev.worker)
        table = self._table(g, ev.worker, g.prefill.get(ev.worker, ()))
        w = self._worker(ev.worker, "prefill")
        if not table or w is None or (ev.worker not in g.prefill and not shared):
            return
        # a prefix-cache hit computes the positions past its shared prefix only
        start = shared[1] if shared else 0
        # positions past the table are dropped: never make more codes than it holds
        n = max(0, min(ev.processed_len, len(table) * self.layout.block_size - start))
        if n:
            self._write_positions(w, table, [g.tag], start, [_PROMPT] * n, line)
            o = g.orig.get(ev.worker)
            if o:
                for p in range(start, start + n):
                    if o.pop(p, None) is not None:
                        g.invalidate(ev.worker, p // self.layout.block_size)

    def _expect_token(self, g: _Gen, position: int, token: int) -> None:
        old = g.exp_tok.get(position)
        g.exp_tok[position] = token
        if old is not None and old != token:
            g.invalidate(None, position // self.layout.block_size)

    def _on_alloc(self, ev: Alloc, line: int) -> None:
        key = (ev.request, ev.gen)
        self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "decode")

    def _on_share(self, ev: Any, line: int) -> None:
        """A prefix-cache hit: take a reference on the blocks; the origins of
        the KV they hold for positions [old tokens, tokens) become expected."""
        key = (ev.request, ev.gen)
        g = self._gen(key)
        w = self._worker(ev.worker, "prefill", ev.blocks)
        old_blocks, old_tokens = g.shared.get(ev.worker, ((), 0))
        blocks = tuple(old_blocks) + tuple(ev.blocks)
        g.shared[ev.worker] = (blocks, ev.tokens)
        for b in ev.blocks:
            owners = self._owner.setdefault((ev.worker, b), [])
            if not owners and w is not None:
                self._revive(w, b)
            if key not in owners:
                owners.append(key)
        if w is None:
            return
        bs = self.layout.block_size
        o = g.orig.setdefault(ev.worker, {})
        for p in range(old_tokens, min(ev.tokens, len(blocks) * bs)):
            blk = blocks[p // bs]
            slots = w.origin.get(blk)
            tag = slots[p % bs] if slots is not None else None
            tag = g.tag if tag is None else tag
            if o.get(p, g.tag) != tag:
                g.invalidate(ev.worker, p // bs)
            if tag == g.tag:
                o.pop(p, None)
            else:
                o[p] = tag

    def _revive(self, w: _Worker, b: int) -> None:
        """A free-but-cached block shared again: unless something modified it
        since its last owner freed it, it holds the KV it held then."""
        entry = w.stash.pop(b, None)
        if entry is None or b >= w.nblocks:
            return
        stamp, rows, scales, origin = entry
        if self._version(w, b) != stamp:
            return
        self._main_touch(w.name)
        for i, r in enumerate(rows):
            _bytes(w.pools[i])[b].copy_(_bytes(r))
        for i, s in enumerate(scales):
            w.scales[i][b].copy_(s)
        if origin is not None:
            w.origin[b] = list(origin)
        self._touch(w, [b], self.line)

    def _on_transfer_start(self, ev: TransferStart, line: int) -> None:
        old = self._xfers.get(ev.transfer)
        if old is not None:  # id reuse: the old one is over
            self._unregister_lazy(old)
            self._drop_writer(old)
            self._release(old)
        t = _Xfer(ev, line)
        self._xfers[ev.transfer] = t
        self._gen(t.key).transfers.append(ev.transfer)
        self._worker(ev.src, "prefill", ev.src_blocks)
        self._worker(ev.dst, "decode", ev.dst_blocks)
        for b in set(ev.dst_blocks):
            self._writers.setdefault((ev.dst, b), set()).add(ev.transfer)
        if self.timing == "eager":  # posted now, done before the next event
            self._read(t, line)
            self._write(t, line)

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
        if not t.wrote and not isinstance(self.transport, CopyTransport):
            self._fail_through_transport(t)
        self._unregister_lazy(t)
        self._release(t)
        if not t.wrote:
            w = self._workers.get(t.dst)
            if w is not None:
                self._worker(t.dst, need=t.dst_blocks)
                if not t.moves:
                    self._plan(t)
                if t.tokens is None:
                    self._poison(w, t.dst_blocks, line)  # a partial write: garbage
                else:
                    for _i, _sb, db, _p0, s0, s1 in t.moves:
                        self._poison(w, [db], line, s0, s1)
        self._drop_writer(t)

    def _fail_through_transport(self, t: _Xfer) -> None:
        """The transport's library reports ``t`` as failed (its first block),
        into a scratch block of the target worker: bytes a library moves all
        the same never reach the target's pool."""
        src = self._worker(t.src, "prefill", t.src_blocks)
        dst = self._worker(t.dst, "decode", t.dst_blocks)
        if src is None or dst is None or not t.src_blocks or not t.dst_blocks:
            return
        pairs = [
            (self._fail_target(t.dst, dst.pools[i][0]), src.pools[i][t.src_blocks[0]])
            for i in range(min(len(dst.pools), len(src.pools)))
            if dst.pools[i][0].shape == src.pools[i][0].shape
        ]
        if pairs:
            self.transport.fail(Transfer(t.tid, t.src, t.dst, self._pull, pairs=pairs))

    def _fail_target(self, worker: str, like: torch.Tensor) -> torch.Tensor:
        """A block of ``worker``'s, outside its pool, shaped as ``like`` (made once)."""
        key = (worker, tuple(like.shape), like.dtype)
        out = self._fail_targets.get(key)
        if out is None:
            out = self._fail_targets[key] = torch.zeros_like(like)
        return out

    def _on_transfer_abort(self, ev: TransferAbort, line: int) -> None:
        # an abort is a request, not a fence: the writes may still land (the
        # transport releases the transfer's handle while active when they do)
        t = self._xfers.get(ev.transfer)
        if t is not None and not t.wrote and not t.failed:
            t.aborted = True

    def _landed_for(self, g: _Gen, ticket: str, worker: str) -> list[_Xfer]:
        """The transfers of ``ticket`` into ``worker`` whose writes landed."""
        out = []
        for tid in g.transfers:
            t = self._xfers[tid]
            if t.ticket == ticket and t.dst == worker and t.wrote and not t.failed and not t.cancelled:
                out.append(t)
        return out

    def _commit_table(self, g: _Gen, ev: Commit) -> tuple[list[int] | None, int | None]:
        """The block table a commit makes readable: the generation's shared
        blocks on the worker, then the blocks the ticket reserved there; without
        a reservation, the blocks the ticket's landed transfers wrote, by the
        table index of the positions they moved."""
        bs = self.layout.block_size
        tline = None
        by_index: dict[int, int] = {}
        for tid in g.transfers:
            t = self._xfers[tid]
            if t.ticket == ev.ticket and t.dst == ev.worker and t.wrote and not t.failed and not t.cancelled:
                tline = t.line
                if not t.moves:
                    self._plan(t)
                for _i, _sb, db, p0, _s0, _s1 in t.moves:
                    by_index[p0 // bs] = db
        info = self._tickets.get(ev.ticket)
        if info is not None and info[1] == ev.worker and info[0] == g.key:
            return self._table(g, ev.worker, info[2]), tline
        if not by_index:
            return None, tline
        table = self._table(g, ev.worker, ())
        shared = len(table)
        for j in range(shared, max(by_index) + 1):
            if j not in by_index:
                break
            table.append(by_index[j])
        return table, tline

    def _on_commit(self, ev: Commit, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        table, tline = self._commit_table(g, ev)
        if table is None:
            return  # nothing to read: the monitor reports the commit itself
        table = tuple(table)
        g.committed = (ev.worker, table, line)
        if g.prefill_line is None:
            return
        what = "commit (KV made readable for decode)"
        witness = [tline, g.prefill_line]
        landed = self._landed_for(g, ev.ticket, ev.worker)
        if not landed or any(t.tokens is None and t.layers is None for t in landed):
            # nothing landed, or a transfer of every layer and position: the whole prompt
            self._verify(g, ev.worker, table, self._prompt(g), line, what, witness, ticket=ev.ticket)
            return
        # ranged transfers: exactly what landed, and the shared prefix
        prompt = self._prompt(g)
        bs = self.layout.block_size
        shared = g.shared.get(ev.worker)
        if shared and not self._verify(
            g, ev.worker, table, min(shared[1], prompt), line, what, witness, ticket=ev.ticket
        ):
            return
        for t in landed:
            if not t.moves:
                self._plan(t)
            items: list[tuple[int, int, int, int]] = []  # (block, first position, slots, first slot)
            for _i, _sb, _db, p0, s0, s1 in t.moves:
                s1 = min(s1, prompt - p0)
                if s0 >= s1:
                    continue
                if p0 // bs >= len(table):
                    if self._verify_items(
                        g, ev.worker, items, t.layers, line, what, witness + [t.line], t.tid, ev.ticket
                    ):
                        self._report_missing(
                            g, ev.worker, table, len(table) * bs, what, line, witness, t.tid, ev.ticket
                        )
                    return
                items.append((table[p0 // bs], p0 + s0, s1 - s0, s0))
            if not self._verify_items(
                g, ev.worker, items, t.layers, line, what, witness + [t.line], t.tid, ev.ticket
            ):
                return

    def _on_decode(self, ev: Decode, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        same = False
        if g.last_decode is not None:
            # superseded by this step's check
            worker, table, _pos, _l = g.last_decode
            same = worker == ev.worker and table == ev.blocks
            if not same:
                for b in table:
                    if self._final.get((worker, b)) == key:
                        del self._final[(worker, b)]
            g.last_decode = None
        self._verify(
            g,
            ev.worker,
            ev.blocks,
            ev.position,
            line,
            f"decode at position {ev.position}",
            [g.committed[2] if g.committed else None, g.prefill_line],
        )
        w = self._worker(ev.worker, "decode", ev.blocks)
        if w is None:
            return
        bs = self.layout.block_size
        if ev.position // bs >= len(ev.blocks):
            self._report_missing(
                g,
                ev.worker,
                ev.blocks,
                len(ev.blocks) * bs,
                f"decode at position {ev.position} (its own KV)",
                line,
                [],
                None,
                None,
            )
        else:
            # a decode writes its input's KV at its position; under recompute the
            # first decode recomputes the last prompt token's, which is prompt KV
            recomputed = self._recompute and ev.position == self._prompt(g) - 1
            code = _PROMPT if recomputed else (ev.input_token + 1) & _M32
            self._write_positions(w, ev.blocks, [g.tag], ev.position, [code], line)
            o = g.orig.get(ev.worker)
            if o and o.pop(ev.position, None) is not None:
                g.invalidate(ev.worker, ev.position // bs)
        if ev.position + 1 >= self._prompt(g):
            self._expect_token(g, ev.position + 1, ev.output_token)
        g.last_decode = (ev.worker, ev.blocks, ev.position, line)
        if not same or any(self._final.get((ev.worker, b)) != key for b in ev.blocks[-1:]):
            for b in ev.blocks:
                self._final[(ev.worker, b)] = key

    def _on_end(self, ev: Finish | Cancel | Fail, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        self._final_check(g, line)
        g.terminal = True
        g.checked.clear()
        g.fast.clear()

    def _on_free(self, ev: Free, line: int) -> None:
        w = self._workers.get(ev.worker)
        if w is None:
            return
        keys = {self._final[(ev.worker, b)] for b in ev.blocks if (ev.worker, b) in self._final}
        for key in sorted(keys):
            self._final_check(self._gens[key], line)
        who = (ev.request, ev.gen) if ev.request is not None and ev.gen is not None else None
        gone = []
        for b in ev.blocks:
            owners = self._owner.get((ev.worker, b))
            if owners and who in owners and len(owners) > 1:
                owners.remove(who)  # a shared block: another reference keeps it
                continue
            self._owner.pop((ev.worker, b), None)
            for tid in self._writers.get((ev.worker, b), ()):
                self._xfers[tid].early_freed.add(b)
            gone.append(b)
        if who is not None:
            alloc = self._alloc.get(who, {}).get(ev.worker)
            if alloc:
                drop = set(ev.blocks)
                alloc[:] = [b for b in alloc if b not in drop]
        kept = self._stash(w, gone) if self._shares else {}
        self._poison(w, gone, line)
        for b, entry in kept.items():
            w.stash[b] = (self._version(w, b),) + entry[1:]

    def _stash(self, w: _Worker, blocks: Sequence[int]) -> dict[int, tuple]:
        """Before freed blocks are poisoned: what they hold, for a share that
        revives one while nothing else modified it (a prefix cache)."""
        out: dict[int, tuple] = {}
        keep = []
        for b in blocks:
            if b >= w.nblocks:
                continue
            old = w.stash.get(b)
            if old is not None and old[0] == self._version(w, b):
                out[b] = old  # freed again without a write: the cached KV is still the stashed one
                continue
            origin = w.origin.get(b)
            if origin is None or all(o is None for o in origin):
                continue
            keep.append(b)
        if not keep:
            return out
        self._main_touch(w.name)
        per_block = self.layout.fp8 and self.layout.scale == "per-block"
        if len(keep) > 1 and len(keep) * w.pos_bytes * self.layout.block_size <= _STASH_BATCH:
            # small blocks: one gather per part; each entry holds views of it
            idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
            rows = [_bytes(p).index_select(0, idx) for p in w.pools]
            scales = [s.index_select(0, idx) for s in w.scales] if per_block else []
            for j, b in enumerate(keep):
                out[b] = (0, [r[j] for r in rows], [s[j] for s in scales], list(w.origin[b]))
            return out
        for b in keep:
            out[b] = (
                0,
                [_bytes(p[b]).clone() for p in w.pools],
                [s[b].clone() for s in w.scales] if per_block else [],
                list(w.origin[b]),
            )
        return out

    def _on_restart(self, ev: Restart, line: int) -> None:
        self.transport.restart(ev.worker)
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
            _bytes(pool).fill_(self._nan)
        if self.layout.fp8 and self.layout.scale == "per-block":
            for s in w.scales:
                s.fill_(float("nan"))
        self._clock += 1
        w.restart_stamp = self._clock
        w.restart_line = line
        w.stamp.clear()
        w.mod.clear()
        self._restart_log(w)
        w.last_write.clear()
        w.origin.clear()
        w.stash.clear()


def _bit_table(values: Sequence[float], dtype: torch.dtype) -> tuple[str, list[int | float]]:
    """(array typecode, the entry of each value) to build a tensor of ``dtype``
    with :func:`torch.frombuffer` (the values are exact in ``dtype``)."""
    if dtype == torch.float32:
        return "f", list(values)
    if dtype == torch.float64:
        return "d", list(values)
    if dtype == torch.float16:
        return "H", [struct.unpack("<H", struct.pack("<e", v))[0] for v in values]
    if dtype == torch.bfloat16:
        return "H", [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values]
    raise UsageError("value dtype", str(dtype), "float32, float64, float16 or bfloat16")


#: the numpy dtype whose items a bit table's array typecode holds (bits of 16-bit floats as int16)
_NP_BITS = {"f": np.float32, "d": np.float64, "H": np.int16}

_RAW = RAW  # the integer dtype of each width (one table, the transport's)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its width: index_select / index_copy_ /
    index_fill_ are bit copies then (fp8 has no such kernels on CPU, and the
    integer ones are several times faster than bfloat16's)."""
    return t.view(_RAW[t.element_size()]) if t.is_floating_point() else t


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """libc's ``memcmp`` through ctypes, or None where it cannot be found."""
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        fn = ctypes.CDLL(name).memcmp if name else None
    except (ImportError, OSError, AttributeError):  # pragma: no cover - no libc
        return None
    if fn is None:  # pragma: no cover
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _load_memcmp()


def _slots(pool: torch.Tensor) -> torch.Tensor:
    """A pool ``[blocks, block_size, ...]`` viewed as ``[blocks * block_size, ...]`` (slot ``b * bs + s``)."""
    return pool.view((pool.shape[0] * pool.shape[1],) + tuple(pool.shape[2:]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal (no expected value is NaN, and a NaN's bits differ
    from every value's).  Contiguous CPU tensors of one shape and dtype are
    compared with ``memcmp`` (a third faster than ``torch.equal`` on large
    rows); others in the widest integers the rows allow (several times
    faster than comparing bfloat16 elements)."""
    if (
        _MEMCMP is not None
        and not a.is_cuda
        and not b.is_cuda
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.is_contiguous()
        and b.is_contiguous()
    ):
        n = a.numel() * a.element_size()
        return n == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    width = a.shape[-1] * a.element_size()
    for size, dtype in ((8, torch.int64), (4, torch.int32)):
        if width % size == 0 and size > a.element_size():
            try:
                return torch.equal(a.view(dtype), b.view(dtype))
            except RuntimeError:  # a stride that does not allow the view
                break
    return torch.equal(_bytes(a), _bytes(b))


def _nan_bits(dtype: torch.dtype) -> int:
    """The integer whose bits are a NaN of ``dtype`` (see :func:`_bytes`)."""
    return int(
        torch.tensor(float("nan"), dtype=dtype).view(_RAW[torch.empty((), dtype=dtype).element_size()])
    )


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
