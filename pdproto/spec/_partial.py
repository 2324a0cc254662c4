"""The monitor on a partial history (format 1.1 feature ``observed``).

:class:`PartialMonitor` is the :class:`~pdproto.spec.Monitor` with three
changes, none of which touches the complete-history path:

- it judges only the invariants whose evidence the observed kinds carry
  (:data:`~pdproto.spec.INVARIANT_NEEDS`); the others are *not judged*
  (:attr:`PartialMonitor.not_judged`) and never reported;
- it reads the fields a partial history may leave out (docs/history-format.md):
  a left-out ``gen`` is the request's latest generation (violations found on
  such an event carry ``gen`` None), a ``free`` without blocks frees every
  block the request holds on that worker, a completion without ``transfer``
  completes the request's transfer(s) between its ``src`` and ``dst``;
- a free is checked against the transfers that still read or write its
  blocks even when the allocation of those blocks was not observed, and a
  read of a request that completes after a free of that request's blocks on
  the source worker (when the transfer's start was not observed) is
  ``early-source-free`` at the read's line: what vLLM logs as "Potentially
  invalid KV blocks for unrecognized request ... were retrieved".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from .._errors import UsageError
from ._events import EVENT_TYPES, Event, Free, TransferReadDone
from ._history import HistoryHeader
from ._monitor import (
    _DISPATCH,
    _OWN,
    INVARIANT_NEEDS,
    Monitor,
    _blocks_text,
    _fmt_gen,
    _met,
    check_invariant_ids,
    not_judged,
)
from ._observed import Observation

__all__ = ["PartialMonitor"]

#: how many frees of a request's blocks a partial monitor remembers for the
#: read-after-free check (the oldest goes first): memory stays bounded on a
#: log of any length; a read completing later than this many frees after its
#: free is not judged
FREED_MEMORY = 1 << 17

_COMPLETIONS = frozenset(
    EVENT_TYPES[k] for k in ("transfer_read_done", "transfer_write_done", "transfer_failed", "transfer_abort")
)
_ALLOCATING = frozenset(EVENT_TYPES[k] for k in ("reserve", "prefill_start", "alloc", "share"))
#: the side of a transfer a completion of each kind ends: reading, writing, either, or none
_ENDS = {"transfer_read_done": "r", "transfer_write_done": "w", "transfer_failed": "rw", "transfer_abort": ""}


class PartialMonitor(Monitor):
    """A monitor of a partial history: see the module's doc.

    ``observed`` says what the source could see; ``features`` are the
    history's declared format 1.1 features (a kind of an undeclared feature
    cannot be missed).  Events of kinds ``observed`` does not list are
    ignored (``pdproto audit --observed`` narrows a history that has them).
    :meth:`key` is :class:`Monitor`'s verdict state: the frees and the
    requests' transfers a partial monitor also remembers are not in it.
    """

    __slots__ = (
        "observed",
        "not_judged",
        "_kinds",
        "_own",
        "_by_request",
        "_freed",
        "_requests",
        "_by_read_only",
    )

    def __init__(
        self,
        policy: str = "push",
        *,
        observed: Observation,
        features: Iterable[str] = (),
        skip: Iterable[str] = (),
        **settings: Any,
    ) -> None:
        """``settings``: the other arguments of :class:`Monitor` (``complete``,
        ``workers``, ``kv``, ``block_size``, ``boundary``)."""
        if not isinstance(observed, Observation):
            raise UsageError("observed", observed, "an Observation")
        provided = observed.terms(features)
        found = not_judged(provided)
        super().__init__(policy, skip=check_invariant_ids(skip) | {inv for inv, _, _ in found}, **settings)
        #: the observation judged under
        self.observed = observed
        #: the invariants not judged, each ``(invariant, needs, missing)``
        self.not_judged: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = tuple(found)
        self._kinds = frozenset(EVENT_TYPES[k] for k in observed.kinds)
        self._own = frozenset(_OWN) <= provided  # every kind that takes or frees a block is seen
        # early-source-free judged by its second alternative alone (reads
        # named by request): the transfers' state cannot show it (a start or
        # an end of a read is not seen), only a read completing after a free
        self._by_read_only = not any(
            all(_met(t, provided) for t in alt) for alt in INVARIANT_NEEDS["early-source-free"][:1]
        )
        self._by_request: dict[str, list[str]] = {}  # request -> its transfers
        # request -> {worker: (line of the free, gen or None)}, the latest frees
        self._freed: dict[str, dict[str, tuple[int, int | None]]] = {}
        self._requests: set[str] = set()  # every request named

    @classmethod
    def from_header(  # type: ignore[override]
        cls,
        header: HistoryHeader,
        *,
        policy: str | None = None,
        complete: bool | None = None,
        skip: Iterable[str] = (),
        observed: Observation | None = None,
    ) -> PartialMonitor:
        """A partial monitor as the header says; ``observed`` overrides the
        header's (one of the two is required)."""
        observed = observed if observed is not None else header.observed
        if observed is None:
            raise UsageError("observed", None, "an Observation (the header declares none)")
        return cls(
            observed=observed,
            features=header.features,
            skip=skip,
            **Monitor._settings(header, policy, complete),
        )

    @property
    def requests(self) -> int:
        return len(self._requests | {key[0] for key in self._gens})

    def _settings_copy(self) -> PartialMonitor:
        # (copy() and with_key() start here)
        new = super()._settings_copy()
        assert isinstance(new, PartialMonitor)
        new.observed = self.observed
        new.not_judged = self.not_judged
        new._kinds = self._kinds
        new._own = self._own
        new._by_read_only = self._by_read_only
        new._by_request = {r: list(t) for r, t in self._by_request.items()}
        new._freed = {r: dict(w) for r, w in self._freed.items()}
        new._requests = set(self._requests)
        return new

    # -- feeding -------------------------------------------------------------

    def feed(self, event: Event, line: int | None = None) -> list:
        cls = type(event)
        if cls not in _DISPATCH:
            return super().feed(event, line)  # which refuses it
        self.line = self.line + 1 if line is None else line
        if cls not in self._kinds:
            return []  # a kind the observation leaves out (audit --observed)
        self.events += 1
        out = self._out = []
        line = self.line
        request = getattr(event, "request", None)
        if request is not None:
            self._requests.add(request)
        unknown_gen = False
        if cls is not Free and cls not in _COMPLETIONS and getattr(event, "gen", 0) is None:
            event = attrs.evolve(event, gen=self._max_gen.get(request, 0))  # type: ignore[misc]
            unknown_gen = True
        if cls is Free:
            self._on_partial_free(event, line)  # type: ignore[arg-type]
        elif cls in _COMPLETIONS:
            self._on_completion(event, line)
        else:
            _DISPATCH[cls](self, event, line)
            if event.EV == "transfer_start":
                self._by_request.setdefault(event.request, []).append(event.transfer)  # type: ignore[attr-defined]
            elif cls in _ALLOCATING:
                self._forget_free(request, event.worker)  # type: ignore[attr-defined]
            elif event.EV == "submit" and not unknown_gen:
                self._freed.pop(request, None)  # a new generation: its blocks are new
        if out and self._by_read_only:
            # (the read-after-free check names no transfer; the others do)
            out[:] = [v for v in out if v.invariant != "early-source-free" or v.transfer is None]
        if out and unknown_gen:
            out[:] = [
                attrs.evolve(v, gen=None) if v.request == request and v.line == line else v for v in out
            ]
        if out:
            self.violations.extend(out)
        return out

    def _forget_free(self, request: str | None, worker: str) -> None:
        frees = self._freed.get(request) if request is not None else None
        if frees is not None:
            frees.pop(worker, None)
            if not frees:
                del self._freed[request]  # type: ignore[arg-type]

    def _remember_free(self, ev: Free, line: int) -> None:
        if ev.request is None:
            return
        freed = self._freed
        frees = freed.pop(ev.request, None) or {}  # popped: re-inserted as the newest
        frees[ev.worker] = (line, ev.gen)
        freed[ev.request] = frees
        if len(freed) > FREED_MEMORY:
            del freed[next(iter(freed))]

    def _on_partial_free(self, ev: Free, line: int) -> None:
        worker = ev.worker
        if ev.blocks is None:
            # every block the request holds there (of ``gen`` when given)
            held = self._held(ev.request, ev.gen, worker) if self._own else ()
            if held:
                Monitor._on_free(self, attrs.evolve(ev, blocks=held), line)
            elif (
                ev.request is not None and not self._own
            ):  # (with ownership seen: nothing held, nothing freed)
                self._early_by_request(ev, line)
        else:
            unowned = []
            if not self._own:
                owner, shared = self._owner.get(worker, {}), self._shared
                unowned = [b for b in ev.blocks if b not in owner and (worker, b) not in shared]
            Monitor._on_free(self, ev, line)
            if unowned:
                self._early_unowned(ev, unowned, line)
        self._remember_free(ev, line)

    def _held(self, request: str | None, gen: int | None, worker: str) -> tuple[int, ...]:
        def mine(key: tuple[str, int]) -> bool:
            return key[0] == request and (gen is None or key[1] == gen)

        blocks = [b for b, key in self._owner.get(worker, {}).items() if mine(key)]
        blocks += [b for (w, b), keys in self._shared.items() if w == worker and any(map(mine, keys))]
        return tuple(sorted(blocks))

    def _early_by_request(self, ev: Free, line: int) -> None:
        """A free of the request's blocks on a worker, ids unknown: the
        transfers of that request still reading from (or writing into) that
        worker."""
        for tid in self._by_request.get(ev.request, ()):  # type: ignore[arg-type]
            t = self._transfers[tid]
            if ev.gen is not None and t.gen[1] != ev.gen:
                continue
            for invariant, on, side, verb in (
                ("early-source-free", t.reading, t.src, "read"),
                ("early-target-reuse", t.writing, t.dst, "write into"),
            ):
                if on and side == ev.worker:
                    self._report(
                        invariant,
                        line,
                        f"free of the blocks of {_fmt_gen(t.gen)} on {ev.worker!r} while transfer {tid!r} "
                        f"can still {verb} them",
                        [self._lines.get(("transfer", tid))],
                        worker=ev.worker,
                        request=t.gen[0],
                        gen=t.gen[1],
                        transfer=tid,
                    )

    def _early_unowned(self, ev: Free, blocks: list[int], line: int) -> None:
        """The freed blocks whose allocation was not observed, against the
        transfers reading or writing them."""
        worker = ev.worker
        for invariant, index, verb in (
            ("early-source-free", self._reading, "read"),
            ("early-target-reuse", self._writing, "write into"),
        ):
            found: dict[frozenset, list[int]] = {}
            index = index.get(worker, {})
            for b in blocks:
                tids = index.get(b)
                if tids:
                    found.setdefault(tids, []).append(b)
            for tids, bs in found.items():
                first = self._transfers[min(tids)]
                self._report(
                    invariant,
                    line,
                    f"free of block(s) {_blocks_text(bs)} on {worker!r} ({_fmt_gen(first.gen)}) while "
                    f"transfer(s) {', '.join(map(repr, sorted(tids)))} can still {verb} them",
                    [self._lines.get(("transfer", t)) for t in tids],
                    worker=worker,
                    block=bs[0],
                    request=first.gen[0],
                    gen=first.gen[1],
                    transfer=min(tids),
                )

    def _on_completion(self, ev: Any, line: int) -> None:
        handler = _DISPATCH[type(ev)]
        if ev.transfer is not None:
            handler(self, ev, line)
            return
        cls = type(ev)
        matching = [
            tid for tid in self._by_request.get(ev.request, ()) if self._matches(self._transfers[tid], ev)
        ]
        if matching:
            for tid in matching:
                t = self._transfers[tid]
                ends = _ENDS[ev.EV]
                if not ends or ("r" in ends and t.reading) or ("w" in ends and t.writing):
                    handler(self, attrs.evolve(ev, transfer=tid), line)
            return
        if cls is TransferReadDone:
            self._read_after_free(ev, line)
        if EVENT_TYPES["transfer_start"] in self._kinds:
            self._report(
                "unknown-transfer",
                line,
                f"{ev.EV} names request {ev.request!r}"
                + "".join(
                    f" {f} {getattr(ev, f)!r}" for f in ("gen", "src", "dst") if getattr(ev, f) is not None
                )
                + ", of which no transfer started",
                request=ev.request,
                gen=ev.gen,
            )

    @staticmethod
    def _matches(t: Any, ev: Any) -> bool:
        return (
            (ev.gen is None or t.gen[1] == ev.gen)
            and (ev.src is None or t.src == ev.src)
            and (ev.dst is None or t.dst == ev.dst)
        )

    def _read_after_free(self, ev: TransferReadDone, line: int) -> None:
        """A read of the request (whose start was not observed) completes
        after a free of the request's blocks on its source worker: it read
        them after, or while, they were freed."""
        frees = self._freed.get(ev.request)  # type: ignore[arg-type]
        if not frees:
            return
        for worker, (free_line, gen) in sorted(frees.items()):
            if ev.src is not None and worker != ev.src:
                continue
            if gen is not None and ev.gen is not None and gen != ev.gen:
                continue
            known = ev.gen if ev.gen is not None else gen
            named = f"request {ev.request!r}" + (f" gen {known}" if known is not None else "")
            self._report(
                "early-source-free",
                line,
                f"a read of {named} from {worker!r} completed here, after the free of its blocks there "
                f"at line {free_line}: the transfer read blocks that were already released",
                [free_line],
                worker=worker,
                request=ev.request,
                gen=known,
            )
            self._forget_free(ev.request, worker)


Monitor._PARTIAL = PartialMonitor  # what Monitor.from_header makes for a partial history
