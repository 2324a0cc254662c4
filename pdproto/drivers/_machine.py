"""How a model is fuzzed with Hypothesis (imports Hypothesis).

:class:`_Walk` runs one example: from the model's initial state it takes
steps, feeds every event to a monitor and fails on a violation.
:func:`run_machine` (what :func:`pdproto.fuzz` calls) runs examples under
``@given(st.data())`` with one span and two recorded choices per step;
:func:`handoff_machine` wraps the same walk in a Hypothesis
``RuleBasedStateMachine`` for test authors.  How a walk explores (swarm,
novelty, backtracking, routing, quiescence) is told in docs/testing.md.

Replay: Hypothesis must be able to run a recorded example again and get the
same steps (to shrink it, and to replay it from the example database).  A
step's recorded choice is 0 ("let the walk choose") or ``i`` (enabled action
``i - 1``).  The walk's own decisions look at what every earlier example
visited, which changes from run to run; so each decision is remembered
under a key that encodes the example's seed and every choice so far
(:attr:`_Setup.decisions`), and an example replayed with the same choices
gets the same decisions back.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ..protocol import Action
from ..spec import Event, Monitor, Violation, write_history
from ._fuzz_results import FuzzStats, HandoffFailure, canonical_function, fault_kind, pick_failure
from ._hypothesis import Draws, namespaced_database, phase_statistics

#: How many progress steps teardown takes at most to reach quiescence.
QUIESCE_LIMIT = 10_000
#: a fresh step overrides the walk with a uniformly drawn action once in this many
OVERRIDE_ONE_IN = 64
#: how many walk decisions are remembered; past it the walk stops looking at
#: what other runs visited (so that every decision stays replayable)
DECISION_LIMIT = 2_000_000
#: routing toward a state with an unvisited successor searches at most this
#: many known states around the current one (then it goes by way of the
#: initial state)
ROUTE_LIMIT = 2_000
#: a snapshot of the monitor is kept every this many positions of a path;
#: backing up restores the nearest one and re-feeds the events after it
#: (a copy costs about what re-feeding three steps does, and the walk backs
#: up about every other step, mostly by one or two)
SNAPSHOT_EVERY = 4
#: swarm levels of an action kind: its weight relative to the others
_LEVELS = (1.0, 4.0, 0.02)  # normal, hot, off (only as a last resort)
#: how likely a step is a fault, when faults and progress are both enabled
_FAULT_RATES = (0.3, 0.1, 0.5, 0.7)
_MASK = (1 << 64) - 1
#: decision tags (a step's own decision is tagged with its recorded choice, 0)
_QUIET, _TEARDOWN = -1, -2


def _mix(chain: int, value: int) -> int:
    """The next decision key after ``value`` (a recorded choice, or a tag):
    Python's hash of a tuple of integers, the same in every process."""
    return hash((chain, value))


def _unit(chain: int) -> float:
    """A number in [0, 1) determined by ``chain`` (the walk's randomness)."""
    return (((chain * 0xD6E8FEB86659FD93) & _MASK) >> 11) / float(1 << 53)


def _pick(weights: Sequence[float], chain: int) -> int:
    """An index drawn by ``weights`` (uniform when they are all 0)."""
    total = sum(weights)
    if total <= 0:
        return int(_unit(chain) * len(weights))
    x = _unit(chain) * total
    for i, w in enumerate(weights):
        x -= w
        if x < 0:
            return i
    return len(weights) - 1


def _broken_invariant(setup: _Setup, state: Any, line: int) -> Violation | None:
    """The first of the model's state invariants that ``state`` breaks, as a
    violation at history line ``line`` (None: all hold)."""
    for name, holds in setup.invariants.items():
        if not holds(state):
            return Violation(f"model:{name}", line, f"the model's state invariant {name!r} does not hold")
    return None


@attrs.define
class _Setup:
    """What every example of one run (or of one machine class) shares."""

    model: Any
    header: Any
    canon: Callable[[Any], Any]
    invariants: dict
    out: str | None
    stats: FuzzStats
    init: Any
    backend: Callable[[Any], Any] | None
    swarm: bool
    steer: bool
    quiesce: bool
    #: decision key -> the walk's decision (see the module docstring)
    decisions: dict = attrs.field(factory=dict)
    #: canonical state -> the canonical states of its successors, for every
    #: state whose successors a walk looked at (what routing searches)
    graph: dict = attrs.field(factory=dict)
    #: canonical state -> the one a walk first reached it from (the initial
    #: state has none): a route from the initial state to any visited state
    parent: dict = attrs.field(factory=dict)
    #: visited states, in the order first visited: where an unvisited
    #: successor may still be (checked when taken, latest first)
    candidates: list = attrs.field(factory=list)
    #: every state reachable from the initial one was visited (routing is over)
    exhausted: bool = False
    #: failing action sequence -> its shrunk failure (a replay shrinks at once)
    shrunk: dict = attrs.field(factory=dict)
    #: wall seconds spent shrinking
    shrink_seconds: float = 0.0


class _Pos:
    """One position of the walk's path: a state, how it was reached, and
    what the walk knows of its successors."""

    __slots__ = ("state", "canon", "events", "enabled", "succ", "snapshot", "closed")

    def __init__(self, state: Any, canon: Any, events: int) -> None:
        self.state = state
        self.canon = canon
        self.events = events  # len(history) when the path reached it
        self.enabled: list[Action] | None = None
        self.succ: list | None = None  # (state, events, canon) per enabled action
        self.snapshot: Monitor | None = None  # the monitor here, when kept
        self.closed = False  # no successor left to visit (or none looked at)


class _Walk:
    """One example: a path from the initial state, its history and monitor.

    ``step`` takes one step: the recorded choice overrides the walk (an
    enabled action) or lets it choose.  The walk's choice, while no run has
    failed and ``steer`` is on, goes to a state no example has visited yet:
    among the current state's successors, else from the deepest earlier
    position of the path that still has one (backtracking: the history is
    cut there, no model step), else along the shortest known route to a
    state that has one.  Otherwise it is drawn by the swarm's weights.
    """

    def __init__(self, setup: _Setup) -> None:
        self.fz = setup
        self.draws: Draws | None = None
        self.chain = 0
        self.level: dict[str, float] = {}
        self.fault_rate = 0.0 if not setup.swarm else _FAULT_RATES[0]
        self.fault_delay = 0
        self.found: list[Violation] = []
        self.failed = False
        self.episodes_here = 0
        self.seen: set = set()  # canonical states this example visited
        self.plan: list = []  # canonical states of a route being followed
        self.trace: list[tuple[str, Action, tuple[Event, ...]]] = []
        self.events: list[Event] = []
        self.path: list[_Pos] = []
        self.monitor: Monitor | None = None
        self.backend: Any = None
        self.t0 = time.perf_counter()
        setup.stats.examples += 1
        self._start()

    # -- the path -------------------------------------------------------------

    @property
    def state(self) -> Any:
        return self.path[-1].state

    def _fresh_monitor(self) -> Monitor:
        return Monitor.from_header(self.fz.header, complete=True)

    def _start(self) -> None:
        fz = self.fz
        canon = fz.canon(fz.init)
        self.path = [_Pos(fz.init, canon, 0)]
        self.monitor = self._fresh_monitor()
        self.path[0].snapshot = self.monitor.copy()
        self.backend = fz.backend(fz.header) if fz.backend is not None else None
        self.episodes_here += 1
        fz.stats.episodes += 1
        self._visit(canon, None)

    def _visit(self, canon: Any, came_from: Any) -> None:
        fz = self.fz
        states = fz.stats.states
        if canon not in states:
            states.add(canon)
            if came_from is not None:
                fz.parent[canon] = came_from
            fz.candidates.append(canon)
        self.seen.add(canon)

    def _back_to(self, at: int) -> None:
        """Cut the path back to position ``at`` (a new episode from there):
        the monitor from the nearest snapshot, the events after it re-fed
        (and a backend, which keeps no snapshot, re-fed from the start)."""
        fz = self.fz
        del self.path[at + 1 :]
        del self.trace[at:]
        pos = self.path[at]
        del self.events[pos.events :]
        k = at
        while self.path[k].snapshot is None:
            k -= 1
        self.monitor = self.path[k].snapshot.copy()
        for line in range(self.path[k].events + 2, pos.events + 2):
            self.monitor.feed(self.events[line - 2], line)
        if self.backend is not None:
            self.backend = fz.backend(fz.header)
            for line, event in enumerate(self.events, 2):
                self.backend.apply(event, line)
        self.episodes_here += 1
        fz.stats.episodes += 1

    def _enabled(self, pos: _Pos) -> list[Action]:
        if pos.enabled is None:
            pos.enabled = list(self.fz.model.actions(pos.state))
        return pos.enabled

    def _lookahead(self, pos: _Pos) -> list:
        """The successors of ``pos`` (stepped once per position), noted in
        the shared graph."""
        if pos.succ is None:
            fz = self.fz
            step, canon = fz.model.step, fz.canon
            succ = []
            for a in self._enabled(pos):
                nxt, events = step(pos.state, a)
                succ.append((nxt, events, canon(nxt)))
            pos.succ = succ
            fz.graph[pos.canon] = tuple(s[2] for s in succ)
        return pos.succ

    def _take(self, pos: _Pos, i: int) -> None:
        """Take enabled action ``i`` of ``pos`` (the last position)."""
        fz = self.fz
        stats = fz.stats
        action = pos.enabled[i]  # type: ignore[index]
        if pos.succ is not None:
            state, events, canon = pos.succ[i]
        else:
            state, events = fz.model.step(pos.state, action)
            canon = fz.canon(state)
        if pos.snapshot is None and (len(self.path) - 1) % SNAPSHOT_EVERY == 0:
            pos.snapshot = self.monitor.copy()  # type: ignore[union-attr]
        events = tuple(events)
        self.trace.append((getattr(action, "actor", "?"), action, events))
        stats.steps += 1
        if stats.steps % stats.curve_every == 0:
            stats.curve.append((stats.steps, len(stats.states)))
        stats.actions[action.kind] += 1
        if action.fault:
            stats.faults[fault_kind(action)] += 1
        monitor, backend, found = self.monitor, self.backend, self.found
        for event in events:
            self.events.append(event)
            line = len(self.events) + 1  # the header is line 1
            out = monitor.feed(event, line)  # type: ignore[union-attr]
            if out:
                found.extend(out)
            if backend is not None:
                found.extend(backend.apply(event, line))
        self._visit(canon, pos.canon)
        self.path.append(_Pos(state, canon, len(self.events)))

    # -- checks ------------------------------------------------------------------

    def _fail(self, violation: Violation, complete: bool = False) -> None:
        # a history cut at a safety violation is not complete: leak and
        # stuck apply only to one that ran until the system went quiet
        fz = self.fz
        self.failed = True
        if fz.stats.found_at is None:
            fz.stats.found_at = fz.stats.examples
        trace, events = self.trace, self.events
        key = tuple(a for _, a, _ in trace)
        shrunk = fz.shrunk.get(key)
        if shrunk is None:
            t0 = time.perf_counter()
            shrunk = fz.shrunk[key] = _Shrinker(fz).shrink(key)
            fz.shrink_seconds += time.perf_counter() - t0
        if shrunk is not None:
            trace, events, violation, complete = shrunk
        written = attrs.evolve(fz.header, complete=complete)
        if fz.out is not None:
            write_history(fz.out, events, written)
        failure = HandoffFailure(violation, trace, fz.out, events, written)
        fz.stats.failure = failure
        raise failure

    def check(self) -> None:
        """The monitor's violations and the model's state invariants."""
        if self.found:
            self._fail(self.found[0])
        broken = _broken_invariant(self.fz, self.state, len(self.events) + 1)
        if broken is not None:
            self._fail(broken)

    def _end_of_history(self) -> None:
        """The system is quiet: the end-of-history checks."""
        end = self.monitor.end_violations()  # type: ignore[union-attr]
        if end:
            self._fail(end[0], complete=True)
        if self.backend is not None:
            data = self.backend.finish()
            if data:
                self._fail(data[0], complete=True)

    # -- drawing ------------------------------------------------------------------

    def begin(self, draws: Draws) -> None:
        """The example's first choices: the walk's seed, then the swarm (first,
        so that they vary even where Hypothesis fills the rest of an example
        with its simplest choices)."""
        self.draws = draws
        self.chain = draws.integer(0, 2**32 - 1, "walk seed")
        if self.fz.swarm:
            rate = draws.integer(0, 3, "swarm: fault rate")
            delay = draws.integer(0, 3, "swarm: progress first")
            self.fault_rate, self.fault_delay = _FAULT_RATES[rate], delay * 4
            self.chain = _mix(self.chain, 4 * rate + delay)

    def _levels(self, enabled: Sequence[Action]) -> None:
        """Draw the swarm level of every action kind not met before."""
        level = self.level
        for a in enabled:
            kind = a.kind + ("!" if a.fault else "")
            if kind not in level:
                drawn = self.draws.integer(0, 2, f"swarm: {kind}")  # type: ignore[union-attr]
                level[kind] = _LEVELS[drawn]
                self.chain = _mix(self.chain, drawn)  # examples with other swarms part ways

    def _weights(self, enabled: Sequence[Action], idx: Sequence[int]) -> list[float]:
        """The swarm weight of each candidate ``enabled[i]``, ``i`` in ``idx``:
        the fault rate shared among faults, the rest among progress actions,
        times its kind's level."""
        if not self.fz.swarm or len(idx) == 1:
            return [1.0] * len(idx)
        cands = [enabled[i] for i in idx]
        counts: dict[str, int] = {}
        for a in cands:
            counts[a.kind] = counts.get(a.kind, 0) + 1
        nfault = sum(1 for a in cands if a.fault)
        rate = 0.0 if len(self.trace) < self.fault_delay else self.fault_rate
        if nfault == len(cands):
            rate = 1.0
        elif nfault == 0:
            rate = 0.0
        level = self.level
        return [
            (rate if a.fault else 1.0 - rate)
            * level.get(a.kind + ("!" if a.fault else ""), 1.0)
            / counts[a.kind]
            for a in cands
        ]

    def _exploring(self) -> bool:
        fz = self.fz
        return fz.steer and fz.stats.failure is None and len(fz.decisions) < DECISION_LIMIT

    def _decide(self, tag: int, decide: Callable[[], Any]) -> Any:
        """The walk's decision under key ``mix(chain, tag)``: the remembered
        one, or a new one (remembered while exploring)."""
        self.chain = _mix(self.chain, tag)
        decisions = self.fz.decisions
        found = decisions.get(self.chain)
        if found is not None:
            return found
        made = decide()
        if self._exploring():
            decisions[self.chain] = made
        return made

    # -- steps ------------------------------------------------------------------

    def step(self, override: bool = True) -> None:
        """One step (none when the system is quiet and nothing is left to
        back up to).  ``override``: draw whether to take an action of the
        draw's choosing instead of the walk's (for Hypothesis's shrinker)."""
        fz = self.fz
        pos = self.path[-1]
        enabled = self._enabled(pos)
        if not enabled:
            if not fz.quiesce:
                return
            self._end_of_history()
            back = self._decide(_QUIET, self._quiet_back)
            if back < 0:
                return
            self.plan = []
            self._back_to(back)
            pos = self.path[-1]
            enabled = self._enabled(pos)
        if fz.swarm:
            self._levels(enabled)
        v = self.draws.override(len(enabled), OVERRIDE_ONE_IN) if override else 0  # type: ignore[union-attr]
        if v:
            self.chain = _mix(self.chain, v)
            self.plan = []
            self._take(pos, v - 1)
            return
        back, i = self._decide(0, self._walk)
        if back is not None:
            self._back_to(back)
        self._take(self.path[-1], i)

    def _quiet_back(self) -> int:
        """Where to back up to from a quiet state: the deepest position with
        an unvisited successor while exploring, else one or two steps back
        (-1: nowhere, the path is the initial state alone)."""
        if self._exploring():
            found = self._open_position()
            if found is not None:
                return found[0]
        if len(self.path) == 1:
            return -1
        return max(0, len(self.path) - 2 - (self.chain & 1))

    def _open_position(self) -> tuple[int, list[int]] | None:
        """The deepest position of the path with successors no example has
        visited, and their indexes.  Earlier positions found without one
        (or never looked ahead from) are closed: novelty only runs out, so
        they are not looked at again."""
        states = self.fz.stats.states
        last = len(self.path) - 1
        for at in range(last, -1, -1):
            pos = self.path[at]
            if at == last:
                succ = self._lookahead(pos)
            elif pos.closed:
                continue
            elif pos.succ is None:
                pos.closed = True
                continue
            else:
                succ = pos.succ
            new = [i for i, s in enumerate(succ) if s[2] not in states]
            if new:
                return at, new
            if at < last:
                pos.closed = True
        return None

    def _walk(self) -> tuple[int | None, int]:
        """The walk's step: (position to back up to or None, action index)."""
        pos = self.path[-1]
        enabled = pos.enabled
        if not self._exploring():
            return None, _pick(self._weights(enabled, range(len(enabled))), self.chain)  # type: ignore[arg-type]
        found = self._open_position()
        if found is not None:
            at, new = found
            target = self.path[at]
            w = self._weights(target.enabled, new)  # type: ignore[arg-type]
            self.plan = []
            return (None if at == len(self.path) - 1 else at), new[_pick(w, self.chain)]
        succ = pos.succ  # looked at by _open_position
        i = self._route_step(succ)  # type: ignore[arg-type]
        if i is not None:
            return None, i
        if not self.fz.exhausted:  # nothing open near here: back to where a route leaves the path
            at, self.plan = self._route_from_path()
            if self.plan:
                want = self.plan.pop(0)
                for i, s in enumerate(self._lookahead(self.path[at])):
                    if s[2] == want:
                        return (None if at == len(self.path) - 1 else at), i
                self.plan = []
        fresh = [i for i, s in enumerate(succ) if s[2] not in self.seen]  # type: ignore[union-attr]
        idx = fresh or range(len(enabled))  # type: ignore[arg-type]
        return None, idx[_pick(self._weights(enabled, idx), self.chain)]  # type: ignore[arg-type]

    def _route_step(self, succ: list) -> int | None:
        """The next step of the shortest known route to a state with an
        unvisited successor (searched once, then followed)."""
        if not self.plan and not self.fz.exhausted:
            self.plan = self._route(self.path[-1].canon)
        if self.plan:
            want = self.plan.pop(0)
            for i, s in enumerate(succ):
                if s[2] == want:
                    return i
            self.plan = []
        return None

    def _route(self, start: Any) -> list:
        """Canonical states from ``start`` (excluded) to the nearest known
        state that may have a successor no example visited (one of the
        graph with such a successor, or one no walk looked ahead from), by
        breadth-first search of the shared graph (at most ROUTE_LIMIT
        states); [] when there is none that near."""
        graph, states = self.fz.graph, self.fz.stats.states
        prev = {start: None}
        queue = collections.deque([start])
        while queue and len(prev) < ROUTE_LIMIT:
            c = queue.popleft()
            succ = graph.get(c)
            if c != start and (succ is None or any(d not in states for d in succ)):
                route = []
                while c != start:
                    route.append(c)
                    c = prev[c]
                return route[::-1]
            for d in succ or ():
                if d not in prev:
                    prev[d] = c
                    queue.append(d)
        return []

    def _route_from_path(self) -> tuple[int, list]:
        """A route to the latest visited state that may have an unvisited
        successor, along the way it was first reached: (the position of
        the path where that way leaves it, the canonical states after it);
        (0, []) (and the search is over) when no state may."""
        fz = self.fz
        graph, states, candidates, parent = fz.graph, fz.stats.states, fz.candidates, fz.parent
        on_path = {pos.canon: at for at, pos in enumerate(self.path)}
        while candidates:
            c = candidates[-1]
            succ = graph.get(c)
            if succ is None or any(d not in states for d in succ):
                route = []
                while c not in on_path and c in parent:
                    route.append(c)
                    c = parent[c]
                if route and c in on_path:
                    return on_path[c], route[::-1]
            candidates.pop()
        fz.exhausted = True
        return 0, []

    # -- the end ------------------------------------------------------------------

    def teardown(self) -> None:
        """Drive the example to quiescence and apply the end-of-history checks
        (unless it failed)."""
        try:
            if (
                self.fz.quiesce
                and not self.failed
                and not self.found
                and (len(self.path) > 1 or self.episodes_here == 1)
            ):
                self._quiesce()
        finally:
            self.fz.stats.seconds += time.perf_counter() - self.t0

    def _quiesce(self) -> None:
        stats = self.fz.stats
        for _ in range(QUIESCE_LIMIT):
            pos = self.path[-1]
            enabled = self._enabled(pos)
            progress = [i for i, a in enumerate(enabled) if not a.fault]
            if not progress:  # nothing, or only faults, is left: the system is quiet
                break
            self._take(pos, self._decide(_TEARDOWN, partial(self._progress_choice, pos, progress)))
            stats.teardown_steps += 1
            self.check()
        else:
            self._fail(_no_quiescence(len(self.events) + 1))
        self._end_of_history()

    def _progress_choice(self, pos: _Pos, progress: list[int]) -> int:
        """Teardown's step: a progress action leading to an unvisited state
        while exploring, else the first."""
        if self._exploring() and len(progress) > 1:
            states = self.fz.stats.states
            succ = self._lookahead(pos)
            for i in progress:
                if succ[i][2] not in states:
                    return i
        return progress[0]

    # -- the uninstrumented baseline ---------------------------------------------

    def step_uniform(self, data: Any) -> None:
        """A uniform public draw among the enabled actions (no swarm, no
        steering, no backtracking)."""
        pos = self.path[-1]
        enabled = self._enabled(pos)
        if not enabled:
            if not self.fz.quiesce:
                return
            self._end_of_history()
            self._back_to(0)
            pos = self.path[-1]
            enabled = self._enabled(pos)
        if enabled:
            self._take(pos, data.draw(st.sampled_from(range(len(enabled))), label="action"))


class _Shrinker:
    """Shrinks a failing action sequence: deletes runs of steps, from long
    runs to single steps, while the rest still fails.  Exact: every
    candidate is replayed on the model, its events fed to a fresh monitor
    (and backend), then driven to quiescence with progress actions (as
    teardown does) and checked at its end; an action no longer enabled
    where it comes is left out.  A candidate is kept when it fails (any
    invariant, as Hypothesis's shrinker may slip to another bug) in fewer
    steps."""

    def __init__(self, setup: _Setup) -> None:
        self.fz = setup

    def shrink(self, actions: Sequence[Action]) -> tuple | None:
        """(trace, events, violation, complete) of the shortest failure
        found, or None when ``actions`` does not fail on replay."""
        best = self.replay(actions)
        if best is None:
            return None
        chunk = max(1, len(best[0]) // 2)
        while True:
            improved = False
            cur = [a for _, a, _ in best[0]]
            i = len(cur) - chunk
            while i >= 0:  # from the end: a failure's cause is usually late
                tried = self.replay(cur[:i] + cur[i + chunk :])
                if tried is not None and len(tried[0]) < len(best[0]):
                    best, improved = tried, True
                    cur = [a for _, a, _ in best[0]]
                    i = min(i, len(cur)) - chunk
                else:
                    i -= chunk
            if chunk > 1:
                chunk //= 2
            elif not improved:
                return best

    def replay(self, actions: Sequence[Action]) -> tuple | None:
        """Run ``actions`` (leaving out those not enabled); (trace, events,
        violation, complete) when it fails, else None."""
        fz = self.fz
        model, header = fz.model, fz.header
        state = fz.init
        monitor = Monitor.from_header(header, complete=True)
        backend = fz.backend(header) if fz.backend is not None else None
        trace: list = []
        events: list = []

        def take(action: Action) -> Violation | None:
            nonlocal state
            state, evs = model.step(state, action)
            evs = tuple(evs)
            trace.append((getattr(action, "actor", "?"), action, evs))
            found: list = []
            for event in evs:
                events.append(event)
                line = len(events) + 1
                found.extend(monitor.feed(event, line))
                if backend is not None:
                    found.extend(backend.apply(event, line))
            if found:
                return found[0]
            return _broken_invariant(fz, state, len(events) + 1)

        for action in actions:
            if action not in model.actions(state):
                continue
            v = take(action)
            if v is not None:
                return trace, events, v, False
        for _ in range(QUIESCE_LIMIT):
            progress = [a for a in model.actions(state) if not a.fault]
            if not progress:
                break
            v = take(progress[0])
            if v is not None:
                return trace, events, v, False
        else:
            return trace, events, _no_quiescence(len(events) + 1), True
        end = monitor.end_violations()
        if not end and backend is not None:
            end = backend.finish()
        if end:
            return trace, events, end[0], True
        return None


class HandoffMachine(RuleBasedStateMachine):
    """Fuzzes ``setup.model`` (a subclass made by :func:`handoff_machine`
    sets ``setup``): one :class:`_Walk` per example, one walk step per rule
    step, the checks as the invariant."""

    setup: _Setup

    def __init__(self) -> None:
        super().__init__()
        self.walk = _Walk(self.setup)

    @initialize(data=st.data())
    def choose_swarm(self, data: Any) -> None:
        self.walk.begin(Draws(data))

    @precondition(lambda self: not self.walk.found and not self.walk.failed)
    @rule(data=st.data())
    def step(self, data: Any) -> None:
        if not self.setup.swarm and not self.setup.steer:
            self.walk.step_uniform(data)
            return
        self.walk.draws = Draws(data)
        self.walk.step(True)

    @invariant()
    def monitor_is_clean(self) -> None:
        self.walk.check()

    def teardown(self) -> None:
        self.walk.teardown()


def _make_setup(
    model: Any,
    *,
    out: str | os.PathLike[str] | None,
    swarm: bool,
    steer: bool,
    quiesce: bool,
    backend: Callable[[Any], Any] | None,
    stats: FuzzStats | None,
) -> _Setup:
    from ..spec import HistoryHeader

    return _Setup(
        model=model,
        header=getattr(model, "header", None) or HistoryHeader(),
        canon=canonical_function(model),
        invariants=dict(getattr(model, "invariants", None) or {}),
        out=os.fspath(out) if out is not None else None,
        stats=stats if stats is not None else FuzzStats(),
        init=next(iter(model.initial_states())),
        backend=backend,
        swarm=swarm,
        steer=steer,
        quiesce=quiesce,
    )


#: the phases of Hypothesis a fuzz run uses: no explain phase (it took about
#: 95% of the time of a run that found a bug and changed nothing in the
#: shrunk history), and no shrink phase: the walk shrinks a failure itself,
#: exactly (_Shrinker), when it raises it
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)


def handoff_machine(
    model: Any,
    *,
    out: str | os.PathLike[str] | None = None,
    swarm: bool = True,
    steer: bool = True,
    quiesce: bool = True,
    backend: Callable[[Any], Any] | None = None,
    stats: FuzzStats | None = None,
) -> type[RuleBasedStateMachine]:
    """A Hypothesis ``RuleBasedStateMachine`` class that fuzzes ``model``.

    ``out``: where the failing history is written (rewritten at every
    failure, so after shrinking it holds the minimal one).  ``swarm``: draw
    per example which action kinds and fault kinds are hot, normal or off,
    how eager it is to inject faults and after how many progress steps.
    ``steer``: the walk goes to states no run has visited yet, backing up
    and routing to find them (a recorded choice means the same step on
    replay, so shrinking and the example database work).  ``quiesce``: when
    the system goes quiet (nothing enabled), apply the end-of-history checks
    (leak, stuck) and back up; at teardown, drive the current run to
    quiescence (progress actions only: deliver, time out, finish) and check
    it.  ``backend``: a factory ``backend(header)`` of a data-level backend
    (``apply(event, line) -> violations``, ``finish() -> violations``, e.g.
    :class:`pdproto.TorchBackend`); its findings fail the run like the
    monitor's.  ``stats``: share a :class:`FuzzStats` between machines.

    With ``swarm``, ``steer`` and ``quiesce`` all off the machine is the
    plain, uninstrumented baseline: one rule choosing uniformly among the
    enabled actions (``benchmarks/fuzz_speed.py`` compares against it).

    The class has ``.TestCase`` (a unittest case, for pytest; Hypothesis's
    explain phase is off), ``.stats`` (a :class:`FuzzStats` shared by its
    runs) and ``.model``.  :func:`pdproto.fuzz` runs the same walk faster,
    without the state machine's per-step rule machinery.
    """
    setup = _make_setup(
        model, out=out, swarm=swarm, steer=steer, quiesce=quiesce, backend=backend, stats=stats
    )
    name = f"Fuzz_{_ident(getattr(model, 'name', type(model).__name__))}"
    machine = type(HandoffMachine)(
        name, (HandoffMachine,), {"setup": setup, "stats": setup.stats, "model": model, "__qualname__": name}
    )
    machine.TestCase.settings = settings(  # type: ignore[attr-defined]
        machine.TestCase.settings,  # type: ignore[attr-defined]
        deadline=None,
        phases=[p for p in machine.TestCase.settings.phases if p is not Phase.explain],  # type: ignore[attr-defined]
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    return machine


def uniform_machine(model: Any, **kwargs: Any) -> type[RuleBasedStateMachine]:
    """The uninstrumented baseline: one rule drawing uniformly among the
    enabled actions (``st.sampled_from``), no swarm, no steering, no
    quiescence.  For comparisons (``benchmarks/fuzz_speed.py``)."""
    return handoff_machine(model, swarm=False, steer=False, quiesce=False, **kwargs)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _example(setup: _Setup, data: Any, steps: int) -> None:
    """One example of :func:`run_machine`: the walk's seed and swarm (its
    only recorded choices: a step's choice is the walk's, and a failure is
    shrunk by :class:`_Shrinker`, not by Hypothesis), ``steps`` steps, then
    teardown."""
    walk = _Walk(setup)
    try:
        walk.begin(Draws(data))
        walk.check()
        for _ in range(steps):
            walk.step(False)
            walk.check()
    finally:
        walk.teardown()


def run_machine(
    model: Any,
    *,
    examples: int,
    steps: int,
    seed: int | None,
    out: str | None,
    database: str | None,
    identity: str,
    backend: Callable[[Any], Any] | None,
    stats: FuzzStats,
    explain: bool = False,
    phase_seconds: dict[str, float] | None = None,
    seeded_database: bool = False,
) -> HandoffFailure | None:
    """Run ``model``'s walk for ``examples`` examples of at most ``steps``
    steps; the (shrunk) failure, or None.  Anything else it raises
    propagates.  ``phase_seconds`` receives the wall seconds of each of
    Hypothesis's phases.

    A seeded run uses no database (Hypothesis's ``@seed`` turns it off), so
    the same seed gives the same run whatever an earlier run saved;
    ``seeded_database`` keeps the database on for a seeded run (what each
    worker of a parallel run does: the workers share one database, issue 16).
    Exactly repeatable without a database: the same seed, model and
    settings give the same examples in the same order (Hypothesis stops
    generating at the first failure, rather than hunting for more bugs for
    up to ten seconds of wall time)."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    setup = _make_setup(model, out=out, swarm=True, steer=True, quiesce=True, backend=backend, stats=stats)
    db = DirectoryBasedExampleDatabase(database) if database is not None else None

    @settings(
        max_examples=examples,
        deadline=None,
        database=namespaced_database(db, identity),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
        phases=list(Phase) if explain else list(PHASES),
    )
    @given(st.data())
    def fuzz_model(data: Any) -> None:
        _example(setup, data, steps)

    test = hseed(seed)(fuzz_model) if seed is not None else fuzz_model
    if seed is not None and db is not None and seeded_database:
        # Hypothesis's @seed turns the database off; a worker of a parallel
        # run still replays and saves failures (issue 16)
        test._hypothesis_internal_use_settings = settings(  # type: ignore[attr-defined]
            test._hypothesis_internal_use_settings, database=namespaced_database(db, identity)
        )  # type: ignore[attr-defined]
    with phase_statistics() as seconds:
        try:
            test()
        except Exception as exc:
            failure = pick_failure(exc)
            if failure is None:
                raise
            return failure
        finally:
            if phase_seconds is not None:
                phase_seconds.update(_phases(seconds, setup.shrink_seconds))
    return None


def _no_quiescence(line: int) -> Violation:
    """The failure of a run whose teardown never let the system go quiet."""
    return Violation("no-quiescence", line, f"the system did not go quiet within {QUIESCE_LIMIT} steps")


def _phases(hypothesis: dict[str, float], shrink: float) -> dict[str, float]:
    """Hypothesis's phase seconds with the walk's own shrinking moved to
    ``shrink`` (it runs inside the example that failed: in the generate
    phase, or in the reuse phase when the failure came from the database)."""
    out = dict(hypothesis)
    where = "generate" if out.get("generate", 0.0) >= shrink else "reuse"
    out[where] = max(0.0, out.get(where, 0.0) - shrink)
    out["shrink"] = out.get("shrink", 0.0) + shrink
    return out


__all__ = ["HandoffMachine", "handoff_machine", "uniform_machine", "run_machine", "QUIESCE_LIMIT", "PHASES"]
