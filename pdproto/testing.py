"""Randomised stateful testing of handoff models with Hypothesis.

Exhaustive checking (``pdproto check``) covers small configurations; this
module drives any model that follows the model interface (``actions`` /
``step``, see docs/modeling.md) through Hypothesis's stateful testing, over
configurations too large to enumerate, and feeds every step's events to the
:class:`~pdproto.Monitor`.

.. code-block:: python

    from pdproto.testing import handoff_machine
    from pdproto import HandoffModel, ModelConfig

    TestReference = handoff_machine(HandoffModel(ModelConfig(requests=4))).TestCase

Each example:

1. starts from the model's first initial state with a fresh monitor;
2. draws a *swarm* (which fault kinds are on in this example, and how eager
   it is to inject them) so that different examples stress different faults;
3. takes steps: each step draws one of the enabled actions, preferring
   actions that lead to a state this example has not visited yet;
4. after every step, the invariant asks the monitor (and the model's own
   state invariants, if any);
5. at teardown drives the system to quiescence with progress actions only
   (deliver, time out, finish) and applies the end-of-history checks, so
   leaks and stuck requests are found too.

A failure raises :class:`HandoffFailure` (an AssertionError) whose message is
the monitor's violation and a numbered step table; the history is written
where ``out`` says, so ``pdproto audit`` and ``pdproto replay`` take it.

Importing this module imports Hypothesis; ``import pdproto`` does not.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any, Callable, Hashable, Iterable, Sequence

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .protocol._config import FAULT_KINDS, ModelConfig
from .spec._events import Event
from .spec._history import write_history
from .protocol._model import Action
from .spec._monitor import Monitor, Violation

__all__ = [
    "HandoffFailure",
    "pick_failure",
    "FuzzStats",
    "handoff_machine",
    "uniform_machine",
    "reachable_states",
    "canonical_function",
    "format_steps",
    "configs",
    "fault_budgets",
    "PROFILES",
    "register_profiles",
]

#: How many progress steps teardown takes at most to reach quiescence.
QUIESCE_LIMIT = 10_000


class HandoffFailure(AssertionError):
    """A fuzzed run broke an invariant.

    ``violation`` is the monitor's report (or a model state invariant, with
    invariant id ``"model:<name>"``, or ``"no-quiescence"``), ``trace`` the
    steps as ``(actor, action, events)``, ``history`` the path it was
    written to (None when no ``out`` was given).
    """

    def __init__(self, violation: Violation, trace: Sequence[tuple[str, Action, tuple[Event, ...]]],
                 history: str | None, events: Sequence[Event] = (), header: Any = None) -> None:
        self.violation = violation
        self.trace = tuple(trace)
        self.history = history
        #: the history of the failing run and its header (``complete`` only
        #: for a failure found at the end of a run that went quiet)
        self.events = tuple(events)
        self.header = header
        table = format_steps(self.trace)
        where = f"\nhistory written to {history}" if history else ""
        super().__init__(
            f"{violation.invariant} at step {len(self.trace)} (history line {violation.line}): "
            f"{violation.message}\n{table}{where}"
        )


def pick_failure(exc: BaseException) -> HandoffFailure | None:
    """The failure to report from what a Hypothesis run raised: the
    HandoffFailure itself, or, when Hypothesis found several distinct bugs
    (an exception group), the one with the shortest trace.  None when the
    run raised something else."""
    if isinstance(exc, HandoffFailure):
        return exc
    group = getattr(exc, "exceptions", None)
    if group:
        found = [f for f in (pick_failure(e) for e in group) if f is not None]
        if found:
            return min(found, key=lambda f: len(f.trace))
    return None


def format_steps(trace: Sequence[tuple[str, Action, tuple[Event, ...]]]) -> str:
    """A numbered plain-text step table: actor, action, events."""
    rows = []
    for i, (actor, action, events) in enumerate(trace, 1):
        fault = " [fault]" if action.fault else ""
        evs = "; ".join(f"{e.EV}" + _event_brief(e) for e in events) or "-"
        rows.append(f"{i:>4}  {actor:<7} {action!s}{fault:<8}  {evs}")
    return "\n".join(rows)


def _event_brief(event: Event) -> str:
    d = event.to_dict()
    d.pop("ev")
    return "(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"


#: action kinds whose fault flavour belongs to a fault kind of FAULT_KINDS
#: under another name (the reference model's vocabulary)
FAULT_ACTION_KINDS = {
    "lose": "loss",
    "deliver": "reorder",
    "xfer_fail": "transfer_fail",
    "p_lease": "timeout",
}


def fault_kind(action: Action) -> str:
    """The fault kind (a :data:`~pdproto.FAULT_KINDS` name when it maps to
    one) of a fault action."""
    return FAULT_ACTION_KINDS.get(action.kind, action.kind)


@attrs.define
class FuzzStats:
    """Coverage and speed of the fuzzing runs of one machine class.

    ``states`` holds the distinct model states visited, by their canonical
    form (:func:`canonical_function`: the explorer's symmetry reduction when
    the model offers it).  ``steps`` counts every model step taken, those of
    the rules and those teardown takes to reach quiescence
    (``teardown_steps``).  ``actions`` and ``faults`` count the steps of each
    action kind and fault kind.  ``reachable`` (set by the caller, e.g. from
    :func:`reachable_states`) is the number of reachable states when the
    configuration is small enough to count them; ``coverage`` is then
    ``distinct_states / reachable``.  ``curve`` samples ``(steps,
    distinct_states)`` every ``curve_every`` steps.
    """

    examples: int = 0
    steps: int = 0
    teardown_steps: int = 0
    episodes: int = 0
    seconds: float = 0.0
    states: set = attrs.field(factory=set, repr=False)
    actions: collections.Counter = attrs.field(factory=collections.Counter)
    faults: collections.Counter = attrs.field(factory=collections.Counter)
    failure: HandoffFailure | None = None
    #: the example (counting from 1) that first failed; later ones are shrinking
    found_at: int | None = None
    reachable: int | None = None
    curve: list = attrs.field(factory=list, repr=False)
    curve_every: int = 500

    @property
    def distinct_states(self) -> int:
        return len(self.states)

    @property
    def coverage(self) -> float | None:
        """Fraction of the reachable states visited (None when unknown)."""
        if not self.reachable:
            return None
        return len(self.states) / self.reachable

    def distinct_at(self, steps: int) -> int:
        """Distinct states when ``steps`` model steps had been taken (from
        :attr:`curve`; the current count if the run did not get that far)."""
        for s, n in self.curve:
            if s >= steps:
                return n
        return len(self.states)

    def to_dict(self) -> dict[str, Any]:
        cov = self.coverage
        return {
            "examples": self.examples,
            "steps": self.steps,
            "teardown_steps": self.teardown_steps,
            "episodes": self.episodes,
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "examples_per_second": round(self.examples / self.seconds, 2) if self.seconds else 0.0,
            "distinct_states": self.distinct_states,
            "reachable_states": self.reachable,
            "coverage": None if cov is None else round(cov, 5),
            "action_kinds": dict(sorted(self.actions.items())),
            "fault_kinds": dict(sorted(self.faults.items())),
            "found_at_example": self.found_at,
        }


def canonical_function(model: Any) -> Callable[[Any], Hashable]:
    """The state's canonical form for counting distinct states: the model's
    ``symmetry(state)[0]`` or ``canonical(state)``, else the state itself
    (the same form :func:`pdproto._explore.explore` keys model states by)."""
    sym = getattr(model, "symmetry", None)
    if callable(sym):
        return lambda s: sym(s)[0]
    canon = getattr(model, "canonical", None)
    if callable(canon):
        return canon
    return lambda s: s


def reachable_states(model: Any, max_states: int = 2_000_000) -> int | None:
    """The number of distinct reachable model states (canonical form, no
    monitor), by a breadth-first search with
    :func:`pdproto._explore.explore`; None when there are more than
    ``max_states``.  This is what :attr:`FuzzStats.coverage` divides by:
    the explorer's own ``states`` count pairs each model state with a
    monitor state, which fuzzing does not count."""
    from .drivers._explore import explore

    result = explore(model, monitor=False, check_deadlock=False, max_states=max_states,
                     stop_on_first=False)
    if result.truncated or not result.complete:
        return None
    return result.states


def _weighted_index(data: Any, weights: Sequence[float], label: str) -> int:
    """Draw an index into a list of ``len(weights)`` candidates.

    The *meaning* of the drawn value is the index alone (so a replayed or
    shrunk example means the same thing whatever the weights are); the
    weights only shape how often fresh examples pick each index.  Uses
    Hypothesis's weighted integer draw, and a plain uniform draw where it is
    not available."""
    n = len(weights)
    if n == 1:
        return 0
    total = sum(weights)
    if total > 0 and n <= 255 and _WEIGHTED[0]:
        scale = 0.96 / total  # the rest: uniform over every index
        w = {i: x * scale for i, x in enumerate(weights) if x > 0}
        try:
            return data.conjecture_data.draw_integer(0, n - 1, weights=w)
        except (AttributeError, TypeError):  # another Hypothesis: no weighted draw
            _WEIGHTED[0] = False
    return data.draw(st.integers(0, n - 1), label=label)


_WEIGHTED = [True]
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
    :class:`pdproto._torch_backend.TorchBackend`); its findings fail the run
    like the monitor's.  ``stats``: share a :class:`FuzzStats` between
    machines.

    With ``swarm``, ``steer`` and ``quiesce`` all off the machine is the
    plain, uninstrumented baseline: one rule choosing uniformly among the
    enabled actions (``benchmarks/fuzz_speed.py`` compares against it).

    The class has ``.TestCase`` (a unittest case, for pytest), ``.stats``
    (a :class:`FuzzStats` shared by its runs) and ``.model``.
    """
    header = model.header
    canon = canonical_function(model)
    invariants = dict(getattr(model, "invariants", None) or {})
    out_path = os.fspath(out) if out is not None else None
    stats = stats if stats is not None else FuzzStats()
    init = next(iter(model.initial_states()))
    states = stats.states
    curve = stats.curve
    decisions: dict = {}  # (walk seed, state) -> the walk's pick: see _walk_choice

    class HandoffMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self._t0 = time.perf_counter()
            self.level: dict[str, float] = {}
            self.fault_rate = 0.0 if not swarm else _FAULT_RATES[0]
            self.fault_delay = 0
            self.found: list[Violation] = []
            self.episodes_here = 0
            self.seen: set = set()  # states this example visited: what steering avoids
            self.new_global = 0
            stats.examples += 1
            self._new_episode()

        # -- helpers ---------------------------------------------------------

        def _new_episode(self, at: int = 0) -> None:
            """Start an episode: from the initial state, or (``at`` > 0) from
            step ``at`` of the episode that just ended (its history up to
            there is kept and re-fed to a fresh monitor: no model step)."""
            if at:
                self.trace = self.trace[:at]
                self.events = self.events[: self.path_events[at]]
                self.path_states = self.path_states[: at + 1]
                self.path_events = self.path_events[: at + 1]
                self.state = self.path_states[at]
            else:
                self.state = init
                self.trace: list[tuple[str, Action, tuple[Event, ...]]] = []
                self.events: list[Event] = []
                self.path_states = [init]  # the state after each step of the episode
                self.path_events = [0]  # len(events) after each step
            # a fresh monitor (and backend) replays the history kept so far
            self.monitor = Monitor(header.policy, complete=True, workers=header.workers)
            self.backend = backend(header) if backend is not None else None
            for line, event in enumerate(self.events, 2):
                self.monitor.feed(event, line)
                if self.backend is not None:
                    self.backend.apply(event, line)
            self.episode_steps = at
            self.episodes_here += 1
            stats.episodes += 1
            self._visit(self.state)

        def _visit(self, state: Any) -> None:
            key = canon(state)
            if key not in states:
                states.add(key)
                self.new_global += 1
            self.seen.add(key)

        def _take(self, action: Action, nxt: Any = None) -> None:
            if nxt is None:
                nxt = model.step(self.state, action)
            state, events = nxt
            self.state = state
            self.trace.append((action.actor, action, tuple(events)))
            self.episode_steps += 1
            stats.steps += 1
            if stats.steps % stats.curve_every == 0:
                curve.append((stats.steps, len(states)))
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
            written = attrs.evolve(header, complete=complete)
            if out_path is not None:
                write_history(out_path, self.events, written)
            failure = HandoffFailure(violation, self.trace, out_path, self.events, written)
            stats.failure = failure
            if stats.found_at is None:
                stats.found_at = stats.examples
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
                if swarm:
                    level = _LEVELS[data.draw(st.integers(0, 2), label=f"swarm: {kind}")]
                else:
                    level = 1.0
                self.level[kind] = level
            return level

        # -- rules -----------------------------------------------------------

        @initialize(data=st.data())
        def choose_swarm(self, data: Any) -> None:
            # first, so that it varies even where Hypothesis fills the rest of
            # an example with its simplest choices
            self.walk = data.draw(st.integers(0, 2**32 - 1), label="walk seed")
            if swarm:
                self.fault_rate = _FAULT_RATES[data.draw(st.integers(0, 3), label="swarm: fault rate")]
                self.fault_delay = data.draw(st.integers(0, 3), label="swarm: progress first") * 4

        @precondition(lambda self: not self.found)
        @rule(data=st.data())
        def step(self, data: Any) -> None:
            if not swarm and not steer:
                enabled = model.actions(self.state)
                if not enabled:
                    if not quiesce:
                        return
                    self._end_of_history()
                    self._new_episode()
                    enabled = model.actions(self.state)
                if enabled:
                    self._take(data.draw(st.sampled_from(enabled), label="action"))
                return
            for _ in range(1000):  # backtracking takes no model step
                enabled = model.actions(self.state)
                if not enabled:
                    if not quiesce:
                        return
                    self._end_of_history()
                    if not self._backtrack():
                        return
                    continue
                n = len(enabled)
                succ: list = [None] * n
                idx: Sequence[int] = range(n)
                if steer:
                    seen = self.seen
                    for i, a in enumerate(enabled):
                        succ[i] = model.step(self.state, a)
                    fresh = [i for i in range(n) if canon(succ[i][0]) not in seen]
                    if not fresh and self._backtrack():
                        continue
                    idx = fresh or idx
                weights = [1.0] * n
                if swarm:
                    counts = collections.Counter(a.kind for a in enabled)
                    nfault = sum(1 for a in enabled if a.fault)
                    rate = 0.0 if self.episode_steps < self.fault_delay else self.fault_rate
                    if nfault == n:
                        rate = 1.0
                    elif nfault == 0:
                        rate = 0.0
                    for i, a in enumerate(enabled):
                        share = rate if a.fault else 1.0 - rate
                        weights[i] = share * self._level(a.kind + ("!" if a.fault else ""), data) / counts[a.kind]
                walk_w = [weights[i] for i in idx]
                if steer and len(idx) < n:
                    for i in idx:
                        weights[i] *= STEER_BOOST
                # choice 0: the example's own pseudo-random walk among the
                # candidates (seeded by a drawn seed, weighted by the swarm);
                # choice i > 0: enabled[i - 1], whatever steering says, so a
                # shrunk example keeps its meaning.  The weights only shape
                # fresh generation.
                total = sum(weights)
                v = _weighted_index(data, [total * WALK_SHARE] + weights, "action")
                if v == 0:
                    i = self._walk_choice(idx, walk_w, succ if steer else None)
                else:
                    i = v - 1
                # every choice re-seeds the walk: examples that Hypothesis
                # derives from one another by changing a choice part ways there
                self.walk = hash((self.walk, v, n))
                self._take(enabled[i], succ[i])
                return

        def _walk_choice(self, idx: Sequence[int], w: list[float], succ: list | None) -> int:
            """The walk's pick among the candidates ``idx``: toward a state no
            run has visited yet when there is one, else by the weights.

            Using what other runs visited would make a run depend on more than
            its own choices, and Hypothesis must be able to replay a choice
            sequence exactly (to shrink a failure).  So each decision is
            remembered under the walk's seed (which encodes every choice of the
            run so far) and the state: replaying a choice sequence replays the
            same decisions, whatever has been visited since.  Once a run
            failed, new decisions no longer look at novelty (they would lead
            the shrinker's candidates away from the failure)."""
            key = (self.walk, canon(self.state))
            i = decisions.get(key)
            if i is not None:
                return i
            rng = random.Random(self.walk)
            pool, weights = list(idx), w
            # after a failure, shrinking is under way: novelty would only lead
            # new choice sequences away from it
            if succ is not None and stats.failure is None and len(decisions) < DECISION_LIMIT:
                new = [(j, wj) for j, wj in zip(idx, w) if canon(succ[j][0]) not in states]
                if new:
                    pool, weights = [j for j, _ in new], [wj for _, wj in new]
            i = pool[rng.choices(range(len(pool)), weights=weights if sum(weights) > 0 else None)[0]]
            if len(decisions) < DECISION_LIMIT:
                decisions[key] = i
            return i

        def _backtrack(self) -> bool:
            """Go back one or two steps of the episode (nothing new ahead, or
            the system went quiet): the search goes on next to where it was,
            deep in the state space, instead of from the initial state.
            False when there is nowhere to go back to."""
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
            for name, holds in invariants.items():
                if not holds(self.state):
                    self._fail(
                        Violation(f"model:{name}", len(self.events) + 1,
                                  f"the model's state invariant {name!r} does not hold")
                    )

        def teardown(self) -> None:
            try:
                if quiesce and not self.found and (self.episode_steps or self.episodes_here == 1):
                    self._quiesce()
            finally:
                stats.seconds += time.perf_counter() - self._t0

        def _quiesce(self) -> None:
            for _ in range(QUIESCE_LIMIT):
                enabled = model.actions(self.state)
                if not enabled:
                    break
                progress = [a for a in enabled if not a.fault]
                if not progress:  # only faults are left: the system is quiet
                    break
                self._take(progress[0])
                stats.teardown_steps += 1
                self.monitor_is_clean()
            else:
                self._fail(Violation("no-quiescence", len(self.events) + 1,
                                     f"the system did not go quiet within {QUIESCE_LIMIT} steps"))
            self._end_of_history()

    HandoffMachine.__name__ = HandoffMachine.__qualname__ = f"Fuzz_{_ident(model.name)}"
    HandoffMachine.stats = stats  # type: ignore[attr-defined]
    HandoffMachine.model = model  # type: ignore[attr-defined]
    HandoffMachine.TestCase.settings = settings(  # type: ignore[attr-defined]
        HandoffMachine.TestCase.settings,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                               HealthCheck.data_too_large],
    )
    return HandoffMachine


def uniform_machine(model: Any, **kwargs: Any) -> type[RuleBasedStateMachine]:
    """The uninstrumented baseline: one rule drawing uniformly among the
    enabled actions (``st.sampled_from``), no swarm, no steering, no
    quiescence.  For comparisons (``benchmarks/fuzz_speed.py``)."""
    return handoff_machine(model, swarm=False, steer=False, quiesce=False, **kwargs)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


# -- strategies ------------------------------------------------------------------


def fault_budgets(max_budget: int = 2) -> st.SearchStrategy[dict[str, int]]:
    """Fault budgets: each kind of :data:`~pdproto.FAULT_KINDS` 0..max_budget."""
    return st.fixed_dictionaries({kind: st.integers(0, max_budget) for kind in FAULT_KINDS})


def configs(
    *,
    modes: Iterable[str] = ("push", "pull"),
    max_requests: int = 4,
    max_workers: int = 2,
    max_blocks: int = 4,
    max_budget: int = 2,
) -> st.SearchStrategy[ModelConfig]:
    """Model configurations, from tiny to larger than the explorer enumerates."""
    return st.builds(
        ModelConfig,
        mode=st.sampled_from(tuple(modes)),
        requests=st.integers(1, max_requests),
        prefill_workers=st.integers(1, max_workers),
        decode_workers=st.integers(1, max_workers),
        blocks=st.integers(1, max_blocks),
        faults=fault_budgets(max_budget),
    )


# -- settings profiles -----------------------------------------------------------

#: Hypothesis settings profiles pdproto registers: a quick default and a deeper
#: one for CI.  Select with ``pytest --hypothesis-profile=pdproto-ci``.
PROFILES = {
    "pdproto-quick": dict(max_examples=100, stateful_step_count=50, deadline=None),
    "pdproto-ci": dict(max_examples=1000, stateful_step_count=100, deadline=None),
}


def register_profiles() -> None:
    """Register :data:`PROFILES` with Hypothesis (idempotent)."""
    for name, kwargs in PROFILES.items():
        settings.register_profile(
            name, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **kwargs
        )
