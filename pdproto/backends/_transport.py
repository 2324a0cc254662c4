"""The transport layer of the torch replay backend: how KV blocks move from
one worker's pool to another's (docs/replay.md, "Transports").

The backend decides *when* bytes move (adversarial timing: a transfer reads
its source at ``transfer_read_done`` and its writes land at
``transfer_write_done``); the transport decides *how*, and reports when the
move is done through its library's own signals.  One :class:`Transfer` is a
list of block moves (:class:`BlockMove`: block lists from a source pool to a
target pool, restricted to layers, heads and slots) plus single view pairs
(fp8 per-block scales).

- ``copy`` (:class:`CopyTransport`, the default): ``Tensor.copy_`` in
  process; done when the copy returns.
- ``nixl`` (:mod:`._nixl`): one NIXL agent per worker over UCX on host
  memory.  Pull (``policy: pull``) is a READ initiated by the decode worker,
  push a WRITE initiated by the prefill worker; done when the initiator's
  state is DONE, and the peer is told by the library's notification.
- ``mooncake`` (:mod:`._mooncake`): one Mooncake transfer engine per worker
  over TCP on loopback.

Faults go through the library: :meth:`Transport.run` with ``aborted=True``
releases the handle while the transfer is active (``transfer_abort``),
:meth:`Transport.fail` makes the library report an error (``transfer_failed``)
and :meth:`Transport.restart` removes a worker's agent from its peers and adds
it again (``restart``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from .._errors import TransportError, UsageError

__all__ = [
    "BlockMove",
    "Transfer",
    "Transport",
    "CopyTransport",
    "Registered",
    "TransportError",
    "TransportStatistics",
    "block_views",
    "byte_runs",
]

DONE, PROC, ERR = "DONE", "PROC", "ERR"

#: the integer dtype of each element width: a view of a tensor as its bits
RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: seconds a transfer may stay in progress before it is a TransportError
DEFAULT_TIMEOUT = 60.0


@attrs.define(eq=False)
class BlockMove:
    """``dst[dst_ids[i], slots, dl, :, dheads] = src[src_ids[i], slots, sl, :, sheads]``
    for each ``i``: pools shaped ``[blocks, block_size, layers, K/V, heads,
    head_dim]``; ``dl``/``sl`` local layer ranges, ``heads`` ``((d0, d1),
    (s0, s1))`` local head ranges or None for all, ``slots`` ``(t0, t1)`` or
    None for the whole block."""

    dst: torch.Tensor
    dst_ids: Sequence[int]
    src: torch.Tensor
    src_ids: Sequence[int]
    dl: tuple[int, int]
    sl: tuple[int, int]
    heads: tuple | None = None
    slots: tuple[int, int] | None = None


@attrs.define(eq=False)
class Transfer:
    """One transfer of the history: ``tid`` from worker ``src`` to ``dst``;
    ``pull`` (a READ initiated by ``dst``) or push (a WRITE initiated by
    ``src``); ``moves`` and ``pairs`` (``(target view, source view)``) say
    what moves; ``staged``: the source is a copy-on-write snapshot in the
    source worker's staging buffers."""

    tid: str
    src: str
    dst: str
    pull: bool
    moves: list[BlockMove] = attrs.field(factory=list)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=list)
    staged: bool = False


@attrs.frozen
class TransportStatistics:
    """What a transport did (:meth:`Transport.statistics`, a snapshot).

    ``transfers`` completed and their ``bytes``; ``seconds`` from posting to
    the initiator's completion (summed; ``max_latency`` the longest one,
    ``median_latency`` the median); ``notify_seconds`` from the
    initiator's completion to the peer's notification, ``notifications_missing``
    those that never came; ``aborts`` handles released (``aborts_active``
    while still in progress; ``aborts_landed`` whose bytes landed anyway,
    ``aborts_cancelled`` whose bytes the library never landed (the backend
    does not count those writes as landed), ``aborts_unknown`` whose target
    held the source's bytes before the transfer (landing cannot be told),
    ``aborts_notified`` whose peer was notified all the same);
    ``timeouts`` transfers still in progress after ``timeout`` seconds;
    ``failures`` transfers the library reported as failed (``errors``: its
    texts); ``restarts`` agents removed and re-added."""

    name: str
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_latency: float = 0.0
    median_latency: float = 0.0
    notify_seconds: float = 0.0
    notifications: int = 0
    notifications_missing: int = 0
    aborts: int = 0
    aborts_active: int = 0
    aborts_landed: int = 0
    aborts_cancelled: int = 0
    aborts_unknown: int = 0
    timeouts: int = 0
    aborts_notified: int = 0
    failures: int = 0
    errors: tuple[str, ...] = ()
    restarts: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["errors"] = list(self.errors)
        return out


def block_views(m: BlockMove) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The (target view, source view) pairs of ``m``: one per run of
    consecutive blocks on both sides."""
    runs: list[list[int]] = []
    for d, s in zip(m.dst_ids, m.src_ids):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    full = _whole(m)
    (dj0, dj1), (si0, si1) = m.heads if m.heads is not None else ((0, m.dst.shape[4]), (0, m.src.shape[4]))
    t0, t1 = m.slots if m.slots is not None else (0, m.dst.shape[1])
    dl, sl = m.dl, m.sl
    for d, s, n in runs:
        if full:
            yield m.dst[d : d + n], m.src[s : s + n]
        else:
            yield (
                m.dst[d : d + n, t0:t1, dl[0] : dl[1], :, dj0:dj1],
                m.src[s : s + n, t0:t1, sl[0] : sl[1], :, si0:si1],
            )


def _whole(m: BlockMove) -> bool:
    """Does ``m`` move whole blocks (every layer, head and slot)?"""
    return m.dl == (0, m.dst.shape[2]) and m.sl == (0, m.src.shape[2]) and m.heads is None and m.slots is None


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(RAW[t.element_size()])


class Transport:
    """The interface: ``run(transfer)`` moves a transfer's bytes and returns
    when the library reports it done; ``fail(transfer)`` makes the library
    report a failure and returns its text; ``restart(worker)`` removes and
    re-adds a worker's agent; ``lose(worker)`` removes it from its peers.
    ``start`` / ``poll`` / ``wait`` / ``abort`` are the steps of ``run``.
    ``timeout``: seconds a transfer may stay in progress (``wait``) before
    it is a :class:`~pdproto.TransportError`; ``abort_timeout``: seconds an
    aborted transfer's bytes may take to land before it counts as cancelled.
    A transport is shared by the copies of a backend (``copy.deepcopy``
    returns it as is); ``close()`` releases its agents (a transport made
    by name is closed by whoever named it: :func:`pdproto.drivers.replay`,
    the CLI)."""

    name = "copy"

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, abort_timeout: float = 2.0) -> None:
        for what, value in (("timeout", timeout), ("abort_timeout", abort_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError(f"transport {what}", value, "a number of seconds > 0")
        self.timeout = float(timeout)
        self.abort_timeout = float(abort_timeout)
        self._stats: dict[str, Any] = {"errors": []}
        self._latencies: list[float] = []  # post to completion, per transfer (the first 100,000)

    # the steps ------------------------------------------------------------

    def start(self, x: Transfer) -> Any:
        raise NotImplementedError

    def poll(self, handle: Any) -> str:
        raise NotImplementedError

    def wait(self, handle: Any, what: str = "a transfer") -> str:
        """Poll ``handle`` until it is no longer in progress; a
        :class:`~pdproto.TransportError` after ``timeout`` seconds."""
        state = self.poll(handle)
        end = time.perf_counter() + self.timeout
        while state == PROC:
            if time.perf_counter() > end:
                self._count("timeouts")
                self._error(f"{what} still in progress after {self.timeout:g} s")
                raise TransportError(self.name, what, f"still in progress after {self.timeout:g} s (timeout)")
            time.sleep(0)  # yield: the library's progress thread needs the CPU (spinning was 10x slower)
            state = self.poll(handle)
        return state

    def abort(self, handle: Any) -> bool:
        """Release ``handle`` now; True when it was still in progress."""
        return False

    def notify(self, handle: Any) -> None:
        """Wait for the peer's notification of ``handle`` (none for copy)."""

    def finish(self, handle: Any) -> None:
        """Release a completed ``handle``."""

    def notified(self, handle: Any, timeout: float) -> bool:
        """Did the peer get ``handle``'s notification within ``timeout`` seconds?"""
        return False

    # the whole -------------------------------------------------------------

    def run(self, x: Transfer, *, aborted: bool = False) -> bool:
        """Move ``x``; with ``aborted`` release its handle at once (the
        history aborted it before its writes landed) and wait for what the
        library still lands.  False when the library cancelled an aborted
        transfer (its bytes did not land: counted in ``aborts_cancelled``),
        else True."""
        pairs = self._pairs(x)
        nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        where = f"transfer {x.tid!r} from {x.src!r} to {x.dst!r}"
        if aborted:
            before = _same(pairs)
            handle = self.start(x)
            active = self.abort(handle)
            landed = self._settle(x)
            self._count("aborts")
            self._count("aborts_active", int(active))
            if before:
                self._count("aborts_unknown")
            elif landed:
                self._count("aborts_landed")
            else:
                self._count("aborts_cancelled")
                self._error(f"{where}: aborted and cancelled by the library (its bytes did not land)")
            self._count("aborts_notified", int(self.notified(handle, 0.2)))
            return landed
        t0 = time.perf_counter()
        handle = self.start(x)
        state = self.wait(handle, where)
        elapsed = time.perf_counter() - t0
        if state != DONE:
            self._error(f"transfer {x.tid!r} ended in state {state}")
            raise TransportError(
                self.name, f"transfer {x.tid!r} from {x.src!r} to {x.dst!r}", f"the library reported {state}"
            )
        self._count("transfers")
        self._count("bytes", nbytes)
        self._count("seconds", elapsed)
        self._stats["max_latency"] = max(self._stats.get("max_latency", 0.0), elapsed)
        if len(self._latencies) < 100_000:
            self._latencies.append(elapsed)
        self.notify(handle)
        self.finish(handle)
        return True

    def fail(self, x: Transfer) -> str:
        """Make the library report ``x`` as failed; returns the library's text."""
        self._count("failures")
        text = "injected (the copy transport has no library to fail)"
        self._error(text)
        return text

    def restart(self, worker: str) -> None:
        self._count("restarts")

    def lose(self, worker: str) -> None:
        pass

    def close(self) -> None:
        pass

    def statistics(self) -> TransportStatistics:
        s = dict(self._stats)
        s["errors"] = tuple(s.pop("errors"))
        lat = sorted(self._latencies)
        s["median_latency"] = lat[len(lat) // 2] if lat else 0.0
        return TransportStatistics(self.name, **s)

    def __deepcopy__(self, memo: dict) -> Transport:
        return self

    def __copy__(self) -> Transport:
        return self

    # helpers ---------------------------------------------------------------

    def _count(self, key: str, n: float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def _error(self, text: str) -> None:
        errors = self._stats["errors"]
        if len(errors) < 20:
            errors.append(text)

    @staticmethod
    def _pairs(x: Transfer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [p for m in x.moves for p in block_views(m)] + list(x.pairs)

    def _settle(self, x: Transfer) -> bool:
        """After a released handle: wait until the target holds the source's
        bytes (True) or ``abort_timeout`` seconds pass (False: the library
        cancelled it)."""
        pairs = self._pairs(x)
        end = time.perf_counter() + self.abort_timeout
        while True:
            if _same(pairs):
                return True
            if time.perf_counter() > end:
                return False
            time.sleep(0.001)


class CopyTransport(Transport):
    """``Tensor.copy_`` in process (the default): a transfer is done when its
    copies return; abort, failure and restart involve no library."""

    name = "copy"

    def start(self, x: Transfer) -> Any:
        for m in x.moves:
            _copy_move(m)
        for d, s in x.pairs:
            d.copy_(s)
        return x

    def poll(self, handle: Any) -> str:
        return DONE

    def run(self, x: Transfer, *, aborted: bool = False) -> bool:
        self.start(x)  # the backend's hot path: no timing, no statistics
        return True


def _same(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Does every target view hold its source view's bytes?"""
    return all(torch.equal(_raw(d), _raw(s)) for d, s in pairs)


def _copy_move(m: BlockMove) -> None:
    """``m`` with torch copies: many whole blocks at once with one
    index_copy_, else one copy_ per run of consecutive blocks."""
    if _whole(m) and len(m.dst_ids) > 16 and len(set(m.dst_ids)) == len(m.dst_ids):
        runs = 1 + sum(
            1
            for i in range(1, len(m.dst_ids))
            if m.dst_ids[i] != m.dst_ids[i - 1] + 1 or m.src_ids[i] != m.src_ids[i - 1] + 1
        )
        if runs > 16:
            di = torch.tensor(list(m.dst_ids), device=m.dst.device, dtype=torch.int64)
            si = torch.tensor(list(m.src_ids), device=m.src.device, dtype=torch.int64)
            _raw(m.dst).index_copy_(0, di, _raw(m.src).index_select(0, si))
            return
    for d, s in block_views(m):
        d.copy_(s)


def byte_runs(d: torch.Tensor, s: torch.Tensor) -> tuple[Any, Any, int]:
    """Target and source start addresses (two numpy int64 arrays) of the
    contiguous byte runs of the same-shaped views ``d`` and ``s``, and the
    length in bytes of each run."""
    import numpy as np

    shape = list(d.shape)
    es = d.element_size()
    k = len(shape)  # dims k.. are contiguous in both views
    span = 1
    while k > 0:
        size = shape[k - 1]
        if size != 1 and (d.stride(k - 1) != span or s.stride(k - 1) != span):
            break
        span *= size
        k -= 1
    doff = np.zeros(1, dtype=np.int64)
    soff = np.zeros(1, dtype=np.int64)
    for dim in range(k):
        idx = np.arange(shape[dim], dtype=np.int64)
        doff = (doff[:, None] + idx[None, :] * d.stride(dim) * es).reshape(-1)
        soff = (soff[:, None] + idx[None, :] * s.stride(dim) * es).reshape(-1)
    return doff + d.data_ptr(), soff + s.data_ptr(), span * es


class Registered(Transport):
    """A transport whose library must know the memory it moves: every base
    tensor a transfer touches is registered with its worker's agent on first
    use, and deregistered when the tensor is freed (pools grow by
    reallocation; staging buffers come and go)."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, abort_timeout: float = 2.0) -> None:
        super().__init__(timeout=timeout, abort_timeout=abort_timeout)
        # (worker, address) -> (weak reference to the base tensor, bytes, the library's token)
        self._regs: dict[tuple[str, int], tuple[Any, int, Any]] = {}

    def _register(self, worker: str, base: torch.Tensor) -> Any:
        raise NotImplementedError

    def _deregister(self, worker: str, token: Any) -> None:
        raise NotImplementedError

    def _registered(self, worker: str) -> None:
        """``worker``'s registrations changed (its peers' view of it is stale)."""

    def ensure(self, worker: str, t: torch.Tensor) -> None:
        import weakref

        base = t if t._base is None else t._base
        ptr, nbytes = base.data_ptr(), base.numel() * base.element_size()
        key = (worker, ptr)
        old = self._regs.get(key)
        if old is not None:
            if old[0]() is base and old[1] == nbytes:
                return
            self._drop(key)
        token = self._register(worker, base)
        self._regs[key] = (weakref.ref(base), nbytes, token)
        weakref.finalize(base, self._drop, key, token)
        self._registered(worker)

    def _drop(self, key: tuple[str, int], token: Any = None) -> None:
        entry = self._regs.get(key)
        if entry is None or (token is not None and entry[2] is not token):
            return
        del self._regs[key]
        try:
            self._deregister(key[0], entry[2])
        except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone
            pass

    def ensure_all(self, x: Transfer) -> None:
        for m in x.moves:
            self.ensure(x.dst, m.dst)
            self.ensure(x.src, m.src)
        for d, s in x.pairs:
            self.ensure(x.dst, d)
            self.ensure(x.src, s)

    def descriptors(self, x: Transfer) -> tuple[Any, Any, Any]:
        """(target addresses, source addresses, lengths) of ``x``, numpy int64."""
        import numpy as np

        ds, ss, ls = [], [], []
        for d, s in self._pairs(x):
            if d.numel() == 0:
                continue
            da, sa, n = byte_runs(d, s)
            ds.append(da)
            ss.append(sa)
            ls.append(np.full(len(da), n, dtype=np.int64))
        if not ds:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(ds), np.concatenate(ss), np.concatenate(ls)
