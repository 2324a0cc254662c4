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
import time
from array import array
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import attrs

from ._errors import UsageError
from ._events import Event
from ._history import HistoryHeader
from ._monitor import Monitor, Violation

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
        }


# ---------------------------------------------------------------------------
# symmetry: renaming the monitor's verdict state


@attrs.frozen
class Renaming:
    """A renaming of a model's ids.  ``names`` maps strings (request ids,
    worker names, ticket ids, transfer ids); ``blocks`` maps ``(worker,
    block)`` (original names) to the new block id on the renamed worker.
    Ids not mentioned keep their name."""

    names: Mapping[str, str] = attrs.field(factory=dict)
    blocks: Mapping[tuple[str, int], int] = attrs.field(factory=dict)

    def key(self) -> tuple:
        return (tuple(sorted(self.names.items())), tuple(sorted(self.blocks.items())))


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
    dict of counters.
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
    memo: dict[tuple, tuple[int, tuple[Violation, ...]]] = {}  # (mid, events) -> (mid, violations)
    memo_limit = 2_000_000
    renamed: dict[tuple, int] = {}  # (mid, renaming key) -> mid of renamed key

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

    def product_key(state: Any, mid: int) -> Hashable:
        if canonical_product is not None:
            return canonical_product(state, mkeys[mid])
        if sym_hook is not None:
            cstate, ren = sym_hook(state)
            if mid == 0 or ren is None:
                rmid = mid
            else:
                rk = (mid, ren.key() if isinstance(ren, Renaming) else ren)
                rmid = renamed.get(rk)
                if rmid is None:
                    r = ren if isinstance(ren, Renaming) else Renaming(*ren)
                    rmid = intern_key(rename_monitor_key(mkeys[mid], r.names, r.blocks))
                    renamed[rk] = rmid
            return cstate if rmid == 0 else (_PAIR, cstate, rmid)
        if canonical is not None:
            state = canonical(state)
        return state if mid == 0 else (_PAIR, state, mid)

    # -- visited set, parents, frontier ----------------------------------
    parents = array("q")  # state index -> parent index (-1 for initial)
    via = array("l")  # state index -> action index in the parent (initial index)
    fpset = _FPSet() if fingerprint else None
    visited: set | None = None if fingerprint else set()
    index_of: dict | None = {} if keep_graph else None
    edges: list[tuple[int, int, str]] = []
    graph_ok = keep_graph

    violations: list[Counterexample] = []
    deadlocks: list[Counterexample] = []
    inv_failures: list[Counterexample] = []
    found_ids: set[str] = set()
    pending: list[tuple[str, str, int, str]] = []  # (kind, invariant, state index, message)

    frontier: deque = deque()
    transitions = 0
    depth = 0
    stopped = False
    complete = True
    limit = max_states if max_states is not None else -1

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

    def add_state(key: Hashable) -> int:
        """Index of a new state, or -1 when seen."""
        if fpset is not None:
            if not fpset.add(_fingerprint(key)):
                return -1
        else:
            if key in visited:  # type: ignore[operator]
                return -1
            visited.add(key)  # type: ignore[union-attr]
        return len(parents)

    try:
        # initial states
        for i, state in enumerate(model.initial_states()):
            key = product_key(state, 0)
            idx = add_state(key)
            if idx < 0:
                continue
            parents.append(-1)
            via.append(i)
            if index_of is not None:
                index_of[key] = idx
            frontier.append((state, 0))
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
        while frontier and not stopped:
            if expanded == level_end:
                depth += 1
                level_end = len(parents)
            state, mid = frontier.popleft()
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
                continue
            parent_mon = None
            for ai, act in enumerate(acts):
                nstate, events = step(state, act)
                transitions += 1
                bad: tuple[Violation, ...] = ()
                if events and template is not None:
                    mk = (mid, events if type(events) is tuple else tuple(events))
                    hit = memo.get(mk)
                    if hit is None:
                        if parent_mon is None:
                            parent_mon = _monitor_from_key(template, mkeys[mid])
                        child = parent_mon.copy()
                        found: list[Violation] = []
                        for ev in mk[1]:
                            found.extend(child.feed(ev))
                        hit = (intern_key(child.key()), tuple(found))
                        if len(memo) >= memo_limit:
                            memo.clear()
                        memo[mk] = hit
                    nmid, bad = hit
                else:
                    nmid = mid
                if fast_key:
                    key = nstate if nmid == 0 else (_PAIR, nstate, nmid)
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
                    before = len(visited)  # type: ignore[arg-type]
                    visited.add(key)  # type: ignore[union-attr]
                    if len(visited) == before:  # type: ignore[arg-type]
                        if graph_ok:
                            edges.append((pidx, index_of[key], str(act)))  # type: ignore[index]
                        continue
                nidx = len(parents)
                parents.append(pidx)
                via.append(ai)
                if graph_ok:
                    index_of[key] = nidx  # type: ignore[index]
                    edges.append((pidx, nidx, str(act)))
                    if nidx >= graph_limit:
                        graph_ok = False
                if bad:
                    if record("violation", bad[0].invariant, nidx, bad[0].message):
                        stopped = True
                        break
                    continue  # a violating state is not expanded
                if check_state(nstate, nidx):
                    stopped = True
                    break
                frontier.append((nstate, nmid))
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

    # -- counterexamples -------------------------------------------------
    for kind, inv, idx, message in pending:
        cx = _counterexample(model, header, template, parents, via, idx, kind, inv, message)
        if kind == "violation":
            violations.append(cx)
        elif kind == "deadlock":
            deadlocks.append(cx)
        else:
            inv_failures.append(cx)

    if fpset is not None:
        nbytes = fpset.nbytes() + parents.itemsize * len(parents) + via.itemsize * len(via)
        bps: float | None = nbytes / n if n else None
        coll: float | None = _collision_probability(n)
    else:
        bps = None
        coll = None

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
) -> Counterexample:
    initial, path = _path(parents, via, idx)
    steps, state = replay(model, initial, path)
    found: tuple[Violation, ...] = ()
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
    return Counterexample(inv, message, tuple(steps), kind, found, initial, state)


def trace_header(result_header: HistoryHeader, cx: Counterexample) -> HistoryHeader:
    """The header to write ``cx`` with: complete for a deadlock (leak and stuck
    are end-of-history checks), not complete for a safety violation (the
    history stops at the bad event, not at a quiet state)."""
    return attrs.evolve(result_header, complete=cx.kind == "deadlock")
