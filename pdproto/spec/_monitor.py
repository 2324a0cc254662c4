"""The monitor: the specification of a correct handoff, as a history checker.

It reads events one at a time and reports violations of named invariants.
It shares no logic with any model: models emit events, the monitor judges
them.  Everything here is derived from the history alone.

Terms (see docs/invariants.md):

- a transfer is *in flight for reading* from ``transfer_start`` until
  ``transfer_read_done`` or ``transfer_failed``, and *in flight for writing*
  until ``transfer_write_done`` or ``transfer_failed``;
- a generation is *terminal* after its ``finish``, ``cancel`` or ``fail``;
- ``restart`` frees all of the worker's blocks except those a transfer in
  flight for writing still targets: those are *quarantined* until that
  transfer ends.  A transfer reading from (or writing into) a restarted
  worker has *lost its source* (or its target) and can never make a commit
  ready.

Format 1.1 adds (see docs/invariants.md):

- *shared blocks*: a ``share`` takes one reference on blocks that may be
  owned already; a block belongs to every generation holding a reference and
  returns to the pool when the last one frees it.  A shared block is never
  the target of a transfer;
- *ranged transfers* (``layers`` / ``tokens``): a commit is ready when the
  landed transfers of its ticket together cover every layer of the prompt
  positions the generation does not share on that worker;
- *prefix-cache hits*: a prefill may process only the positions after the
  prefix its shares on the prefill worker hold.

The monitor's state splits in two: the verdict state (what decides future
violations; :meth:`Monitor.key` returns it, hashable, for explorers that
search the product of a model and the monitor) and the line bookkeeping used
only to name witnesses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any, ClassVar, NamedTuple

import attrs

from .._errors import UsageError
from ._events import (
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
    Share,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
)
from ._history import BOUNDARIES, POLICIES, HistoryHeader, KVSpec, WorkerSpec

__all__ = [
    "INVARIANTS",
    "END_INVARIANTS",
    "INVARIANT_NEEDS",
    "Violation",
    "Monitor",
    "check_invariant_ids",
    "not_judged",
]

#: Every invariant id, in the order the documentation lists them, with a
#: one-line rule.  The ids are a stable public interface.
INVARIANTS: Mapping[str, str] = {
    "double-allocation": "an allocation names a block that is already owned (shared or not), or a "
    "share names a block its generation already holds",
    "bad-free": "a free names a block that is not owned, or owned by another generation, or a shared "
    "block without naming the generation whose reference it drops",
    "early-source-free": "a free releases a block that a transfer in flight for reading still reads",
    "early-target-reuse": "a free releases a block that a transfer in flight for writing still "
    "targets, or an allocation takes a quarantined block",
    "commit-before-ready": "commit before the completed, unfailed transfers of that ticket into that "
    "worker whose source and target survived cover every layer of every prompt position it does not "
    "share there",
    "double-commit": "a second commit for the same request generation",
    "resurrection": "activity (reserve, prefill_start, alloc, share, transfer_start, commit, decode) "
    "for a terminal generation",
    "stale-generation": "activity for a generation after a later one was submitted, or a submit "
    "whose gen is not greater than every earlier one",
    "ticket-mismatch": "a ticket used by another generation, into another worker, or never reserved",
    "id-reuse": "a ticket or transfer id used again",
    "unknown-transfer": "a transfer completion or abort naming a transfer that never started",
    "foreign-block-access": "a transfer or decode touches blocks its generation does not own there, "
    "or a transfer writes into a block another generation shares",
    "decode-before-commit": "decode without an earlier commit of that generation on that worker",
    "first-token-boundary": "the first decode is not at position prompt_len (== processed_len, plus "
    "the prefix a prefix-cache hit skipped) with the first token as input; under the header's "
    "boundary recompute (vLLM's convention), not at position prompt_len - 1",
    "decode-continuity": "a later decode skips a position, feeds another token, or exceeds max_new_tokens",
    "reserve-before-prefill": "(push) prefill_start without an open reservation of that generation",
    "capacity": "a block id outside the declared pool",
    "leak": "(end of a complete history) a block still owned by a terminal generation, or a "
    "transfer still in flight",
    "stuck": "(end of a complete history) a submitted generation that never became terminal",
}

END_INVARIANTS = ("leak", "stuck")

_OWN = ("reserve", "prefill_start", "alloc", "share", "free", "restart")
_ENDS = ("finish", "cancel", "fail")
_ACTIVITY = "reserve|prefill_start|alloc|share|transfer_start|commit|decode"

#: What each invariant needs observed to be judged on a partial history
#: (format 1.1 feature ``observed``): alternatives, each a set of terms, all
#: of which must be observed.  A term is an event kind, ``kind.field`` (every
#: event of that kind records the field), or ``a|b`` (one of them).  The
#: kinds are those that create the invariant's evidence and those that clear
#: it: without a kind that clears it (a free, a completion) a violation could
#: be false, so the invariant is not judged.  docs/invariants.md shows this
#: table; tests hold the two equal.
INVARIANT_NEEDS: Mapping[str, tuple[frozenset[str], ...]] = {
    "double-allocation": (frozenset(_OWN),),
    "bad-free": (frozenset(_OWN),),
    "early-source-free": (
        frozenset({"free", "restart", "transfer_start", "transfer_read_done", "transfer_failed"}),
        # a log naming requests, not transfers: a read of a request from a
        # worker that completes after a free of that request's blocks there
        frozenset({"free", "free.request", "transfer_read_done", "transfer_read_done.request"}),
    ),
    "early-target-reuse": (
        frozenset({"free", "restart", "transfer_start", "transfer_write_done", "transfer_failed"}),
    ),
    "commit-before-ready": (
        frozenset(
            {
                "commit",
                "submit",
                "reserve",
                "prefill_start",
                "alloc",
                "share",
                "restart",
                "transfer_start",
                "transfer_write_done",
                "transfer_failed",
            }
        ),
    ),
    "double-commit": (frozenset({"commit"}),),
    "resurrection": (frozenset({*_ENDS, _ACTIVITY}),),
    "stale-generation": (frozenset({"submit"}),),
    "ticket-mismatch": (frozenset({"reserve", "transfer_start|commit"}),),
    "id-reuse": (frozenset({"reserve|transfer_start"}),),
    "unknown-transfer": (
        frozenset(
            {"transfer_start", "transfer_read_done|transfer_write_done|transfer_failed|transfer_abort"}
        ),
    ),
    "foreign-block-access": (frozenset({*_OWN, "transfer_start", "transfer_write_done", "transfer_failed"}),),
    "decode-before-commit": (frozenset({"commit", "decode"}),),
    "first-token-boundary": (frozenset({"prefill_done", "decode", "share"}),),
    "decode-continuity": (frozenset({"decode"}),),
    "reserve-before-prefill": (frozenset(_OWN),),
    "capacity": (frozenset({"reserve|prefill_start|alloc|share|free|transfer_start|decode"}),),
    "leak": (
        frozenset(
            {*_OWN, *_ENDS, "transfer_start", "transfer_read_done", "transfer_write_done", "transfer_failed"}
        ),
    ),
    "stuck": (frozenset({"submit", *_ENDS}),),
}


def _met(term: str, provided: frozenset[str]) -> bool:
    return any(t in provided for t in term.split("|"))


def not_judged(provided: Iterable[str]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """The invariants that the observed ``provided`` terms (see
    :meth:`pdproto.spec.Observation.terms`) cannot judge, in
    :data:`INVARIANTS` order, each as ``(invariant, needs, missing)``: the
    terms of its first (full) alternative, and those of them not met."""
    have = frozenset(provided)
    out = []
    for inv, alternatives in INVARIANT_NEEDS.items():
        if any(all(_met(t, have) for t in alt) for alt in alternatives):
            continue
        needs = tuple(sorted(alternatives[0]))
        out.append((inv, needs, tuple(t for t in needs if not _met(t, have))))
    return out


def check_invariant_ids(ids: Iterable[str]) -> frozenset[str]:
    """Validate invariant ids (for ``--skip``); raises UsageError on an unknown one."""
    out = set()
    for inv in ids:
        if inv not in INVARIANTS:
            raise UsageError("invariant", inv, "one of " + ", ".join(INVARIANTS))
        out.add(inv)
    return frozenset(out)


@attrs.frozen
class Violation:
    """One broken invariant.

    ``line`` is the 1-based line of the event that made the violation
    certain (for end-of-history checks, the last line of the history);
    ``witness`` lists the earlier lines that set it up.  The other fields
    name what was involved, where they apply.
    """

    invariant: str
    line: int
    message: str
    witness: tuple[int, ...] = ()
    request: str | None = attrs.field(default=None, kw_only=True)
    gen: int | None = attrs.field(default=None, kw_only=True)
    worker: str | None = attrs.field(default=None, kw_only=True)
    block: int | None = attrs.field(default=None, kw_only=True)
    transfer: str | None = attrs.field(default=None, kw_only=True)
    ticket: str | None = attrs.field(default=None, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used by ``pdproto audit --json``."""
        return {
            "invariant": self.invariant,
            "line": self.line,
            "message": self.message,
            "witness": list(self.witness),
        }


class _Gen(NamedTuple):
    submitted: bool = False
    terminal: bool = False
    prompt_len: int | None = None
    max_new: int | None = None
    first_token: int | None = None
    processed_len: int | None = None
    cached: int = 0  # prompt positions its shares on its prefill worker held at prefill_done


_NEW_GEN = _Gen()


class _Transfer(NamedTuple):
    ticket: str
    gen: tuple[str, int]
    src: str
    src_blocks: tuple[int, ...]
    dst: str
    dst_blocks: tuple[int, ...]
    reading: bool = True
    writing: bool = True
    write_done: bool = False
    failed: bool = False
    lost: bool = False  # source or target worker restarted while in flight
    layers: tuple[int, int] | None = None  # [lo, hi) moved; None: every layer
    tokens: tuple[int, int] | None = None  # [lo, hi) prompt positions moved; None: whole blocks


class _Ticket(NamedTuple):
    gen: tuple[str, int]
    worker: str


# a record from a tuple of all its fields: cheaper than ``_replace`` on the hot paths
_new_transfer = partial(tuple.__new__, _Transfer)
_new_gen = partial(tuple.__new__, _Gen)


#: a worker's empty table of blocks (per-worker tables: read only)
_NO_BLOCKS: Mapping[int, Any] = {}
_NO_ITEMS: frozenset = frozenset()


def _fmt_gen(key: tuple[str, int]) -> str:
    return f"request {key[0]!r} gen {key[1]}"


def _blocks_text(blocks: Iterable[int]) -> str:
    return "[" + ", ".join(str(b) for b in blocks) + "]"


def _gens_text(keys: Iterable[tuple[str, int]]) -> str:
    return " and ".join(_fmt_gen(k) for k in sorted(keys))


def _range_text(r: tuple[int, int]) -> str:
    return f"[{r[0]}, {r[1]})"


def _coverage_gap(
    rects: list[tuple[tuple[int, int], tuple[int, int]]], layers: int, lo: int, hi: int
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The first (layers, positions) cell of ``[0, layers) x [lo, hi)`` that no
    rectangle ``(layer range, position range)`` covers, or None."""
    cuts = sorted({lo, hi} | {p for _, (a, b) in rects for p in (a, b) if lo < p < hi})
    for a, b in zip(cuts, cuts[1:]):
        spans = sorted(ls for ls, ts in rects if ts[0] <= a and ts[1] >= b)
        at = 0
        for l0, l1 in spans:
            if l0 > at:
                break
            at = max(at, l1)
        if at < layers:
            end = next((l0 for l0, _ in spans if l0 > at), layers)
            return (at, min(end, layers)), (a, b)
    return None


class Monitor:
    """An incremental checker of one history.

    >>> m = Monitor(policy="push")
    >>> m.feed(Submit("r1", 0, prompt_len=4))
    []

    :meth:`feed` takes one event (with its line number; by default the line
    after the previous one) and returns the violations it made certain;
    :attr:`violations` accumulates them; :meth:`finish` applies the
    end-of-history checks when the history is complete.  ``skip`` names
    invariants not to report.  :meth:`copy` and :meth:`key` let a search
    explore histories branching from a common prefix.
    """

    #: what each verdict table holds, as (kind of its keys, kind of its values),
    #: so that a renaming of ids reaches every table (see :meth:`renamed_key`;
    #: the kinds are those of ``_rename_functions``)
    _RENAME = {
        "_max_gen": ("id", "same"),
        "_gens": ("gen", "same"),
        "_owner": ("block", "gen"),  # blocks with exactly one owner
        "_shared": ("block", "gen-set"),  # blocks with two or more owners (through share)
        "_share_tokens": ("gen-worker", "same"),  # prefix positions a generation's shares hold there
        # a generation's block table on a worker (its shared blocks, then its
        # allocated ones), kept only when the block size is known (format 1.1)
        "_tables": ("gen-worker", "block-tuples"),
        "_quarantine": ("block", "same"),
        "_reading": ("block", "id-set"),
        "_writing": ("block", "id-set"),
        "_transfers": ("id", "transfer"),
        "_inflight": ("id", "same"),
        "_tickets": ("id", "ticket"),
        "_ticket_left": ("id", "same"),
        "_open_tickets": ("gen", "same"),
        "_block_ticket": ("block", "id"),
        "_ticket_transfers": ("id", "id-tuple"),
        "_commits": ("gen", "id"),
        "_incarnation": ("id", "same"),
        "_progress": ("gen", "same"),  # decodes so far, last position, last output
    }
    #: the tables of the verdict state, in the order key() lists them: one list,
    #: so that a table cannot be in the state without a renaming rule
    _VERDICT = tuple(_RENAME)
    #: the per-block tables every reserve, prefill, transfer and free touches
    #: block by block, kept per worker: ``{worker: {block: value}}`` (an int
    #: key per block instead of a ``(worker, block)`` tuple built, hashed and
    #: compared each time).  A worker's table may be left empty.  key() lists
    #: them flat, ``((worker, block), value)``, as it lists ``_quarantine`` and
    #: ``_shared`` (rare, kept flat), and with_key() takes that form back
    _PER_WORKER = ("_owner", "_reading", "_writing", "_block_ticket")
    #: the other verdict tables (flat), in _VERDICT order
    _FLAT = tuple(sorted(set(_VERDICT) - set(_PER_WORKER), key=_VERDICT.index))
    #: the flat tables and the per-worker ones, each at once; the parts of a
    #: key listed flat tables first back in _VERDICT order
    _GET_FLAT = attrgetter(*_FLAT)
    _GET_PER_WORKER = attrgetter(*_PER_WORKER)
    _KEY_ORDER = itemgetter(*map((_FLAT + _PER_WORKER).index, _VERDICT))
    _NESTED = tuple(map(_PER_WORKER.__contains__, _VERDICT))
    #: what the second part of a ``_lines`` key is, by its tag
    _LINE_TAGS = {
        "submit": "gen",
        "prefill_done": "gen",
        "commit": "gen",
        "decode": "gen",
        "end": "gen",
        # (tag, worker) -> {block: line}: one small table per worker, so that
        # the per-block bookkeeping of an event costs no tuple and no lookup
        # in one big table
        "alloc": "worker-blocks",
        "free": "worker-blocks",
        "restart": "id",
        "ticket": "id",
        "transfer": "id",
        "failed": "id",
    }
    #: the monitor of a partial history, :class:`~pdproto.spec.PartialMonitor`
    #: (set by :mod:`._partial`, which subclasses this one)
    _PARTIAL: ClassVar[type[Monitor] | None] = None
    __slots__ = (
        (
            "policy",
            "complete",
            "workers",
            "kv",
            "block_size",
            "boundary",
            "skip",
            "violations",
            "line",
            "events",
            "_out",
        )
        + _VERDICT
        + ("_lines",)  # witness bookkeeping, not part of key()
        # True while the per-worker tables of block lines in _lines may be
        # shared with a copy: the first write copies them (copy-on-write)
        + ("_lines_shared",)
    )

    def __init__(
        self,
        policy: str = "push",
        *,
        complete: bool = False,
        workers: Mapping[str, WorkerSpec] | None = None,
        skip: Iterable[str] = (),
        kv: KVSpec | None = None,
        block_size: int | None = None,
        boundary: str = "sampled",
    ) -> None:
        if policy not in POLICIES:
            raise UsageError("policy", policy, " or ".join(POLICIES))
        if boundary not in BOUNDARIES:
            raise UsageError("boundary", boundary, " or ".join(BOUNDARIES))
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise UsageError("block_size", block_size, "an integer >= 1, or None")
        self.policy = policy
        self.complete = complete
        # the first-token convention: "recompute" (vLLM's) moves the first
        # decode to position prompt_len - 1, which D computes itself
        self.boundary = boundary
        self.workers = dict(workers) if workers is not None else None
        self.kv = kv  # its layers make a commit's readiness cover every layer
        # tokens per block (format 1.1 only): positions become blocks of the
        # block table, so readiness, prefix hits and decode writes are checked
        # block by block
        self.block_size = (
            block_size if block_size is not None else (kv.block_size if kv is not None else None)
        )
        self.skip = check_invariant_ids(skip)
        self.violations: list[Violation] = []
        self.line = 0
        self.events = 0
        self._out: list[Violation] = []
        for name in self._VERDICT:
            setattr(self, name, {})
        self._lines: dict[tuple, Any] = {}
        self._lines_shared = False

    @classmethod
    def from_header(
        cls,
        header: HistoryHeader,
        *,
        policy: str | None = None,
        complete: bool | None = None,
        skip: Iterable[str] = (),
        observed: Any = None,
    ) -> Monitor:
        """A monitor set up as a history header says; ``policy`` and
        ``complete`` override it when given (``complete=True`` forces).  A
        version 1.1 header's block size (``kv.block_size``, else its
        ``block_size`` key) is used; version 1 is judged without it, as
        always.  A partial history (the header's ``observed``, or
        ``observed``, an :class:`~pdproto.spec.Observation`, which overrides
        it) gets a :class:`~pdproto.spec.PartialMonitor`."""
        if observed is not None or header.observed is not None:
            # PartialMonitor subclasses this one: it registers itself in
            # _PARTIAL when its module is imported (the spec package imports it)
            return Monitor._PARTIAL.from_header(  # type: ignore[union-attr]  # set by ._partial
                header, policy=policy, complete=complete, skip=skip, observed=observed
            )
        return cls(skip=skip, **cls._settings(header, policy, complete))

    @staticmethod
    def _settings(header: HistoryHeader, policy: str | None, complete: bool | None) -> dict[str, Any]:
        """The constructor's arguments (but ``skip``) a header gives, with
        the overrides of :meth:`from_header`."""
        return dict(
            policy=policy or header.policy,
            complete=header.complete or bool(complete),
            workers=header.workers,
            kv=header.kv,
            block_size=header.block_size if header.version != 1 else None,
            boundary=header.boundary,
        )

    # -- public -------------------------------------------------------------

    def feed(self, event: Event, line: int | None = None) -> list[Violation]:
        """Check one event; return the violations it made certain.  Anything
        but an event raises :class:`UsageError` and changes nothing."""
        handler = _DISPATCH.get(type(event))
        if handler is None:
            raise UsageError(
                "event", event, "one of the event classes " + ", ".join(cls.__name__ for cls in _DISPATCH)
            )
        self.line = self.line + 1 if line is None else line
        self.events += 1
        out = self._out = []
        handler(self, event, self.line)
        if out:
            self.violations.extend(out)
        return out

    def feed_all(self, events: Iterable[Event]) -> list[Violation]:
        """Feed several events (numbered on from the last line)."""
        found: list[Violation] = []
        for event in events:
            found.extend(self.feed(event))
        return found

    def finish(self) -> list[Violation]:
        """Apply the end-of-history checks (``leak``, ``stuck``) when the
        history is complete; return the violations they found."""
        out = self._out = []
        if self.complete:
            self._end_checks(self.line)
        self.violations.extend(out)
        return out

    def end_violations(self) -> list[Violation]:
        """What :meth:`finish` would report now, without recording it.  Useful
        to a search that treats a quiet state as the end of its history."""
        saved, self._out = self._out, []
        try:
            self._end_checks(self.line)
            return self._out
        finally:
            self._out = saved

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def requests(self) -> int:
        """How many distinct requests the history named so far."""
        return len({key[0] for key in self._gens})

    def _settings_copy(self) -> Monitor:
        """A new monitor with this one's settings, line and event counts, and
        no verdict tables or witness lines yet (a subclass adds its own state)."""
        new = type(self).__new__(type(self))
        new.policy = self.policy
        new.complete = self.complete
        new.workers = self.workers
        new.kv = self.kv
        new.block_size = self.block_size
        new.boundary = self.boundary
        new.skip = self.skip
        new.line = self.line
        new.events = self.events
        new._out = []
        return new

    def copy(self) -> Monitor:
        """An independent monitor in the same state."""
        new = self._settings_copy()
        new.violations = list(self.violations)
        for name, table in zip(self._FLAT, self._GET_FLAT(self)):
            setattr(new, name, table.copy())
        for name, table in zip(self._PER_WORKER, self._GET_PER_WORKER(self)):
            mine = {}
            for w, t in table.items():
                if t:  # (an empty worker table goes)
                    mine[w] = t.copy()
            setattr(new, name, mine)
        # the per-worker tables of block lines are shared until either writes
        new._lines = dict(self._lines)
        self._lines_shared = new._lines_shared = True
        return new

    def key(self) -> tuple:
        """The verdict state as a hashable value: two monitors with equal keys
        report the same violations for every continuation (up to line
        numbers)."""
        parts = list(map(frozenset, map(dict.items, self._GET_FLAT(self))))
        for table in self._GET_PER_WORKER(self):
            if not table:
                parts.append(_NO_ITEMS)
                continue
            items = []
            for w, t in table.items():  # ((worker, block), value) pairs
                for b, v in t.items():
                    items.append(((w, b), v))
            parts.append(frozenset(items))
        return self._KEY_ORDER(parts)

    def with_key(self, key: tuple) -> Monitor:
        """A monitor with this one's settings (policy, completeness, pools,
        skipped invariants), line and event counts, in the verdict state
        ``key`` (a :meth:`key` value); no violations and no witness lines."""
        new = self._settings_copy()
        new.violations = []
        new._lines = {}
        new._lines_shared = False
        for name, items, nested in zip(self._VERDICT, key, self._NESTED):
            if nested:
                table: dict = {}
                for (w, b), v in items:
                    t = table.get(w)
                    if t is None:
                        t = table[w] = {}
                    t[b] = v
                setattr(new, name, table)
            else:
                setattr(new, name, dict(items))
        return new

    @classmethod
    def from_key(
        cls,
        key: tuple,
        policy: str = "push",
        *,
        complete: bool = False,
        workers: Mapping[str, WorkerSpec] | None = None,
        skip: Iterable[str] = (),
        kv: KVSpec | None = None,
        block_size: int | None = None,
        boundary: str = "sampled",
    ) -> Monitor:
        """A new monitor (set up as :class:`Monitor` is) in the verdict state
        ``key``, a :meth:`key` value."""
        return cls(
            policy,
            complete=complete,
            workers=workers,
            skip=skip,
            kv=kv,
            block_size=block_size,
            boundary=boundary,
        ).with_key(key)

    @classmethod
    def renamed_key(
        cls, key: tuple, names: Any, blocks: Mapping[tuple[str, int], int] | None = None
    ) -> tuple:
        """Apply a renaming of ids to a :meth:`key` value: the result is the
        key of a monitor fed the renamed events.

        ``names`` maps old to new request ids, ticket ids, transfer ids and
        worker names; ``blocks`` maps ``(worker, block)`` (the old worker
        name) to the new block id.  Ids not mentioned keep their name.  In
        place of the two mappings, ``names`` may be one object with
        ``.names`` and ``.blocks`` (a :class:`pdproto.Renaming`)."""
        f = _rename_functions(*_mappings(names, blocks))
        out = []
        for name, items in zip(cls._VERDICT, key):
            if items:
                fk, fv = (f[kind] for kind in cls._RENAME[name])
                items = frozenset((fk(k), fv(v)) for k, v in items)
            out.append(items)
        return tuple(out)

    def renamed(self, names: Any, blocks: Mapping[tuple[str, int], int] | None = None) -> Monitor:
        """An independent monitor in this one's state with ids renamed (the
        arguments as for :meth:`renamed_key`): the monitor of the renamed
        history (its declared pools and witness lines included), with no
        violations yet."""
        names, blocks = _mappings(names, blocks)
        new = self.with_key(self.renamed_key(self.key(), names, blocks))
        f = _rename_functions(names, blocks)
        if self.workers is not None:
            new.workers = {f["id"](w): spec for w, spec in self.workers.items()}
        tags = self._LINE_TAGS
        new._lines = {}
        for (tag, x), line in self._lines.items():
            if tags[tag] == "worker-blocks":  # x: a worker; line: its blocks' lines
                new._lines[(tag, f["id"](x))] = {blocks.get((x, b), b): n for b, n in line.items()}
            else:
                new._lines[(tag, f[tags[tag]](x))] = line
        return new

    # -- helpers ------------------------------------------------------------

    def _report(
        self, invariant: str, line: int, message: str, witness: Iterable[int | None] = (), **data: Any
    ) -> None:
        if invariant in self.skip:
            return
        if invariant in END_INVARIANTS:
            lines = tuple(sorted({w for w in witness if w is not None}))
        else:
            lines = tuple(sorted({w for w in witness if w is not None and w != line}))
        self._out.append(Violation(invariant, line, message, lines, **data))

    def _block_line(self, tag: str, wb: tuple[str, int]) -> int | None:
        """The line of the last ``tag`` (alloc or free) of block ``wb``."""
        per_block = self._lines.get((tag, wb[0]))
        return None if per_block is None else per_block.get(wb[1])

    def _block_lines(self, tag: str, worker: str) -> dict[int, int]:
        """The table of ``tag`` (alloc or free) lines of ``worker``'s blocks,
        to write into."""
        if self._lines_shared:  # copy-on-write: this monitor's own tables from now on
            self._lines = {k: v.copy() if type(v) is dict else v for k, v in self._lines.items()}
            self._lines_shared = False
        per_block = self._lines.get((tag, worker))
        if per_block is None:
            per_block = self._lines[(tag, worker)] = {}
        return per_block

    def _gen(self, key: tuple[str, int]) -> _Gen:
        return self._gens.get(key, _NEW_GEN)

    def _check_live(self, event: Event, key: tuple[str, int], line: int, resurrect: bool = True) -> None:
        """resurrection and stale-generation for an event of generation ``key``."""
        if resurrect and self._gens.get(key, _NEW_GEN).terminal:
            self._report(
                "resurrection",
                line,
                f"{event.EV} for {_fmt_gen(key)}, which already ended",
                [self._lines.get(("end", key))],
                request=key[0],
                gen=key[1],
            )
        latest = self._max_gen.get(key[0], -1)
        if latest > key[1]:
            self._report(
                "stale-generation",
                line,
                f"{event.EV} for {_fmt_gen(key)} after gen {latest} of that request was submitted",
                [self._lines.get(("submit", (key[0], latest)))],
                request=key[0],
                gen=key[1],
            )

    def _capacity(self, event: Event, worker: str, blocks: tuple[int, ...], line: int) -> tuple[int, ...]:
        """Report blocks outside a declared pool; return the blocks inside it."""
        if self.workers is None or not blocks:
            return blocks
        spec = self.workers.get(worker)
        if spec is None or max(blocks) < spec.blocks:
            return blocks
        size = spec.blocks
        bad = [b for b in blocks if b >= size]
        self._report(
            "capacity",
            line,
            f"{event.EV} names block(s) {_blocks_text(bad)} on {worker!r}, whose declared pool "
            f"has blocks [0, {size})",
            [1],
            worker=worker,
            block=bad[0],
        )
        return tuple(b for b in blocks if b < size)

    def _take_quarantined(self, event: Event, key: tuple[str, int], wb: tuple[str, int], line: int) -> None:
        worker, b = wb
        writers = self._writing.get(worker, _NO_BLOCKS).get(b, ())
        self._report(
            "early-target-reuse",
            line,
            f"{event.EV} of {_fmt_gen(key)} takes block {b} on {worker!r}, quarantined "
            f"since the restart: transfer(s) {', '.join(map(repr, sorted(writers)))} "
            f"can still write into it",
            [self._lines.get(("restart", worker))] + [self._lines.get(("transfer", t)) for t in writers],
            request=key[0],
            gen=key[1],
            worker=worker,
            block=b,
        )
        del self._quarantine[wb]

    def _double_allocation(
        self, event: Event, key: tuple[str, int], wb: tuple[str, int], why: str, line: int
    ) -> None:
        worker, b = wb
        self._report(
            "double-allocation",
            line,
            f"{event.EV} of {_fmt_gen(key)} takes block {b} on {worker!r}, {why}",
            [self._block_line("alloc", wb)],
            request=key[0],
            gen=key[1],
            worker=worker,
            block=b,
        )

    def _allocate(
        self, event: Event, key: tuple[str, int], worker: str, blocks: tuple[int, ...], line: int
    ) -> None:
        shared = self._shared
        inside = self._capacity(event, worker, blocks, line)
        if not inside:
            if self.block_size is not None:
                self._extend_table(key, worker, blocks, own=True)
            return
        lines = self._block_lines("alloc", worker)
        owner = self._per_worker(self._owner, worker)
        if not self._quarantine and not shared and len(set(inside)) == len(inside):
            # the common case (no quarantined or shared block, distinct
            # blocks): what the loop below does, with one owner lookup per
            # block.  ``key`` is this event's own tuple, so a block owned
            # before (by anyone) returns another object
            setdefault = owner.setdefault
            for b in inside:
                held = setdefault(b, key)
                if held is not key:
                    self._retake(event, key, (worker, b), f"already owned by {_fmt_gen(held)}", line)
                lines[b] = line
        else:
            for b in inside:
                wb = (worker, b)
                if wb in self._quarantine:
                    self._take_quarantined(event, key, wb, line)
                elif shared and wb in shared:
                    self._retake(event, key, wb, f"already shared by {_gens_text(shared.pop(wb))}", line)
                elif b in owner:
                    self._retake(event, key, wb, f"already owned by {_fmt_gen(owner[b])}", line)
                owner[b] = key
                lines[b] = line
        if self.block_size is not None:
            self._extend_table(key, worker, blocks, own=True)

    def _retake(self, event: Event, key: tuple[str, int], wb: tuple[str, int], why: str, line: int) -> None:
        """An allocation of ``key`` takes block ``wb``, which it should not:
        report it, and the block leaves its ticket; the caller makes ``key``
        its owner."""
        self._double_allocation(event, key, wb, why, line)
        self._release_ticket_block(wb)
        self._per_worker(self._owner, wb[0])[wb[1]] = key

    def _extend_table(self, key: tuple[str, int], worker: str, blocks: tuple[int, ...], own: bool) -> None:
        """Append ``blocks`` to the generation's shared (``own=False``) or
        allocated part of its block table on ``worker``."""
        shared, mine = self._tables.get((key, worker), ((), ()))
        wbs = tuple((worker, b) for b in blocks)
        self._tables[(key, worker)] = (shared, mine + wbs) if own else (shared + wbs, mine)

    def _table(self, key: tuple[str, int], worker: str) -> tuple[int, ...]:
        """The generation's block table on ``worker``, as block ids."""
        shared, mine = self._tables.get((key, worker), ((), ()))
        return tuple(b for _, b in shared + mine)

    @staticmethod
    def _per_worker(table: dict, worker: str) -> dict:
        """``worker``'s table in the per-worker ``table`` (see _PER_WORKER), to write into."""
        t = table.get(worker)
        if t is None:
            t = table[worker] = {}
        return t

    def _release_ticket_block(self, wb: tuple[str, int]) -> None:
        t = self._block_ticket.get(wb[0])
        ticket = t.pop(wb[1], None) if t else None
        if ticket is not None:
            self._release_ticket(ticket, 1)

    def _release_ticket(self, ticket: str, n: int) -> None:
        """``n`` of the ticket's blocks left it; the last one closes it."""
        left = self._ticket_left.get(ticket, 0) - n
        if left > 0:
            self._ticket_left[ticket] = left
        else:
            self._close_ticket(ticket)

    def _close_ticket(self, ticket: str) -> None:
        if self._ticket_left.pop(ticket, None) is None:
            return
        key = self._tickets[ticket].gen
        n = self._open_tickets.get(key, 0) - 1
        if n > 0:
            self._open_tickets[key] = n
        else:
            self._open_tickets.pop(key, None)

    def _ticket_check(self, event: Event, ticket: str, key: tuple[str, int], worker: str, line: int) -> None:
        info = self._tickets.get(ticket)
        if info is not None and info.gen == key and info.worker == worker:
            return  # the common case
        witness = [self._lines.get(("ticket", ticket))]
        data: dict[str, Any] = {}
        if info is None:
            why = f"names ticket {ticket!r}, which was never reserved"
            witness = []
        elif info.gen != key:
            why = f"names ticket {ticket!r}, which belongs to {_fmt_gen(info.gen)}"
        else:
            why = f"goes into {worker!r}, but ticket {ticket!r} reserved blocks on {info.worker!r}"
            data["worker"] = worker
        self._report(
            "ticket-mismatch",
            line,
            f"{event.EV} of {_fmt_gen(key)} {why}",
            witness,
            request=key[0],
            gen=key[1],
            ticket=ticket,
            **data,
        )

    def _owned_by(
        self, event: Event, key: tuple[str, int], worker: str, blocks: tuple[int, ...], role: str, line: int
    ) -> None:
        owner = self._owner.get(worker, _NO_BLOCKS)
        get = owner.get
        for b in blocks:
            if get(b) != key:
                break
        else:
            return  # the common case: all owned
        shared = self._shared
        for b in self._capacity(event, worker, blocks, line):
            wb = (worker, b)
            held = get(b)
            if held == key:
                continue
            holders = shared.get(wb) if shared else None
            if holders is not None and key in holders:
                if role != "writes":
                    continue
                why = f"which it shares with {_gens_text(holders - {key})}: a shared prefix is never written"
                witness = [self._block_line("alloc", wb)]
            elif holders is not None:
                why = f"which {_gens_text(holders)} share"
                witness = [self._block_line("alloc", wb)]
            elif held is None:
                why = "which is free"
                witness = [self._block_line("free", wb)]
            else:
                why = f"which {_fmt_gen(held)} owns"
                witness = [self._block_line("alloc", wb)]
            self._report(
                "foreign-block-access",
                line,
                f"{event.EV} of {_fmt_gen(key)} {role} block {b} on {worker!r}, {why}",
                witness,
                request=key[0],
                gen=key[1],
                worker=worker,
                block=b,
            )
            return  # one report per event and side is enough

    @staticmethod
    def _index_remove(index: dict, worker: str, blocks: tuple[int, ...], tid: str) -> None:
        """Drop ``tid`` from the index entries of ``blocks`` on ``worker`` (an
        entry left empty goes)."""
        index = index.get(worker)
        if not index:
            return
        pop = index.pop
        for b in blocks:
            tids = pop(b, None)
            if tids is None or (len(tids) == 1 and tid in tids):
                continue  # (the common case: ``tid`` alone used it)
            rest = tids - {tid}
            if rest:
                index[b] = rest

    def _stop(self, tid: str, t: _Transfer, reading: bool, writing: bool) -> None:
        """Mark transfer ``tid`` as no longer reading and/or writing."""
        if reading and t.reading:
            self._index_remove(self._reading, t.src, t.src_blocks, tid)
        if writing and t.writing:
            self._index_remove(self._writing, t.dst, t.dst_blocks, tid)
            quarantine = self._quarantine
            if quarantine:
                writers = self._writing.get(t.dst, _NO_BLOCKS)
                for b in t.dst_blocks:
                    wb = (t.dst, b)
                    if wb in quarantine and b not in writers:
                        del quarantine[wb]
        t = _new_transfer((*t[:6], t.reading and not reading, t.writing and not writing, *t[8:]))
        self._transfers[tid] = t
        if not (t.reading or t.writing):
            self._inflight.pop(tid, None)

    def _known_transfer(self, event: Event, line: int) -> _Transfer | None:
        tid = event.transfer  # type: ignore[attr-defined]
        t = self._transfers.get(tid)
        if t is None:
            self._report(
                "unknown-transfer",
                line,
                f"{event.EV} names transfer {tid!r}, which never started",
                transfer=tid,
            )
        return t

    # -- one handler per event kind ----------------------------------------

    def _on_submit(self, ev: Submit, line: int) -> None:
        key = (ev.request, ev.gen)
        latest = self._max_gen.get(ev.request)
        if latest is not None and ev.gen <= latest:
            self._report(
                "stale-generation",
                line,
                f"submit of {_fmt_gen(key)}, but gen {latest} of that request was already "
                f"submitted; a retry needs a greater gen",
                [self._lines.get(("submit", (ev.request, latest)))],
                request=ev.request,
                gen=ev.gen,
            )
        else:
            self._max_gen[ev.request] = ev.gen
        g = self._gen(key)
        self._gens[key] = _new_gen((True, g.terminal, ev.prompt_len, ev.max_new_tokens, *g[4:]))
        self._lines.setdefault(("submit", key), line)

    def _on_reserve(self, ev: Reserve, line: int) -> None:
        key = (ev.request, ev.gen)
        self._check_live(ev, key, line)
        if ev.ticket in self._tickets:
            self._report(
                "id-reuse",
                line,
                f"reserve for {_fmt_gen(key)} reuses ticket {ev.ticket!r}, first reserved for "
                f"{_fmt_gen(self._tickets[ev.ticket].gen)}",
                [self._lines.get(("ticket", ev.ticket))],
                request=ev.request,
                gen=ev.gen,
                ticket=ev.ticket,
            )
            self._close_ticket(ev.ticket)
        self._allocate(ev, key, ev.worker, ev.blocks, line)
        self._tickets[ev.ticket] = _Ticket(key, ev.worker)
        self._lines[("ticket", ev.ticket)] = line
        self._ticket_left[ev.ticket] = len(set(ev.blocks))
        self._open_tickets[key] = self._open_tickets.get(key, 0) + 1
        block_ticket, ticket = self._per_worker(self._block_ticket, ev.worker), ev.ticket
        for b in ev.blocks:
            block_ticket[b] = ticket

    def _on_prefill_start(self, ev: PrefillStart, line: int) -> None:
        key = (ev.request, ev.gen)
        self._check_live(ev, key, line)
        if self.policy == "push" and not self._open_tickets.get(key):
            self._report(
                "reserve-before-prefill",
                line,
                f"prefill_start of {_fmt_gen(key)} on {ev.worker!r} without an open D "
                f"reservation (policy push reserves first)",
                [self._lines.get(("submit", key))],
                request=ev.request,
                gen=ev.gen,
                worker=ev.worker,
            )
        self._allocate(ev, key, ev.worker, ev.blocks, line)

    def _on_prefill_done(self, ev: PrefillDone, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        cached = self._share_tokens.get((key, ev.worker), 0) if self._share_tokens else 0
        self._gens[key] = _new_gen((*g[:4], ev.first_token, ev.processed_len, cached))
        self._lines[("prefill_done", key)] = line

    def _on_alloc(self, ev: Alloc, line: int) -> None:
        key = (ev.request, ev.gen)
        self._check_live(ev, key, line)
        self._allocate(ev, key, ev.worker, ev.blocks, line)

    def _on_transfer_start(self, ev: TransferStart, line: int) -> None:
        key = (ev.request, ev.gen)
        tid = ev.transfer
        self._check_live(ev, key, line)
        if tid in self._transfers:
            self._report(
                "id-reuse",
                line,
                f"transfer_start for {_fmt_gen(key)} reuses transfer id {tid!r}, first used for "
                f"{_fmt_gen(self._transfers[tid].gen)}",
                [self._lines.get(("transfer", tid))],
                request=ev.request,
                gen=ev.gen,
                transfer=tid,
            )
            old = self._transfers[tid]
            self._stop(tid, old, True, True)
        self._ticket_check(ev, ev.ticket, key, ev.dst, line)
        self._owned_by(ev, key, ev.src, ev.src_blocks, "reads", line)
        self._owned_by(ev, key, ev.dst, ev.dst_blocks, "writes", line)
        t = _Transfer(
            ev.ticket, key, ev.src, ev.src_blocks, ev.dst, ev.dst_blocks, layers=ev.layers, tokens=ev.tokens
        )
        self._transfers[tid] = t
        self._inflight[tid] = True
        alone = frozenset((tid,))  # this event's own object: an earlier entry is another
        for index, worker, blocks in (
            (self._reading, ev.src, ev.src_blocks),
            (self._writing, ev.dst, ev.dst_blocks),
        ):
            if not blocks:
                continue
            index = self._per_worker(index, worker)
            setdefault = index.setdefault
            for b in blocks:
                tids = setdefault(b, alone)
                if tids is not alone:
                    index[b] = tids | alone
        self._ticket_transfers[ev.ticket] = self._ticket_transfers.get(ev.ticket, ()) + (tid,)
        self._lines[("transfer", tid)] = line

    def _on_transfer_read_done(self, ev: TransferReadDone, line: int) -> None:
        t = self._known_transfer(ev, line)
        if t is not None:
            self._stop(ev.transfer, t, True, False)

    def _on_transfer_write_done(self, ev: TransferWriteDone, line: int) -> None:
        t = self._known_transfer(ev, line)
        if t is not None and not t.failed:
            if t.writing:
                self._stop(ev.transfer, t, False, True)
                t = self._transfers[ev.transfer]
            self._transfers[ev.transfer] = _new_transfer((*t[:8], True, *t[9:]))

    def _on_transfer_failed(self, ev: TransferFailed, line: int) -> None:
        t = self._known_transfer(ev, line)
        if t is not None:
            self._stop(ev.transfer, t, True, True)
            t = self._transfers[ev.transfer]
            self._transfers[ev.transfer] = _new_transfer((*t[:9], True, *t[10:]))
            self._lines[("failed", ev.transfer)] = line

    def _on_transfer_abort(self, ev: TransferAbort, line: int) -> None:
        self._known_transfer(ev, line)  # an abort ends nothing by itself

    def _on_commit(self, ev: Commit, line: int) -> None:
        key = (ev.request, ev.gen)
        self._check_live(ev, key, line)
        if key in self._commits:
            self._report(
                "double-commit",
                line,
                f"second commit of {_fmt_gen(key)} (ticket {ev.ticket!r} on {ev.worker!r})",
                [self._lines.get(("commit", key))],
                request=ev.request,
                gen=ev.gen,
                ticket=ev.ticket,
            )
        self._ticket_check(ev, ev.ticket, key, ev.worker, line)
        tids = self._ticket_transfers.get(ev.ticket, ())
        ready = False
        landed: list[str] = []  # landed transfers that may cover only part of the KV
        for tid in tids:
            t = self._transfers[tid]
            if t.dst == ev.worker and t.write_done and not t.failed and not t.lost and t.src_blocks:
                # (a transfer that reads no source block moves no KV, whatever it names as targets)
                if t.layers is None and t.tokens is None and self.block_size is None:
                    ready = True  # version 1: a whole transfer moves everything
                    break
                landed.append(tid)
        gap = None
        if not ready and (landed or self._share_tokens or self.block_size is not None):
            gap = self._readiness_gap(key, ev.worker, tids, [self._transfers[tid] for tid in landed])
            ready = gap is None
        if not ready:
            if gap is not None and landed:
                layers, positions = gap
                why = (
                    f"the landed transfer(s) {', '.join(map(repr, landed))} miss layer(s) "
                    f"{_range_text(layers)} of prompt positions {_range_text(positions)}"
                )
                rest = [tid for tid in tids if tid not in landed]
                if rest:
                    why += "; transfer " + "; ".join(self._transfer_state(tid, ev.worker) for tid in rest)
            elif not tids:
                why = "no transfer of that ticket has started"
            else:
                why = "transfer " + "; ".join(self._transfer_state(tid, ev.worker) for tid in tids)
            self._report(
                "commit-before-ready",
                line,
                f"commit of {_fmt_gen(key)} on {ev.worker!r} under ticket {ev.ticket!r}, but {why}",
                [self._lines.get(("ticket", ev.ticket))] + [self._lines.get(("transfer", t)) for t in tids],
                request=ev.request,
                gen=ev.gen,
                ticket=ev.ticket,
                worker=ev.worker,
            )
        if key not in self._commits:
            self._commits[key] = ev.worker
            self._lines[("commit", key)] = line

    def _transfer_state(self, tid: str, worker: str) -> str:
        """Why transfer ``tid`` does not make a commit on ``worker`` ready."""
        t = self._transfers[tid]
        if t.failed:
            return f"{tid!r} failed"
        if t.lost:
            return f"{tid!r} lost its source or target to a restart"
        if t.dst != worker:
            return f"{tid!r} writes into {t.dst!r}"
        if t.write_done and not t.src_blocks:
            return f"{tid!r} read no source block"
        return f"{tid!r} has not finished writing"

    def _readiness_gap(
        self, key: tuple[str, int], worker: str, tids: tuple[str, ...], landed: list[_Transfer]
    ) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """What the landed ranged transfers ``landed`` of a commit of ``key`` on
        ``worker`` leave uncovered: the first (layers, positions) cell of the
        KV the commit needs, or None when they cover it.  The commit needs
        every layer (the header's ``kv.layers``, else as many as the ticket's
        transfers name) of the prompt positions after the prefix the
        generation's shares hold there (up to the furthest position a
        transfer names when the prompt length is unknown)."""
        start = self._share_tokens.get((key, worker), 0) if self._share_tokens else 0
        mine = [t for t in map(self._transfers.__getitem__, tids) if t.dst == worker]
        layers = self.kv.layers if self.kv is not None else None
        if layers is None:
            layers = max([t.layers[1] for t in mine if t.layers is not None], default=1)
        end = self._gen(key).prompt_len
        if end is not None and self.boundary == "recompute":
            end -= 1  # D computes the last prompt position itself
            if end <= start:
                return None
        if end is None:
            end = max([t.tokens[1] for t in mine if t.tokens is not None], default=start + 1)
            if not landed:
                return (0, layers), (start, end)  # nothing landed and nothing is known to be shared
        if start > 0 and start >= end:
            return None  # a prefix-cache hit of the whole prompt: nothing to move
        if not landed:
            return (0, layers), (start, end)
        everything = (0, max(layers, end, 1))
        bs = self.block_size
        table = self._table(key, worker) if bs is not None else ()
        rects = []
        for t in landed:
            if t.tokens is None and bs is not None:
                # whole blocks: the positions of the table entries it wrote
                for b in t.dst_blocks:
                    if b in table:
                        i = table.index(b)
                        rects.append((t.layers or everything, (i * bs, (i + 1) * bs)))
            else:
                rects.append((t.layers or everything, t.tokens or everything))
        return _coverage_gap(rects, layers, start, end)

    def _on_decode(self, ev: Decode, line: int) -> None:
        key = (ev.request, ev.gen)
        self._check_live(ev, key, line)
        if self._commits.get(key) != ev.worker:
            where = self._commits.get(key)
            self._report(
                "decode-before-commit",
                line,
                f"decode of {_fmt_gen(key)} on {ev.worker!r} at position {ev.position}, "
                + ("which never committed" if where is None else f"which committed on {where!r}, not here"),
                [self._lines.get(("commit", key))],
                request=ev.request,
                gen=ev.gen,
                worker=ev.worker,
            )
        self._owned_by(ev, key, ev.worker, ev.blocks, "reads", line)
        if self.block_size is not None and self._shared:
            self._decode_write(ev, key, line)
        g = self._gens.get(key, _NEW_GEN)
        progress = self._progress.get(key)
        if progress is None:
            self._first_decode(ev, key, g, line)
            self._progress[key] = (1, ev.position, ev.output_token)
        else:
            self._next_decode(ev, key, g, progress, line)
            self._progress[key] = (progress[0] + 1, ev.position, ev.output_token)
        self._lines[("decode", key)] = line

    def _decode_write(self, ev: Decode, key: tuple[str, int], line: int) -> None:
        """A decode writes the KV of its position into the block that holds
        it: never into a block another generation shares."""
        i = ev.position // self.block_size  # type: ignore[operator]
        if i >= len(ev.blocks):
            return
        wb = (ev.worker, ev.blocks[i])
        holders = self._shared.get(wb)
        if holders is None:
            return
        others = holders - {key}
        self._report(
            "foreign-block-access",
            line,
            f"decode of {_fmt_gen(key)} on {ev.worker!r} writes position {ev.position} into block "
            f"{wb[1]}, which {_gens_text(others)} share{'s' if len(others) == 1 else ''}: a shared "
            f"prefix is never written",
            [self._block_line("alloc", wb)],
            request=ev.request,
            gen=ev.gen,
            worker=ev.worker,
            block=wb[1],
        )

    def _first_decode(self, ev: Decode, key: tuple[str, int], g: _Gen, line: int) -> None:
        witness = [self._lines.get(("prefill_done", key)), self._lines.get(("submit", key))]
        problem = None
        recompute = self.boundary == "recompute"
        back = 1 if recompute else 0  # recompute: D first feeds the last prompt token, at prompt_len - 1
        if g.first_token is None:
            problem = "no prefill_done recorded the first token"
        elif g.cached:
            problem = self._cached_boundary(ev, g, back)
        elif ev.position != g.processed_len - back:
            problem = f"position {ev.position}, but prefill processed {g.processed_len} tokens: the " + (
                f"last prompt token is recomputed at position {g.processed_len - 1} (boundary recompute)"
                if recompute
                else f"first token goes at position {g.processed_len}"
            )
        elif g.prompt_len is not None and g.processed_len != g.prompt_len:
            problem = f"prefill processed {g.processed_len} tokens of a {g.prompt_len}-token prompt"
        # recompute: the input is the last prompt token, which no event records; P's sampled
        # token is discarded, so there is nothing to compare it with
        if problem is None and not recompute and ev.input_token != g.first_token:
            problem = f"input_token {ev.input_token}, but prefill sampled first token {g.first_token}"
        if problem is not None:
            self._report(
                "first-token-boundary",
                line,
                f"first decode of {_fmt_gen(key)} on {ev.worker!r}: {problem}",
                witness,
                request=ev.request,
                gen=ev.gen,
                worker=ev.worker,
            )
        self._check_budget(ev, key, g, 0, line)

    @staticmethod
    def _cached_boundary(ev: Decode, g: _Gen, back: int) -> str | None:
        """first-token-boundary after a prefix-cache hit of ``g.cached`` positions
        on the prefill worker: prefill processed either the whole prompt or the
        rest after the cached prefix, and the first token goes where the prompt
        ends (``back`` = 1: the last prompt token goes one position earlier;
        the caller checks the token it feeds, as without a hit)."""
        processed, cached = g.processed_len, g.cached
        assert processed is not None
        ends = {processed, processed + cached}
        if g.prompt_len is not None:
            if g.prompt_len not in ends:
                return (
                    f"prefill processed {processed} tokens after a cached prefix of {cached}, but the "
                    f"prompt has {g.prompt_len} tokens"
                )
            ends = {g.prompt_len}
        if ev.position + back not in ends:
            end = " or ".join(str(e) for e in sorted(ends))
            at = " or ".join(str(e - back) for e in sorted(ends))
            what = "the last prompt token is recomputed" if back else "the first token goes"
            return (
                f"position {ev.position}, but the prompt ends at {end} (prefill processed {processed} "
                f"tokens after a cached prefix of {cached}): {what} at position {at}"
            )
        return None

    def _next_decode(
        self, ev: Decode, key: tuple[str, int], g: _Gen, progress: tuple[int, int, int], line: int
    ) -> None:
        decodes, last_pos, last_out = progress
        problem = None
        if ev.position != last_pos + 1:
            problem = f"position {ev.position} after position {last_pos}"
        elif ev.input_token != last_out:
            problem = f"input_token {ev.input_token}, but the previous step produced {last_out}"
        if problem is not None:
            self._report(
                "decode-continuity",
                line,
                f"decode of {_fmt_gen(key)} on {ev.worker!r}: {problem}",
                [self._lines.get(("decode", key))],
                request=ev.request,
                gen=ev.gen,
                worker=ev.worker,
            )
        else:
            self._check_budget(ev, key, g, decodes, line)

    def _check_budget(self, ev: Decode, key: tuple[str, int], g: _Gen, decodes: int, line: int) -> None:
        # the first token (sampled: P's; recompute: P's is discarded), the
        # earlier decodes' outputs and this one's
        produced = decodes + (1 if self.boundary == "recompute" else 2)
        if g.max_new is not None and produced > g.max_new:
            self._report(
                "decode-continuity",
                line,
                f"decode of {_fmt_gen(key)} produces token {produced} of at most max_new_tokens={g.max_new}",
                [self._lines.get(("submit", key))],
                request=ev.request,
                gen=ev.gen,
                worker=ev.worker,
            )

    def _on_end(self, ev: Finish | Cancel | Fail, line: int) -> None:
        key = (ev.request, ev.gen)
        if type(ev) is Finish:
            self._check_live(ev, key, line, resurrect=False)
        g = self._gen(key)
        if not g.terminal:
            self._gens[key] = _new_gen((g.submitted, True, *g[2:]))
            self._lines[("end", key)] = line

    def _bad_free(self, ev: Free, line: int, block: int, message: str, witness: int | None) -> None:
        self._report(
            "bad-free",
            line,
            message,
            [witness],
            worker=ev.worker,
            block=block,
            request=ev.request,
            gen=ev.gen,
        )

    def _on_free(self, ev: Free, line: int) -> None:
        worker = ev.worker
        lines = self._lines
        early_read: dict[tuple, list[int]] = {}
        early_write: dict[tuple, list[int]] = {}
        shared = self._shared
        # this worker's tables of the blocks' readers, writers and tickets
        # (None: it has none; nothing in the loop adds any)
        reading = self._reading.get(worker) or None
        writing = self._writing.get(worker) or None
        # each block's ticket is released at the end, once per ticket with the
        # count of its blocks freed here (what one release per block comes to:
        # nothing in between reads a ticket's count)
        block_ticket = self._block_ticket.get(worker)
        bt_pop = block_ticket.pop if block_ticket else None
        released: dict[str, int] | None = None
        request, gen = ev.request, ev.gen
        named_key = (request, gen)  # the owner a free naming its generation expects (the common case)
        free_lines = None
        pop = self._per_worker(self._owner, worker).pop  # (_free_shared may give a block back to it)
        for b in self._capacity(ev, worker, ev.blocks, line):
            held = pop(b, None)  # (released below whatever the checks find)
            if held is None:
                wb = (worker, b)
                if shared and wb in shared:
                    held = self._free_shared(ev, wb, line)
                    if held is None:
                        continue  # other owners still hold it, or a bad free changed nothing
                else:
                    why = "quarantined after a restart" if wb in self._quarantine else "not owned"
                    self._bad_free(
                        ev,
                        line,
                        b,
                        f"free of block {b} on {worker!r}, which is {why}",
                        self._block_line("free", wb),
                    )
                    continue
            if (
                held != named_key
                and request is not None
                and (held[0] != request or (gen is not None and held[1] != gen))
            ):
                named = request if gen is None else _fmt_gen((request, gen))
                self._bad_free(
                    ev,
                    line,
                    b,
                    f"free of block {b} on {worker!r} for {named}, but {_fmt_gen(held)} owns it",
                    self._block_line("alloc", (worker, b)),
                )
            if reading is not None:
                readers = reading.get(b)
                if readers:
                    early_read.setdefault((held, readers), []).append(b)
            if writing is not None:
                writers = writing.get(b)
                if writers:
                    early_write.setdefault((held, writers), []).append(b)
            if bt_pop is not None:
                ticket = bt_pop(b, None)
                if ticket is not None:
                    if released is None:
                        released = {ticket: 1}
                    else:
                        released[ticket] = released.get(ticket, 0) + 1
            if free_lines is None:
                free_lines = self._block_lines("free", worker)
            free_lines[b] = line
        if released is not None:
            for ticket, n in released.items():
                self._release_ticket(ticket, n)
        if not (early_read or early_write):
            return
        for invariant, found, verb in (
            ("early-source-free", early_read, "read"),
            ("early-target-reuse", early_write, "write into"),
        ):
            for (held, tids), blocks in found.items():
                self._report(
                    invariant,
                    line,
                    f"free of block(s) {_blocks_text(blocks)} on {worker!r} ({_fmt_gen(held)}) "
                    f"while transfer(s) {', '.join(map(repr, sorted(tids)))} can still {verb} them",
                    [lines.get(("transfer", t)) for t in tids],
                    worker=worker,
                    block=blocks[0],
                    request=held[0],
                    gen=held[1],
                    transfer=min(tids),
                )

    def _free_shared(self, ev: Free, wb: tuple[str, int], line: int) -> tuple[str, int] | None:
        """Drop the references a free names on the shared block ``wb``.  Returns
        the generation to name when the block returns to the pool (then the
        caller releases it), else None."""
        worker, b = wb
        holders = self._shared[wb]
        if ev.request is None:
            self._bad_free(
                ev,
                line,
                b,
                f"free of block {b} on {worker!r} names no generation, but "
                f"{_gens_text(holders)} share it: each owner frees its own reference",
                self._block_line("alloc", wb),
            )
            del self._shared[wb]
            return min(holders)
        mine = frozenset(k for k in holders if k[0] == ev.request and (ev.gen is None or k[1] == ev.gen))
        if not mine:
            named = ev.request if ev.gen is None else _fmt_gen((ev.request, ev.gen))
            self._bad_free(
                ev,
                line,
                b,
                f"free of block {b} on {worker!r} for {named}, but {_gens_text(holders)} share it",
                self._block_line("alloc", wb),
            )
            return None
        rest = holders - mine
        if not rest:
            del self._shared[wb]
            return min(mine)
        ticket = self._block_ticket.get(worker, _NO_BLOCKS).get(b)
        if ticket is not None and self._tickets[ticket].gen in mine:
            self._release_ticket_block(wb)
        if len(rest) == 1:
            del self._shared[wb]
            (self._per_worker(self._owner, worker)[b],) = rest
        else:
            self._shared[wb] = rest
        return None

    def _on_share(self, ev: Share, line: int) -> None:
        key = (ev.request, ev.gen)
        worker = ev.worker
        self._check_live(ev, key, line)
        owner = self._per_worker(self._owner, worker)
        shared = self._shared
        lines = self._lines
        writing_reported = False
        for b in self._capacity(ev, worker, ev.blocks, line):
            wb = (worker, b)
            if wb in self._quarantine:
                self._take_quarantined(ev, key, wb, line)
                owner[b] = key
                self._block_lines("alloc", worker)[b] = line
                continue
            held = owner.get(b)
            holders = shared.get(wb)
            if held == key or (holders is not None and key in holders):
                self._double_allocation(ev, key, wb, "which it already holds", line)
                continue
            writers = self._writing.get(worker, _NO_BLOCKS).get(b)
            if writers and not writing_reported:
                others = sorted(t for t in writers if self._transfers[t].gen != key)
                if others:
                    writing_reported = True  # one report per event is enough
                    self._report(
                        "foreign-block-access",
                        line,
                        f"share of {_fmt_gen(key)} takes block {b} on {worker!r}, which transfer(s) "
                        f"{', '.join(map(repr, others))} of "
                        f"{_gens_text({self._transfers[t].gen for t in others})} "
                        f"can still write into: a shared prefix is never written",
                        [lines.get(("transfer", t)) for t in others],
                        request=key[0],
                        gen=key[1],
                        worker=worker,
                        block=b,
                        transfer=others[0],
                    )
            if held is not None:
                del owner[b]
                shared[wb] = frozenset((held, key))
            elif holders is not None:
                shared[wb] = holders | {key}
            else:
                owner[b] = key  # a free block whose cached KV the share revives
            self._block_lines("alloc", worker)[b] = line
        tokens = ev.tokens
        if self.block_size is not None:
            self._extend_table(key, worker, ev.blocks, own=False)
            # a share holds what its blocks can hold, whatever it claims
            tokens = min(tokens, len(self._tables[(key, worker)][0]) * self.block_size)
        self._share_tokens[(key, worker)] = tokens

    def _on_restart(self, ev: Restart, line: int) -> None:
        worker = ev.worker
        self._incarnation[worker] = ev.incarnation
        self._lines[("restart", worker)] = line
        block_ticket = self._block_ticket.get(worker, {})
        writing = self._writing.get(worker, _NO_BLOCKS)
        shared = self._shared
        for b in [*self._owner.pop(worker, ()), *(wb[1] for wb in shared if wb[0] == worker)]:
            shared.pop((worker, b), None)
            block_ticket.pop(b, None)
            self._block_lines("free", worker)[b] = line
            if b in writing:
                self._quarantine[(worker, b)] = True
        for gw in [gw for gw in self._share_tokens if gw[1] == worker]:
            del self._share_tokens[gw]
        for gw in [gw for gw in self._tables if gw[1] == worker]:
            del self._tables[gw]
        for ticket in [t for t in self._ticket_left if self._tickets[t].worker == worker]:
            self._close_ticket(ticket)
        for tid in list(self._inflight):
            t = self._transfers[tid]
            if (t.src == worker and t.reading) or (t.dst == worker and t.writing):
                if t.src == worker:
                    self._stop(tid, t, True, False)  # its source memory is gone
                    t = self._transfers[tid]
                self._transfers[tid] = t._replace(lost=True)

    # -- end of history -----------------------------------------------------

    def _end_checks(self, line: int) -> None:
        lines = self._lines
        held: dict[tuple[tuple[str, int], str], list[int]] = {}
        for worker, owner in self._owner.items():
            for b, key in owner.items():
                if self._gens.get(key, _NEW_GEN).terminal:
                    held.setdefault((key, worker), []).append(b)
        for (worker, b), keys in self._shared.items():
            for key in keys:
                if self._gens.get(key, _NEW_GEN).terminal:
                    held.setdefault((key, worker), []).append(b)
        for (key, worker), blocks in sorted(held.items()):
            blocks.sort()
            self._report(
                "leak",
                line,
                f"{_fmt_gen(key)} ended but still owns block(s) {_blocks_text(blocks)} on {worker!r}",
                [self._block_line("alloc", (worker, b)) for b in blocks] + [lines.get(("end", key))],
                request=key[0],
                gen=key[1],
                worker=worker,
                block=blocks[0],
            )
        for tid in sorted(self._inflight):
            t = self._transfers[tid]
            doing = " and ".join(w for w, on in (("reading", t.reading), ("writing", t.writing)) if on)
            self._report(
                "leak",
                line,
                f"transfer {tid!r} of {_fmt_gen(t.gen)} ({t.src!r} -> {t.dst!r}) is still "
                f"{doing} at the end of the history",
                [lines.get(("transfer", tid))],
                request=t.gen[0],
                gen=t.gen[1],
                transfer=tid,
            )
        for key, g in sorted(self._gens.items()):
            if g.submitted and not g.terminal:
                self._report(
                    "stuck",
                    line,
                    f"{_fmt_gen(key)} never finished, was cancelled or failed",
                    [lines.get(("submit", key))],
                    request=key[0],
                    gen=key[1],
                )


def _mappings(names: Any, blocks: Mapping | None) -> tuple[Mapping, Mapping]:
    """(names, blocks) from two mappings or from one renaming object."""
    if blocks is None and hasattr(names, "names") and hasattr(names, "blocks"):
        return names.names, names.blocks
    return names, ({} if blocks is None else blocks)


def _rename_functions(names: Mapping[str, str], blocks: Mapping[tuple[str, int], int]) -> dict[str, Callable]:
    """One function per kind of value the monitor stores, applying a renaming."""

    def rn(s: str) -> str:  # a request, ticket, transfer or worker id
        return names.get(s, s)

    def gk(k: tuple[str, int]) -> tuple[str, int]:  # (request, gen)
        return (names.get(k[0], k[0]), k[1])

    def wb(k: tuple[str, int]) -> tuple[str, int]:  # (worker, block)
        return (names.get(k[0], k[0]), blocks.get(k, k[1]))

    def bl(worker: str, bs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(blocks.get((worker, b), b) for b in bs)

    def transfer(t: _Transfer) -> _Transfer:
        return t._replace(
            ticket=rn(t.ticket),
            gen=gk(t.gen),
            src=rn(t.src),
            src_blocks=bl(t.src, t.src_blocks),
            dst=rn(t.dst),
            dst_blocks=bl(t.dst, t.dst_blocks),
        )

    return {
        "same": lambda v: v,
        "id": rn,
        "gen": gk,
        "block": wb,
        "id-set": lambda v: frozenset(map(rn, v)),
        "id-tuple": lambda v: tuple(map(rn, v)),
        "gen-set": lambda v: frozenset(map(gk, v)),
        "gen-worker": lambda k: (gk(k[0]), rn(k[1])),
        "block-tuples": lambda v: tuple(tuple(map(wb, part)) for part in v),
        "transfer": transfer,
        "ticket": lambda t: t._replace(gen=gk(t.gen), worker=rn(t.worker)),
    }


_DISPATCH: dict[type, Callable[[Monitor, Any, int], None]] = {
    Submit: Monitor._on_submit,
    Reserve: Monitor._on_reserve,
    PrefillStart: Monitor._on_prefill_start,
    PrefillDone: Monitor._on_prefill_done,
    Alloc: Monitor._on_alloc,
    TransferStart: Monitor._on_transfer_start,
    TransferReadDone: Monitor._on_transfer_read_done,
    TransferWriteDone: Monitor._on_transfer_write_done,
    TransferFailed: Monitor._on_transfer_failed,
    TransferAbort: Monitor._on_transfer_abort,
    Commit: Monitor._on_commit,
    Decode: Monitor._on_decode,
    Finish: Monitor._on_end,
    Cancel: Monitor._on_end,
    Fail: Monitor._on_end,
    Free: Monitor._on_free,
    Restart: Monitor._on_restart,
    Share: Monitor._on_share,
}
