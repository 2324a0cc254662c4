"""The Hypothesis state machine that fuzzes a model (imports Hypothesis).

:func:`handoff_machine` makes a subclass of :class:`HandoffMachine` bound to
one model (its :class:`_Setup`); :func:`run_machine` runs it under given
settings and returns the failure found, if any.  How a run explores (swarm,
steering, backtracking, quiescence) is told in docs/testing.md.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any, Callable, Sequence

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

from ..protocol._model import Action
from ..spec._events import Event
from ..spec._history import write_history
from ..spec._monitor import Monitor, Violation
from ._fuzz import FuzzStats, HandoffFailure, canonical_function, fault_kind, pick_failure
from ._hypothesis import namespaced_database, weighted_index

#: How many progress steps teardown takes at most to reach quiescence.
QUIESCE_LIMIT = 10_000
#: the share of fresh choices left to the example's pseudo-random walk
WALK_SHARE = 64.0
#: how many walk decisions are remembered; past it the walk stops looking at
#: what other runs visited (so that every decision stays replayable)
DECISION_LIMIT = 2_000_000
#: how much steering prefers an action leading to a state this example has not seen
STEER_BOOST = 8.0
#: swarm levels of an action kind: its weight relative to the others
_LEVELS = (1.0, 4.0, 0.02)  # normal, hot, off (only as a last resort)
#: how likely a step is a fault, when faults and progress are both enabled
_FAULT_RATES = (0.3, 0.1, 0.5, 0.7)


@attrs.define
class _Setup:
    """What every run of one machine class shares."""

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
    #: (walk seed, state) -> the walk's pick: see HandoffMachine._walk_choice
    decisions: dict = attrs.field(factory=dict)


class HandoffMachine(RuleBasedStateMachine):
    """Fuzzes ``setup.model`` (a subclass made by :func:`handoff_machine`
    sets ``setup``).  Each example draws a swarm, then takes steps; after
    each, the monitor and the model's state invariants are asked."""

    setup: _Setup

    def __init__(self) -> None:
        super().__init__()
        fz = self.setup
        self._t0 = time.perf_counter()
        self.level: dict[str, float] = {}
        self.fault_rate = 0.0 if not fz.swarm else _FAULT_RATES[0]
        self.fault_delay = 0
        self.found: list[Violation] = []
        self.episodes_here = 0
        self.seen: set = set()  # states this example visited: what steering avoids
        self.new_global = 0
        fz.stats.examples += 1
        self._new_episode()

    # -- helpers -------------------------------------------------------------

    def _new_episode(self, at: int = 0) -> None:
        """Start an episode: from the initial state, or (``at`` > 0) from
        step ``at`` of the episode that just ended (its history up to there
        is kept and re-fed to a fresh monitor: no model step)."""
        fz = self.setup
        if at:
            self.trace = self.trace[:at]
            self.events = self.events[: self.path_events[at]]
            self.path_states = self.path_states[: at + 1]
            self.path_events = self.path_events[: at + 1]
            self.state = self.path_states[at]
        else:
            self.state = fz.init
            self.trace: list[tuple[str, Action, tuple[Event, ...]]] = []
            self.events: list[Event] = []
            self.path_states = [fz.init]  # the state after each step of the episode
            self.path_events = [0]  # len(events) after each step
        # a fresh monitor (and backend) replays the history kept so far
        header = fz.header
        self.monitor = Monitor(header.policy, complete=True, workers=header.workers)
        self.backend = fz.backend(header) if fz.backend is not None else None
        for line, event in enumerate(self.events, 2):
            self.monitor.feed(event, line)
            if self.backend is not None:
                self.backend.apply(event, line)
        self.episode_steps = at
        self.episodes_here += 1
        fz.stats.episodes += 1
        self._visit(self.state)

    def _visit(self, state: Any) -> None:
        key = self.setup.canon(state)
        states = self.setup.stats.states
        if key not in states:
            states.add(key)
            self.new_global += 1
        self.seen.add(key)

    def _take(self, action: Action, nxt: Any = None) -> None:
        fz = self.setup
        stats = fz.stats
        if nxt is None:
            nxt = fz.model.step(self.state, action)
        state, events = nxt
        self.state = state
        self.trace.append((getattr(action, "actor", "?"), action, tuple(events)))
        self.episode_steps += 1
        stats.steps += 1
        if stats.steps % stats.curve_every == 0:
            stats.curve.append((stats.steps, len(stats.states)))
        stats.actions[action.kind] += 1
        if action.fault:
            stats.faults[fault_kind(action)] += 1
        for event in events:
            self.events.append(event)
            line = len(self.events) + 1  # the header is line 1
            self.found.extend(self.monitor.feed(event, line))
            if self.backend is not None:
                self.found.extend(self.backend.apply(event, line))
        self._visit(state)
        self.path_states.append(state)
        self.path_events.append(len(self.events))

    def _fail(self, violation: Violation, complete: bool = False) -> None:
        # a history cut at a safety violation is not complete: leak and
        # stuck apply only to one that ran until the system went quiet
        fz = self.setup
        written = attrs.evolve(fz.header, complete=complete)
        if fz.out is not None:
            write_history(fz.out, self.events, written)
        failure = HandoffFailure(violation, self.trace, fz.out, self.events, written)
        fz.stats.failure = failure
        if fz.stats.found_at is None:
            fz.stats.found_at = fz.stats.examples
        raise failure

    def _end_of_history(self) -> None:
        """The system is quiet: the end-of-history checks."""
        end = self.monitor.end_violations()
        if end:
            self._fail(end[0], complete=True)
        if self.backend is not None:
            data = self.backend.finish()
            if data:
                self._fail(data[0], complete=True)

    def _level(self, kind: str, data: Any) -> float:
        level = self.level.get(kind)
        if level is None:
            if self.setup.swarm:
                level = _LEVELS[data.draw(st.integers(0, 2), label=f"swarm: {kind}")]
            else:
                level = 1.0
            self.level[kind] = level
        return level

    # -- rules ---------------------------------------------------------------

    @initialize(data=st.data())
    def choose_swarm(self, data: Any) -> None:
        # first, so that it varies even where Hypothesis fills the rest of
        # an example with its simplest choices
        self.walk = data.draw(st.integers(0, 2**32 - 1), label="walk seed")
        if self.setup.swarm:
            self.fault_rate = _FAULT_RATES[data.draw(st.integers(0, 3), label="swarm: fault rate")]
            self.fault_delay = data.draw(st.integers(0, 3), label="swarm: progress first") * 4

    @precondition(lambda self: not self.found)
    @rule(data=st.data())
    def step(self, data: Any) -> None:
        if not self.setup.swarm and not self.setup.steer:
            self._step_uniform(data)
            return
        for _ in range(1000):  # backtracking takes no model step
            if self._step_weighted(data):
                return

    def _step_uniform(self, data: Any) -> None:
        """The uninstrumented baseline: a uniform draw among the enabled actions."""
        model = self.setup.model
        enabled = model.actions(self.state)
        if not enabled:
            if not self.setup.quiesce:
                return
            self._end_of_history()
            self._new_episode()
            enabled = model.actions(self.state)
        if enabled:
            self._take(data.draw(st.sampled_from(enabled), label="action"))

    def _step_weighted(self, data: Any) -> bool:
        """One step by swarm and steering weights; False when it backtracked
        instead (the caller tries again), True when done."""
        fz = self.setup
        enabled = fz.model.actions(self.state)
        if not enabled:
            if not fz.quiesce:
                return True
            self._end_of_history()
            return not self._backtrack()
        n = len(enabled)
        succ: list = [None] * n
        idx: Sequence[int] = range(n)
        if fz.steer:
            for i, a in enumerate(enabled):
                succ[i] = fz.model.step(self.state, a)
            fresh = [i for i in range(n) if fz.canon(succ[i][0]) not in self.seen]
            if not fresh and self._backtrack():
                return False
            idx = fresh or idx
        weights = self._swarm_weights(enabled, data) if fz.swarm else [1.0] * n
        walk_w = [weights[i] for i in idx]
        if fz.steer and len(idx) < n:
            for i in idx:
                weights[i] *= STEER_BOOST
        # choice 0: the example's own pseudo-random walk among the candidates
        # (seeded by a drawn seed, weighted by the swarm); choice i > 0:
        # enabled[i - 1], whatever steering says, so a shrunk example keeps
        # its meaning.  The weights only shape fresh generation.
        total = sum(weights)
        v = weighted_index(data, [total * WALK_SHARE] + weights, "action")
        i = self._walk_choice(idx, walk_w, succ if fz.steer else None) if v == 0 else v - 1
        # every choice re-seeds the walk: examples that Hypothesis derives
        # from one another by changing a choice part ways there
        self.walk = hash((self.walk, v, n))
        self._take(enabled[i], succ[i])
        return True

    def _swarm_weights(self, enabled: Sequence[Action], data: Any) -> list[float]:
        """Each enabled action's weight: the fault rate shared among faults,
        the rest among progress actions, times its kind's swarm level."""
        counts = collections.Counter(a.kind for a in enabled)
        nfault = sum(1 for a in enabled if a.fault)
        rate = 0.0 if self.episode_steps < self.fault_delay else self.fault_rate
        if nfault == len(enabled):
            rate = 1.0
        elif nfault == 0:
            rate = 0.0
        weights = []
        for a in enabled:
            share = rate if a.fault else 1.0 - rate
            weights.append(share * self._level(a.kind + ("!" if a.fault else ""), data) / counts[a.kind])
        return weights

    def _walk_choice(self, idx: Sequence[int], w: list[float], succ: list | None) -> int:
        """The walk's pick among the candidates ``idx``: toward a state no
        run has visited yet when there is one, else by the weights.

        Using what other runs visited would make a run depend on more than
        its own choices, and Hypothesis must be able to replay a choice
        sequence exactly (to shrink a failure).  So each decision is
        remembered under the walk's seed (which encodes every choice of the
        run so far) and the state: replaying a choice sequence replays the
        same decisions, whatever has been visited since.  Once a run failed,
        new decisions no longer look at novelty (they would lead the
        shrinker's candidates away from the failure)."""
        fz = self.setup
        decisions, canon = fz.decisions, fz.canon
        key = (self.walk, canon(self.state))
        i = decisions.get(key)
        if i is not None:
            return i
        rng = random.Random(self.walk)
        pool, weights = list(idx), w
        if succ is not None and fz.stats.failure is None and len(decisions) < DECISION_LIMIT:
            states = fz.stats.states
            new = [(j, wj) for j, wj in zip(idx, w) if canon(succ[j][0]) not in states]
            if new:
                pool, weights = [j for j, _ in new], [wj for _, wj in new]
        i = pool[rng.choices(range(len(pool)), weights=weights if sum(weights) > 0 else None)[0]]
        if len(decisions) < DECISION_LIMIT:
            decisions[key] = i
        return i

    def _backtrack(self) -> bool:
        """Go back one or two steps of the episode (nothing new ahead, or the
        system went quiet): the search goes on next to where it was, deep in
        the state space, instead of from the initial state.  False when there
        is nowhere to go back to."""
        if not self.trace:
            return False
        back = 1 + (self.walk & 1)
        self.walk = hash((self.walk, -1))
        self._new_episode(max(0, len(self.trace) - back))
        return True

    @invariant()
    def monitor_is_clean(self) -> None:
        if self.found:
            self._fail(self.found[0])
        for name, holds in self.setup.invariants.items():
            if not holds(self.state):
                self._fail(
                    Violation(f"model:{name}", len(self.events) + 1,
                              f"the model's state invariant {name!r} does not hold")
                )

    def teardown(self) -> None:
        try:
            if self.setup.quiesce and not self.found and (self.episode_steps or self.episodes_here == 1):
                self._quiesce()
        finally:
            self.setup.stats.seconds += time.perf_counter() - self._t0

    def _quiesce(self) -> None:
        model = self.setup.model
        for _ in range(QUIESCE_LIMIT):
            enabled = model.actions(self.state)
            if not enabled:
                break
            progress = [a for a in enabled if not a.fault]
            if not progress:  # only faults are left: the system is quiet
                break
            self._take(progress[0])
            self.setup.stats.teardown_steps += 1
            self.monitor_is_clean()
        else:
            self._fail(Violation("no-quiescence", len(self.events) + 1,
                                 f"the system did not go quiet within {QUIESCE_LIMIT} steps"))
        self._end_of_history()


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
    ``steer``: weight the choice toward actions whose next state no run has
    visited yet (the weights only bias generation: a drawn choice means the
    same action on replay, so shrinking and the example database work).
    ``quiesce``: when the system goes quiet (nothing enabled), apply the
    end-of-history checks (leak, stuck) and start a new episode from the
    initial state; at teardown, drive the current episode to quiescence
    (progress actions only: deliver, time out, finish) and check it.
    ``backend``: a factory ``backend(header)`` of a data-level backend
    (``apply(event, line) -> violations``, ``finish() -> violations``, e.g.
    :class:`pdproto.TorchBackend`); its findings fail the run like the
    monitor's.  ``stats``: share a :class:`FuzzStats` between machines.

    With ``swarm``, ``steer`` and ``quiesce`` all off the machine is the
    plain, uninstrumented baseline: one rule choosing uniformly among the
    enabled actions (``benchmarks/fuzz_speed.py`` compares against it).

    The class has ``.TestCase`` (a unittest case, for pytest), ``.stats``
    (a :class:`FuzzStats` shared by its runs) and ``.model``.
    """
    from ..spec._history import HistoryHeader

    stats = stats if stats is not None else FuzzStats()
    setup = _Setup(
        model=model, header=getattr(model, "header", None) or HistoryHeader(),
        canon=canonical_function(model), invariants=dict(getattr(model, "invariants", None) or {}),
        out=os.fspath(out) if out is not None else None, stats=stats,
        init=next(iter(model.initial_states())), backend=backend,
        swarm=swarm, steer=steer, quiesce=quiesce,
    )
    name = f"Fuzz_{_ident(getattr(model, 'name', type(model).__name__))}"
    machine = type(HandoffMachine)(name, (HandoffMachine,), {"setup": setup, "stats": stats, "model": model,
                                                             "__qualname__": name})
    machine.TestCase.settings = settings(  # type: ignore[attr-defined]
        machine.TestCase.settings,  # type: ignore[attr-defined]
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                               HealthCheck.data_too_large],
    )
    return machine


def uniform_machine(model: Any, **kwargs: Any) -> type[RuleBasedStateMachine]:
    """The uninstrumented baseline: one rule drawing uniformly among the
    enabled actions (``st.sampled_from``), no swarm, no steering, no
    quiescence.  For comparisons (``benchmarks/fuzz_speed.py``)."""
    return handoff_machine(model, swarm=False, steer=False, quiesce=False, **kwargs)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def run_machine(model: Any, *, examples: int, steps: int, seed: int | None, out: str | None,
                database: str | None, identity: str, backend: Callable[[Any], Any] | None,
                stats: FuzzStats, explain: bool = False) -> HandoffFailure | None:
    """Run ``model``'s machine for ``examples`` examples of ``steps`` steps;
    the (shrunk) failure, or None.  Anything else it raises propagates."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    machine = handoff_machine(model, out=out, backend=backend, stats=stats)
    db = DirectoryBasedExampleDatabase(database) if database is not None else None
    test = get_state_machine_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=namespaced_database(db, identity),
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            phases=[p for p in Phase if explain or p is not Phase.explain],
        ),
    )
    if seed is not None:
        test = hseed(seed)(test)
    try:
        test()
    except Exception as exc:
        failure = pick_failure(exc)
        if failure is None:
            raise
        return failure
    return None


__all__ = ["HandoffMachine", "handoff_machine", "uniform_machine", "run_machine", "QUIESCE_LIMIT"]
