"""The explicit-state explorer: breadth-first search over the product of a
model's state and the monitor's verdict state.

Any object following :class:`pdproto.Model` can be explored: the explorer
asks for the initial states, the enabled actions of a state (in a fixed
order), and the next state plus the history events of each action.  Every
event is fed to a :class:`~pdproto.Monitor`; the search key is the pair
(model state, monitor verdict state), so two paths reaching the same model
state with different histories are both explored, and every counterexample
found is a shortest one (breadth-first order).

Soundness of symmetry reduction (see docs/modeling.md):

- ``model.canonical_product(state, monitor_key)`` (optional) returns the
  search key of the whole product; the model must apply *one* renaming to
  both halves.
- ``model.symmetry(state) -> (canonical_state, Renaming)`` (optional): the
  model says which renaming of its ids maps ``state`` to its canonical form;
  the explorer applies the same renaming to the monitor's verdict state
  (:func:`rename_monitor_key`).  Two product states get the same key only if
  one renaming maps one onto the other, so the reduction is sound whenever
  the model and the monitor treat the renamed ids alike (the monitor does:
  it never compares ids except for equality, and block ids only against the
  pool size).
- ``model.canonical(state)`` alone is paired with the *concrete* monitor
  key.  That is sound only when the model state determines the monitor's
  verdict state (every fact the monitor tracks is also in the model state),
  and it reduces little, since symmetric states usually have renamed monitor
  states.  Prefer ``symmetry``.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from array import array
from collections import deque
from typing import Any, Callable, Hashable, Mapping, Sequence

import attrs

from .._errors import UsageError
from ..spec._events import Event
from ..spec._history import HistoryHeader
from ..protocol._model import Renaming
from ..spec._monitor import Monitor, Violation

__all__ = [
    "Step",
    "Counterexample",
    "ExploreResult",
    "Renaming",
    "explore",
    "replay",
    "rename_monitor_key",
]


# ---------------------------------------------------------------------------
# results


@attrs.frozen
class Step:
    """One step of a trace: ``index`` counts from 1; ``action`` is the model's
    :class:`~pdproto.Action` (or the index of the initial state for step 0 when
    a model has several); ``events`` what it emitted."""

    index: int
    actor: str
    action: Any
    events: tuple[Event, ...]
    fault: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.index,
            "actor": self.actor,
            "action": str(self.action),
            "fault": self.fault,
            "events": [ev.to_dict() for ev in self.events],
        }


@attrs.frozen
class Counterexample:
    """A shortest trace to a bad state.

    ``invariant`` is a monitor invariant id (a safety violation, or ``leak``
    / ``stuck`` for a deadlock), ``deadlock`` for a quiet state the monitor
    does not object to (never produced today), or the name of a model state
    invariant.  ``violations`` are the monitor's findings on the trace written
    as a history (header on line 1, events from line 2), so their lines and
    witnesses match what ``pdproto audit`` says of the file written with
    :meth:`history_header`.  ``initial`` is the index of the initial state.
    """

    invariant: str
    message: str
    trace: tuple[Step, ...]
    kind: str = "violation"  # "violation", "deadlock" or "state-invariant"
    violations: tuple[Violation, ...] = ()
    initial: int = 0
    final_state: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def events(self) -> list[Event]:
        return [ev for step in self.trace for ev in step.events]

    @property
    def line(self) -> int | None:
        return self.violations[0].line if self.violations else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "invariant": self.invariant,
            "message": self.message,
            "kind": self.kind,
            "length": len(self.trace),
            "trace": [s.to_dict() for s in self.trace],
        }
        if self.violations:
            out["line"] = self.violations[0].line
            out["witness"] = list(self.violations[0].witness)
        return out


@attrs.frozen
class ExploreResult:
    """What a search found.  ``ok`` is true when there is no violation, no
    deadlock, no failed state invariant and (for a complete search) no unmet
    ``sometimes`` property.  ``complete`` is false when ``max_states`` cut the
    search short or it stopped at its first counterexample (then unmet
    ``sometimes`` properties do not count); ``truncated`` says ``max_states``
    was reached."""

    model: str
    states: int
    transitions: int
    depth: int
    seconds: float
    violations: tuple[Counterexample, ...]
    deadlocks: tuple[Counterexample, ...]
    invariant_failures: tuple[Counterexample, ...]
    unmet_sometimes: tuple[str, ...]
    met_sometimes: tuple[str, ...]
    complete: bool
    truncated: bool
    symmetry: str  # "off", "product", "renaming", "state-only", "none offered"
    fingerprint: bool
    bytes_per_state: float | None = None
    collision_probability: float | None = None
    monitor_states: int = 0
    memory: Mapping[str, int] | None = attrs.field(default=None, eq=False)
    graph: Any = attrs.field(default=None, eq=False, repr=False)
    header: HistoryHeader | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return not (
            self.violations
            or self.deadlocks
            or self.invariant_failures
            or (self.complete and self.unmet_sometimes)
        )

    @property
    def failures(self) -> tuple[Counterexample, ...]:
        """Every counterexample, safety violations first."""
        return self.violations + self.invariant_failures + self.deadlocks

    def to_dict(self) -> dict[str, Any]:
        sps = self.states_per_second
        return {
            "ok": self.ok,
            "model": self.model,
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "seconds": round(self.seconds, 4),
            "states_per_second": round(sps, 1) if math.isfinite(sps) else None,
            "violations": [c.to_dict() for c in self.violations + self.invariant_failures],
            "deadlocks": [c.to_dict() for c in self.deadlocks],
            "unmet_sometimes": list(self.unmet_sometimes) if self.complete else [],
            "met_sometimes": list(self.met_sometimes),
            "complete": self.complete,
            "truncated": self.truncated,
            "symmetry": self.symmetry,
            "fingerprint": self.fingerprint,
            "bytes_per_state": None if self.bytes_per_state is None else round(self.bytes_per_state, 1),
            "collision_probability": self.collision_probability,
            "monitor_states": self.monitor_states,
            "memory": dict(self.memory) if self.memory is not None else None,
        }


# ---------------------------------------------------------------------------
# symmetry: renaming the monitor's verdict state


def _renamers(names: Mapping[str, str], blocks: Mapping[tuple[str, int], int]) -> dict[str, Callable]:
    rn = lambda s: names.get(s, s)  # noqa: E731
    gk = lambda k: (names.get(k[0], k[0]), k[1])  # noqa: E731
    wb = lambda k: (names.get(k[0], k[0]), blocks.get(k, k[1]))  # noqa: E731

    def bl(worker: str, bs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(blocks.get((worker, b), b) for b in bs)

    def transfer(t: Any) -> Any:
        return t._replace(
            ticket=rn(t.ticket),
            gen=gk(t.gen),
            src=rn(t.src),
            src_blocks=bl(t.src, t.src_blocks),
            dst=rn(t.dst),
            dst_blocks=bl(t.dst, t.dst_blocks),
        )

    ident = lambda v: v  # noqa: E731
    tids = lambda v: frozenset(rn(x) for x in v)  # noqa: E731
    return {
        # field: (rename key, rename value)
        "_max_gen": (rn, ident),
        "_gens": (gk, ident),
        "_owner": (wb, gk),
        "_quarantine": (wb, ident),
        "_reading": (wb, tids),
        "_writing": (wb, tids),
        "_transfers": (rn, transfer),
        "_inflight": (rn, ident),
        "_tickets": (rn, lambda t: t._replace(gen=gk(t.gen), worker=rn(t.worker))),
        "_ticket_left": (rn, ident),
        "_open_tickets": (gk, ident),
        "_block_ticket": (wb, rn),
        "_ticket_transfers": (rn, lambda v: tuple(rn(x) for x in v)),
        "_commits": (gk, rn),
        "_incarnation": (rn, ident),
        "_progress": (gk, ident),  # decodes so far, last position, last output
    }


def rename_monitor_key(
    key: tuple, names: Mapping[str, str], blocks: Mapping[tuple[str, int], int] = {}
) -> tuple:
    """Apply a renaming of ids to a :meth:`Monitor.key` value: the key of a
    monitor fed the renamed events."""
    table = _renamers(names, blocks)
    missing = [n for n in Monitor._VERDICT if n not in table]
    if missing:  # pragma: no cover - guards against a monitor change
        raise RuntimeError(f"rename_monitor_key does not know monitor fields {missing}")
    out = []
    for name, items in zip(Monitor._VERDICT, key):
        if not items:
            out.append(items)
            continue
        fk, fv = table[name]
        out.append(frozenset((fk(k), fv(v)) for k, v in items))
    return tuple(out)


def _monitor_from_key(template: Monitor, key: tuple) -> Monitor:
    """A monitor in the verdict state ``key`` (no line bookkeeping)."""
    m = template.copy()
    for name, items in zip(Monitor._VERDICT, key):
        setattr(m, name, dict(items))
    return m


# ---------------------------------------------------------------------------
# the search


_BAD = object()  # marks a violating transition's target in the visited set
_PAIR = object()  # tags (state, monitor id) keys; a model state can never hold it


def _collision_probability(n: int) -> float:
    """Probability that some pair among ``n`` uniformly random 64-bit
    fingerprints collides (so that a state was wrongly taken as seen)."""
    return -math.expm1(-n * (n - 1) / 2.0 / 2.0**64)


class _FPSet:
    """An open-addressing set of nonzero 64-bit fingerprints in one
    ``array('q')``: 8 bytes a slot, at most 3/4 full."""

    __slots__ = ("table", "mask", "n", "limit")

    def __init__(self, capacity: int = 1 << 16) -> None:
        size = 1 << max(4, (capacity * 4 // 3).bit_length())
        self.table = array("q", bytes(8 * size))
        self.mask = size - 1
        self.n = 0
        self.limit = size * 3 // 4

    def add(self, fp: int) -> bool:
        """Add ``fp``; return True when it was new."""
        table = self.table
        mask = self.mask
        i = fp & mask
        while True:
            v = table[i]
            if v == 0:
                table[i] = fp
                self.n += 1
                if self.n > self.limit:
                    self._grow()
                return True
            if v == fp:
                return False
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = self.table
        size = len(old) * 2
        table = array("q", bytes(8 * size))
        mask = size - 1
        for v in old:
            if v:
                i = v & mask
                while table[i]:
                    i = (i + 1) & mask
                table[i] = v
        self.table = table
        self.mask = mask
        self.limit = size * 3 // 4

    def nbytes(self) -> int:
        return len(self.table) * 8


def _fingerprint(key: Hashable) -> int:
    fp = hash(key)  # 64-bit on 64-bit builds; never 0 below
    return fp if fp else 1


_MISS = object()


def _flat_type(cls: type) -> bool:
    """Whether states of type ``cls`` can be stored flat (their fields followed
    by the monitor id) and rebuilt: plain tuples and named tuples without an
    instance ``__dict__``."""
    if cls is tuple:
        return True
    return (
        issubclass(cls, tuple)
        and hasattr(cls, "_fields")
        and all("__slots__" in c.__dict__ for c in cls.__mro__[:-2])
    )


class _Interner:
    """Hash-consing of the fields of flat states, two levels deep.

    Neighbouring states share most of their parts (a request's sub-tuple, the
    budget, the list of messages), but a model's step builds fresh objects
    for them.  ``key(flat)`` returns an equal tuple whose fields are the first
    equal object of the same type seen at that position; a field that is
    itself a tuple has its tuple elements interned the same way (one table
    per element type).  A part is only ever replaced by an equal part of the
    same type, so a stored state is equal to the one the model produced (the
    visited set already identifies equal states).  A position whose values
    rarely repeat (a table past 64k entries holding more than half of its
    lookups) stops being interned: its table would cost more than it saves.
    """

    __slots__ = ("tables", "calls", "subs")

    def __init__(self) -> None:
        self.tables: list[dict | None] = []
        self.calls = 0
        self.subs: dict[type, dict] = {}

    def key(self, flat: tuple, tail: int = 2) -> tuple:
        tables = self.tables
        n = len(flat) - tail
        if len(tables) < n:
            tables.extend({} for _ in range(n - len(tables)))
        self.calls += 1
        out = list(flat)
        for i in range(n):
            d = tables[i]
            if d is None:
                continue
            v = out[i]
            r = d.get(v, _MISS)
            if r is not _MISS:
                if type(r) is type(v):
                    out[i] = r
                continue
            if isinstance(v, tuple) and v:
                v = self._sub(v)
                out[i] = v
            d[v] = v
            if len(d) > 65536 and 2 * len(d) > self.calls:
                tables[i] = None
        return tuple(out)

    def _sub(self, v: tuple) -> tuple:
        cls = type(v)
        if not _flat_type(cls):
            return v
        subs = self.subs
        changed = False
        elems = list(v)
        for j, x in enumerate(elems):
            if isinstance(x, tuple):
                tx = type(x)
                st = subs.get(tx)
                if st is None:
                    st = subs[tx] = {}
                r = st.setdefault(x, x)
                if r is not x:
                    elems[j] = r
                    changed = True
        if not changed:
            return v
        return tuple(elems) if cls is tuple else tuple.__new__(cls, elems)

    def nbytes(self) -> int:
        total = 0
        for d in self.tables:
            if d:
                total += sys.getsizeof(d) + sum(map(sys.getsizeof, d))
        for d in self.subs.values():
            total += sys.getsizeof(d) + sum(map(sys.getsizeof, d))
        return total


def _deep_size(obj: Any, seen: set[int]) -> int:
    """Bytes of ``obj`` and the tuples / frozensets inside it not counted yet."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (tuple, frozenset)):
        for x in obj:
            size += _deep_size(x, seen)
    return size


def _key_bytes(visited: set, interner: _Interner | None) -> int:
    """Bytes of the stored keys: each key tuple, plus (deep, each object once)
    the parts that no intern table accounts for."""
    total = sum(map(sys.getsizeof, visited))
    active = set()
    if interner is not None:
        active = {i for i, d in enumerate(interner.tables) if d is not None}
    seen: set[int] = set()
    for k in visited:
        if type(k) is tuple and k and k[-1] is _PAIR:
            for i in range(len(k) - 2):
                if i not in active:
                    total += _deep_size(k[i], seen)
        elif type(k) is tuple:
            for x in k:
                total += _deep_size(x, seen)
    return total


def _unpack(entry: Any, cls: type) -> tuple[Any, int]:
    """(state, monitor id) of a frontier entry: flat ``fields + (mid, _PAIR)``,
    ``(_PAIR, state, mid)``, or a bare state (monitor id 0)."""
    if type(entry) is tuple and entry:
        if entry[-1] is _PAIR:
            fields = entry[:-2]
            return (fields if cls is tuple else tuple.__new__(cls, fields)), entry[-2]
        if len(entry) == 3 and entry[0] is _PAIR:
            return entry[1], entry[2]
    return entry, 0


def explore(
    model: Any,
    *,
    max_states: int | None = None,
    symmetry: bool = True,
    fingerprint: bool = False,
    monitor_factory: Callable[[], Monitor] | None = None,
    monitor: bool = True,
    progress: Callable[[dict[str, Any]], None] | None = None,
    progress_interval: float = 0.2,
    keep_graph: bool = False,
    graph_limit: int = 20_000,
    stop_on_first: bool = True,
    check_deadlock: bool = True,
    freeze_gc: bool = True,
    intern: bool = True,
    backend: Callable[[], Any] | None = None,
) -> ExploreResult:
    """Explore ``model`` breadth-first; return what was found.

    ``monitor_factory`` makes the monitor of an empty history (default:
    ``Monitor(model.header.policy, complete=True, workers=model.header.workers)``);
    ``monitor=False`` explores the model alone (no event checking).
    ``fingerprint`` keeps 64-bit hashes of visited states instead of the
    states.  ``stop_on_first`` stops at the first counterexample; otherwise
    the search goes on and keeps the first (shortest) one of each invariant.
    ``keep_graph`` builds a :mod:`networkx` ``MultiDiGraph`` of the explored
    space (``result.graph``; ``None`` above ``graph_limit`` states).
    ``progress`` is called about every ``progress_interval`` seconds with a
    dict of counters.  ``intern`` shares equal parts of stored states (see
    docs/modeling.md, "Memory").

    ``backend`` (a factory of data backends such as
    :class:`pdproto._torch_backend.TorchBackend`: ``apply(event) ->
    violations``, ``finish()``, ``copy()``) runs along the BFS tree: every
    new state gets a copy of its parent's backend (the backend of the first
    path that reached it) with the step's events applied; only states of the
    frontier hold one.  Its violations are reported like the monitor's, with
    the shortest trace of the tree; on a transition the monitor rejects, and
    at a quiet state, the backend also finishes the history (in-flight
    transfers land, everything readable is verified).
    """
    header: HistoryHeader = getattr(model, "header", None) or HistoryHeader()
    if keep_graph and fingerprint:
        raise UsageError("fingerprint with a state graph", True, "exact mode (a graph needs the states)")
    if max_states is not None and (type(max_states) is not int or max_states < 1):
        raise UsageError("max_states", max_states, "an integer >= 1")
    if monitor:
        if monitor_factory is None:
            def monitor_factory() -> Monitor:
                return Monitor(header.policy, complete=True, workers=header.workers)
        template = monitor_factory()
    else:
        template = None

    # -- symmetry hooks --------------------------------------------------
    canonical_product = getattr(model, "canonical_product", None) if symmetry else None
    sym_hook = getattr(model, "symmetry", None) if symmetry else None
    canonical = getattr(model, "canonical", None) if symmetry else None
    if not callable(canonical_product):
        canonical_product = None
    if not callable(sym_hook):
        sym_hook = None
    if not callable(canonical):
        canonical = None
    if not symmetry:
        sym_mode = "off"
    elif canonical_product is not None:
        sym_mode = "product"
    elif sym_hook is not None:
        sym_mode = "renaming"
    elif canonical is not None:
        sym_mode = "state-only"
    else:
        sym_mode = "none offered"

    invariants = dict(getattr(model, "invariants", None) or {})
    sometimes = dict(getattr(model, "sometimes", None) or {})
    met: dict[str, None] = {}
    unmet = dict(sometimes)

    # -- monitor states, interned ---------------------------------------
    mkeys: list[tuple] = []  # mid -> verdict key
    mids: dict[tuple, int] = {}  # verdict key -> mid
    parts: dict[Any, Any] = {}  # hash-consed key components
    # (mid, events) -> mid, or (mid, violations) when the events break a rule;
    # keyed by one int: mid | (id of the events tuple << 32)
    memo: dict[int, Any] = {}
    ev_ids: dict[tuple, int] = {}
    memo_limit = 2_000_000
    renamed: dict[int, int] = {}  # mid | (renaming id << 32) -> mid of renamed key
    ren_ids: dict[Any, int] = {}

    def intern_key(k: tuple) -> int:
        mid = mids.get(k)
        if mid is None:
            k = tuple(parts.setdefault(p, p) for p in k)
            mid = len(mkeys)
            mkeys.append(k)
            mids[k] = mid
        return mid

    if template is not None:
        intern_key(template.key())

    flat_types: dict[type, bool] = {}
    canon_flat: dict[type, bool] = {}

    def flat_key(state: Any, mid: int) -> Hashable:
        """The stored form of (state, mid): flat when the state's type allows."""
        cls = type(state)
        ok = flat_types.get(cls)
        if ok is None:
            ok = flat_types[cls] = _flat_type(cls) and (cls is scls or scls is None)
        if ok:
            return tuple(state) + (mid, _PAIR)
        return state if mid == 0 else (_PAIR, state, mid)

    def product_key(state: Any, mid: int) -> Hashable:
        if canonical_product is not None:
            return canonical_product(state, mkeys[mid])
        if sym_hook is not None:
            cstate, ren = sym_hook(state)
            if mid == 0 or ren is None:
                rmid = mid
            else:
                rkey = ren.key() if isinstance(ren, Renaming) else ren
                rid = ren_ids.get(rkey)
                if rid is None:
                    rid = ren_ids[rkey] = len(ren_ids)
                rk = mid | (rid << 32)
                rmid = renamed.get(rk)
                if rmid is None:
                    r = ren if isinstance(ren, Renaming) else Renaming(*ren)
                    rmid = intern_key(rename_monitor_key(mkeys[mid], r.names, r.blocks))
                    renamed[rk] = rmid
            return _canon_key(cstate, rmid)
        if canonical is not None:
            state = canonical(state)
        return _canon_key(state, mid)

    def _canon_key(cstate: Any, mid: int) -> Hashable:
        # a canonical state may be of another type than the model's states
        cls = type(cstate)
        ok = canon_flat.get(cls)
        if ok is None:
            ok = canon_flat[cls] = _flat_type(cls)
        if ok:
            return tuple(cstate) + (mid, _PAIR)
        return cstate if mid == 0 else (_PAIR, cstate, mid)

    # -- visited set, parents, frontier ----------------------------------
    parents = array("i")  # state index -> parent index (-1 for initial); widened past 2**31
    via = array("H")  # state index -> action index in the parent (initial index); widened past 65535
    fpset = _FPSet() if fingerprint else None
    visited: set | None = None if fingerprint else set()
    interner = _Interner() if intern else None  # frontier entries (concrete states)
    # canonical keys get their own tables: a symmetry hook may build parts of
    # other types that compare equal to the model's (a tuple and a named tuple)
    kinterner = _Interner() if intern and sym_mode not in ("off", "none offered") else interner
    index_of: dict | None = {} if keep_graph else None
    edges: list[tuple[int, int, str]] = []
    graph_ok = keep_graph

    violations: list[Counterexample] = []
    deadlocks: list[Counterexample] = []
    inv_failures: list[Counterexample] = []
    found_ids: set[str] = set()
    pending: list[tuple[str, str, int, str]] = []  # (kind, invariant, state index, message)

    # A frontier entry is a flat tuple ``fields + (mid, _PAIR)`` (with
    # interned fields: in the plain search it is the stored key itself), a
    # ``(_PAIR, state, mid)`` triple, or a bare state with mid 0.
    frontier: deque = deque()
    bfront: deque | None = deque() if backend is not None else None
    peak_frontier = 0
    transitions = 0
    depth = 0
    stopped = False
    complete = True
    limit = max_states if max_states is not None else -1
    init_states = list(model.initial_states())
    scls: type | None = None
    scls = type(init_states[0]) if init_states else tuple

    gc_was = gc.isenabled()
    if freeze_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    t0 = time.perf_counter()
    next_report = t0 + progress_interval

    def record(kind: str, inv: str, idx: int, message: str) -> bool:
        """Remember a finding at state ``idx``; True when the search should stop."""
        if inv not in found_ids:
            found_ids.add(inv)
            pending.append((kind, inv, idx, message))
        return stop_on_first

    def check_state(state: Any, idx: int) -> bool:
        if unmet:
            for name in [n for n, p in unmet.items() if p(state)]:
                del unmet[name]
                met[name] = None
        if invariants:
            for name, pred in invariants.items():
                if not pred(state):
                    if record("state-invariant", name, idx, f"state invariant {name!r} fails"):
                        return True
        return False

    def run_backend(parent: Any, events: Any, finish: bool) -> tuple[Any, list]:
        b = parent.copy()
        found: list = []
        for ev in events:
            found.extend(b.apply(ev))
        if finish and not found:
            found.extend(b.finish())
        return b, found

    try:
        # initial states
        for i, state in enumerate(init_states):
            key = product_key(state, 0) if not (sym_mode in ("off", "none offered")) else flat_key(state, 0)
            if fpset is not None:
                if not fpset.add(_fingerprint(key)):
                    continue
            else:
                if key in visited:  # type: ignore[operator]
                    continue
                if kinterner is not None and type(key) is tuple and key and key[-1] is _PAIR:
                    key = kinterner.key(key)
                visited.add(key)  # type: ignore[union-attr]
            idx = len(parents)
            parents.append(-1)
            via.append(i)
            if index_of is not None:
                index_of[key] = idx
            entry = flat_key(state, 0)
            if interner is not None and type(entry) is tuple and entry and entry[-1] is _PAIR:
                entry = interner.key(entry)
            frontier.append(entry)
            if bfront is not None:
                b0 = backend()  # type: ignore[misc]
                b0.line = 1  # the header is line 1 of a written history
                bfront.append(b0)
            if check_state(state, idx):
                stopped = True
                break
            if idx + 1 == limit:
                complete = False
                stopped = True
                break
        level_end = len(parents)
        expanded = 0
        fast_key = sym_mode in ("off", "none offered")
        fp_table = fpset.table if fpset is not None else None
        fp_mask = fpset.mask if fpset is not None else 0
        step = model.step
        actions_of = model.actions
        ikey = interner.key if interner is not None else None
        kkey = kinterner.key if kinterner is not None else None
        tnew = tuple.__new__
        scls_is_tuple = scls is tuple
        scls_flat = _flat_type(scls)
        while frontier and not stopped:
            if expanded == level_end:
                depth += 1
                level_end = len(parents)
                if len(frontier) > peak_frontier:
                    peak_frontier = len(frontier)
            entry = frontier.popleft()
            pb = bfront.popleft() if bfront is not None else None
            if type(entry) is tuple and entry and entry[-1] is _PAIR:
                mid = entry[-2]
                state = entry[:-2] if scls_is_tuple else tnew(scls, entry[:-2])
            else:
                state, mid = _unpack(entry, scls)
            entry = None
            pidx = expanded
            expanded += 1
            acts = actions_of(state)
            if not acts:
                if check_deadlock and template is not None:
                    ends = _monitor_from_key(template, mkeys[mid]).end_violations()
                    if ends:
                        if record("deadlock", ends[0].invariant, pidx, ends[0].message):
                            stopped = True
                            break
                if pb is not None:
                    found = pb.finish()
                    if found and record("violation", found[0].invariant, pidx, found[0].message):
                        stopped = True
                        break
                continue
            parent_mon = None
            for ai, act in enumerate(acts):
                nstate, events = step(state, act)
                transitions += 1
                bad: Any = ()
                if events and template is not None:
                    evs = events if type(events) is tuple else tuple(events)
                    evid = ev_ids.get(evs)
                    if evid is None:
                        if len(ev_ids) >= memo_limit:
                            ev_ids.clear()
                            memo.clear()
                        evid = ev_ids[evs] = len(ev_ids)
                    mk = mid | (evid << 32)
                    hit = memo.get(mk)
                    if hit is None:
                        if parent_mon is None:
                            parent_mon = _monitor_from_key(template, mkeys[mid])
                        child = parent_mon.copy()
                        found_v: list[Violation] = []
                        for ev in evs:
                            found_v.extend(child.feed(ev))
                        nmid = intern_key(child.key())
                        hit = (nmid, tuple(found_v)) if found_v else nmid
                        if len(memo) >= memo_limit:
                            memo.clear()
                        memo[mk] = hit
                    if type(hit) is int:
                        nmid = hit
                    else:
                        nmid, bad = hit
                else:
                    nmid = mid
                if fast_key:
                    if scls_flat and type(nstate) is scls:
                        key = nstate + (nmid, _PAIR)  # a plain tuple, also for a named tuple
                    else:
                        key = flat_key(nstate, nmid)
                else:
                    key = product_key(nstate, nmid)
                if bad:
                    # A violation is a property of the transition, not only of the
                    # state it reaches: the monitor may record the bad event as if
                    # it were fine, so the product state can equal a clean one seen
                    # before.  Mark it, so the shortest violating path is kept.
                    key = (_BAD, key, bad[0].invariant)
                if fp_table is not None:
                    fp = hash(key) or 1
                    i = fp & fp_mask
                    while True:
                        v = fp_table[i]
                        if v == 0:
                            break
                        if v == fp:
                            break
                        i = (i + 1) & fp_mask
                    if v:
                        continue
                    fp_table[i] = fp
                    fpset.n += 1  # type: ignore[union-attr]
                    if fpset.n > fpset.limit:  # type: ignore[union-attr]
                        fpset._grow()  # type: ignore[union-attr]
                        fp_table, fp_mask = fpset.table, fpset.mask  # type: ignore[union-attr]
                else:
                    if key in visited:  # type: ignore[operator]
                        if graph_ok:
                            edges.append((pidx, index_of[key], str(act)))  # type: ignore[index]
                        continue
                    if kkey is not None and type(key) is tuple and key and key[-1] is _PAIR:
                        key = kkey(key)
                    visited.add(key)  # type: ignore[union-attr]
                nidx = len(parents)
                try:
                    parents.append(pidx)
                except OverflowError:
                    parents = array("q", parents)
                    parents.append(pidx)
                try:
                    via.append(ai)
                except OverflowError:
                    via = array("l", via)
                    via.append(ai)
                if graph_ok:
                    index_of[key] = nidx  # type: ignore[index]
                    edges.append((pidx, nidx, str(act)))
                    if nidx >= graph_limit:
                        graph_ok = False
                if bad:
                    stop = record("violation", bad[0].invariant, nidx, bad[0].message)
                    if pb is not None:
                        _, found = run_backend(pb, events, True)
                        if found and record("violation", found[0].invariant, nidx, found[0].message):
                            stop = True
                    if stop:
                        stopped = True
                        break
                    continue  # a violating state is not expanded
                if pb is not None:
                    cb, found = run_backend(pb, events, False)
                    if found:
                        if record("violation", found[0].invariant, nidx, found[0].message):
                            stopped = True
                            break
                        continue  # a corrupting state is not expanded
                if check_state(nstate, nidx):
                    stopped = True
                    break
                if fast_key and fp_table is None and type(key) is tuple and key[-1] is _PAIR:
                    frontier.append(key)  # the stored key: fields already interned
                else:
                    entry = flat_key(nstate, nmid)
                    if ikey is not None and type(entry) is tuple and entry and entry[-1] is _PAIR:
                        entry = ikey(entry)
                    frontier.append(entry)
                    entry = None
                if pb is not None:
                    bfront.append(cb)  # type: ignore[union-attr]
                if nidx + 1 == limit:
                    complete = False
                    stopped = True
                    break
            if progress is not None and (expanded & 255) == 0:
                now = time.perf_counter()
                if now >= next_report:
                    next_report = now + progress_interval
                    progress({
                        "states": len(parents),
                        "transitions": transitions,
                        "depth": depth,
                        "queue": len(frontier),
                        "seconds": now - t0,
                        "violations": len(pending),
                    })
        seconds = time.perf_counter() - t0
    finally:
        if freeze_gc:
            gc.unfreeze()
            if gc_was:
                gc.enable()

    n = len(parents)
    depth_reached = len(_path(parents, via, n - 1)[1]) if n else 0
    if progress is not None:
        progress({
            "states": n, "transitions": transitions, "depth": depth_reached,
            "queue": len(frontier), "seconds": seconds, "violations": len(pending), "done": True,
        })
    peak_frontier = max(peak_frontier, len(frontier))
    frontier.clear()
    if bfront is not None:
        bfront.clear()

    # -- counterexamples -------------------------------------------------
    for kind, inv, idx, message in pending:
        cx = _counterexample(model, header, template, parents, via, idx, kind, inv, message, backend)
        if kind == "violation":
            violations.append(cx)
        elif kind == "deadlock":
            deadlocks.append(cx)
        else:
            inv_failures.append(cx)

    # -- memory accounting: bytes of the stored structures ------------------
    links = parents.itemsize * len(parents) + via.itemsize * len(via)
    memory: dict[str, int] = {"links": links}
    if fpset is not None:
        memory["fingerprints"] = fpset.nbytes()
        coll: float | None = _collision_probability(n)
    else:
        memory["visited_set"] = sys.getsizeof(visited)
        memory["keys"] = _key_bytes(visited, kinterner)  # type: ignore[arg-type]
        coll = None
    memory["interned_parts"] = interner.nbytes() if interner is not None else 0
    if kinterner is not None and kinterner is not interner:
        memory["interned_parts"] += kinterner.nbytes()
    stored = sum(memory.values())
    bps: float | None = stored / n if n else None
    memory["peak_frontier_entries"] = peak_frontier
    memory["monitor_states"] = len(mkeys)
    memory["memo_entries"] = len(memo)

    graph = None
    if keep_graph and graph_ok:
        graph = _build_graph(model.name if hasattr(model, "name") else "model", n, edges, parents)

    return ExploreResult(
        model=getattr(model, "name", type(model).__name__),
        states=n,
        transitions=transitions,
        depth=depth_reached,
        seconds=seconds,
        violations=tuple(violations),
        deadlocks=tuple(deadlocks),
        invariant_failures=tuple(inv_failures),
        unmet_sometimes=tuple(unmet),
        met_sometimes=tuple(n for n in sometimes if n in met),
        complete=not stopped,
        truncated=not complete,
        symmetry=sym_mode,
        fingerprint=fingerprint,
        bytes_per_state=bps,
        collision_probability=coll,
        monitor_states=len(mkeys),
        graph=graph,
        header=header,
        memory=memory,
    )


def _build_graph(name: str, n: int, edges: list, parents: array) -> Any:
    import networkx as nx

    g = nx.MultiDiGraph(name=name)
    for i in range(n):
        g.add_node(i, initial=parents[i] < 0)
    for a, b, label in edges:
        g.add_edge(a, b, action=label)
    return g


def _path(parents: array, via: array, idx: int) -> tuple[int, list[int]]:
    path = []
    while parents[idx] >= 0:
        path.append(via[idx])
        idx = parents[idx]
    path.reverse()
    return via[idx], path


def replay(model: Any, initial: int, action_indices: Sequence[int]) -> tuple[list[Step], Any]:
    """Re-run ``model`` from its ``initial``-th initial state along the given
    action indices; return the steps (with their events) and the last state."""
    state = list(model.initial_states())[initial]
    steps = []
    for i, ai in enumerate(action_indices, 1):
        act = model.actions(state)[ai]
        state, events = model.step(state, act)
        steps.append(Step(i, getattr(act, "actor", "?"), act, tuple(events), bool(getattr(act, "fault", False))))
    return steps, state


def _counterexample(
    model: Any,
    header: HistoryHeader,
    template: Monitor | None,
    parents: array,
    via: array,
    idx: int,
    kind: str,
    inv: str,
    message: str,
    backend: Callable[[], Any] | None = None,
) -> Counterexample:
    initial, path = _path(parents, via, idx)
    steps, state = replay(model, initial, path)
    found: tuple[Violation, ...] = ()
    data: list[Violation] = []
    if backend is not None and kind != "state-invariant":
        # the data backend on the history as written (header on line 1); the
        # end of the history when the step itself showed nothing
        b = backend()
        line = 1
        for s in steps:
            for ev in s.events:
                line += 1
                data.extend(b.apply(ev, line))
        if not data:
            data.extend(b.finish())
        if inv == data[0].invariant if data else False:
            message = data[0].message
    if template is not None:
        # the monitor of the history as written: header on line 1, events after
        mon = Monitor(header.policy, complete=True, workers=header.workers, skip=template.skip)
        line = 1
        out: list[Violation] = []
        for s in steps:
            for ev in s.events:
                line += 1
                out.extend(mon.feed(ev, line))
        if kind == "deadlock":
            out = mon.end_violations()
        found = tuple(out)
        match = [v for v in found if v.invariant == inv]
        if match:
            message = match[0].message
            found = tuple(match) + tuple(v for v in found if v.invariant != inv)
    if data:
        found = (tuple(data) + found) if data[0].invariant == inv else (found + tuple(data))
    return Counterexample(inv, message, tuple(steps), kind, found, initial, state)


def trace_header(result_header: HistoryHeader, cx: Counterexample) -> HistoryHeader:
    """The header to write ``cx`` with: complete for a deadlock (leak and stuck
    are end-of-history checks), not complete for a safety violation (the
    history stops at the bad event, not at a quiet state)."""
    return attrs.evolve(result_header, complete=cx.kind == "deadlock")
