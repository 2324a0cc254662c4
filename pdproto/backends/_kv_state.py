"""The torch backend's bookkeeping: a worker's pools, a generation, a transfer in
flight, the statistics and the violation it reports (see :mod:`._torch`)."""

from __future__ import annotations

from typing import Any

import attrs
import torch  # first: without the torch extra, the missing module is torch

from .._errors import UsageError
from ..spec import (
    TransferStart,
    Violation,
)
from ._kv_common import (
    _slots,
)


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
