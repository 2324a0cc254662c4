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
import time
from typing import Any, Callable, Hashable, Iterable, Sequence

import attrs
from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ._config import FAULT_KINDS, ModelConfig
from ._events import Event
from ._history import write_history
from ._model import Action
from ._monitor import END_INVARIANTS, Monitor, Violation

__all__ = [
    "HandoffFailure",
    "FuzzStats",
    "handoff_machine",
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
                 history: str | None) -> None:
        self.violation = violation
        self.trace = tuple(trace)
        self.history = history
        table = format_steps(self.trace)
        where = f"\nhistory written to {history}" if history else ""
        super().__init__(
            f"{violation.invariant} at step {len(self.trace)} (history line {violation.line}): "
            f"{violation.message}\n{table}{where}"
        )


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


@attrs.define
class FuzzStats:
    """Coverage and speed of the fuzzing runs of one machine class.

    ``states`` counts distinct states visited by their canonical form (the
    explorer's symmetry reduction when the model offers it), ``actions`` and
    ``faults`` count the steps of each action kind and fault kind.
    """

    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    states: set = attrs.field(factory=set, repr=False)
    actions: collections.Counter = attrs.field(factory=collections.Counter)
    faults: collections.Counter = attrs.field(factory=collections.Counter)
    failure: HandoffFailure | None = None

    @property
    def distinct_states(self) -> int:
        return len(self.states)

    def to_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "examples_per_second": round(self.examples / self.seconds, 2) if self.seconds else 0.0,
            "distinct_states": self.distinct_states,
            "action_kinds": dict(sorted(self.actions.items())),
            "fault_kinds": dict(sorted(self.faults.items())),
        }


def canonical_function(model: Any) -> Callable[[Any], Hashable]:
    """The state's canonical form for counting distinct states: the model's
    ``symmetry(state)[0]`` or ``canonical(state)``, else the state itself."""
    sym = getattr(model, "symmetry", None)
    if sym is not None:
        return lambda s: sym(s)[0]
    canon = getattr(model, "canonical", None)
    if canon is not None:
        return canon
    return lambda s: s


def handoff_machine(
    model: Any,
    *,
    out: str | os.PathLike[str] | None = None,
    swarm: bool = True,
    steer: bool = True,
    quiesce: bool = True,
) -> type[RuleBasedStateMachine]:
    """A Hypothesis ``RuleBasedStateMachine`` class that fuzzes ``model``.

    ``out``: where the failing history is written (rewritten at every
    failure, so after shrinking it holds the minimal one).  ``swarm``: draw
    per example which fault kinds are on.  ``steer``: prefer actions leading
    to states this example has not seen.  ``quiesce``: at teardown, drive to
    quiescence and apply the end-of-history checks.  With all three off the
    machine chooses uniformly among enabled actions (the baseline that
    ``benchmarks/fuzz_speed.py`` compares against).

    The class has ``.TestCase`` (a unittest case, for pytest), ``.stats``
    (a :class:`FuzzStats` shared by its runs) and ``.model``.
    """
    header = model.header
    canon = canonical_function(model)
    invariants = dict(getattr(model, "invariants", None) or {})
    out_path = os.fspath(out) if out is not None else None
    stats = FuzzStats()

    class HandoffMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self._t0 = time.perf_counter()
            self.state = next(iter(model.initial_states()))
            self.monitor = Monitor(header.policy, complete=True, workers=header.workers)
            self.trace: list[tuple[str, Action, tuple[Event, ...]]] = []
            self.events: list[Event] = []
            self.seen: set = {canon(self.state)}
            self.fault_on: dict[str, bool] = {}
            self.fault_rate = 2  # out of 4: how often a step may be a fault
            self.found: list[Violation] = []
            self.new_global = 0
            stats.examples += 1
            self._visit(self.state)

        # -- helpers ---------------------------------------------------------

        def _visit(self, state: Any) -> None:
            key = canon(state)
            if key not in stats.states:
                stats.states.add(key)
                self.new_global += 1
            self.seen.add(key)

        def _take(self, action: Action) -> None:
            state, events = model.step(self.state, action)
            self.state = state
            self.trace.append((action.actor, action, tuple(events)))
            stats.steps += 1
            stats.actions[action.kind] += 1
            if action.fault:
                stats.faults[action.kind] += 1
            for event in events:
                self.events.append(event)
                self.found.extend(self.monitor.feed(event))
            self._visit(state)

        def _fail(self, violation: Violation) -> None:
            if out_path is not None:
                # a history cut at a safety violation is not complete: leak and
                # stuck apply only to one that ran until the system went quiet
                complete = violation.invariant in END_INVARIANTS
                write_history(out_path, self.events, attrs.evolve(header, complete=complete))
            failure = HandoffFailure(violation, self.trace, out_path)
            stats.failure = failure
            raise failure

        def _fault_allowed(self, kind: str, data: Any) -> bool:
            if kind not in self.fault_on:
                self.fault_on[kind] = data.draw(st.booleans(), label=f"swarm: {kind} on")
            return self.fault_on[kind]

        # -- rules -----------------------------------------------------------

        @initialize(data=st.data())
        def choose_swarm(self, data: Any) -> None:
            if swarm:
                self.fault_rate = data.draw(st.integers(0, 3), label="swarm: fault eagerness")

        @precondition(lambda self: not self.found)
        @rule(data=st.data())
        def step(self, data: Any) -> None:
            enabled = model.actions(self.state)
            if not enabled:
                return
            candidates: Sequence[Action] = enabled
            if swarm:
                progress = [a for a in enabled if not a.fault]
                faults = [a for a in enabled if a.fault and self._fault_allowed(a.kind, data)]
                if progress and faults:
                    # fault_rate 0: faults rarely; 3: as often as progress
                    use_fault = data.draw(st.integers(0, 5), label="fault?") < self.fault_rate
                    candidates = faults if use_fault else progress
                else:
                    candidates = progress or faults or enabled
            if steer and len(candidates) > 1:
                fresh = [a for a in candidates if canon(model.step(self.state, a)[0]) not in self.seen]
                if fresh and len(fresh) < len(candidates):
                    if data.draw(st.integers(0, 7), label="steer") != 0:
                        candidates = fresh
            action = data.draw(st.sampled_from(candidates), label="action")
            self._take(action)

        @invariant()
        def monitor_is_clean(self) -> None:
            if self.found:
                self._fail(self.found[0])
            for name, holds in invariants.items():
                if not holds(self.state):
                    self._fail(
                        Violation(f"model:{name}", self.monitor.line,
                                  f"the model's state invariant {name!r} does not hold")
                    )

        def teardown(self) -> None:
            try:
                if quiesce and not self.found:
                    self._quiesce()
                if steer:
                    target(float(self.new_global), label="new states")
            finally:
                stats.seconds += time.perf_counter() - self._t0

        def _quiesce(self) -> None:
            for _ in range(QUIESCE_LIMIT):
                enabled = model.actions(self.state)
                if not enabled:
                    break
                progress = [a for a in enabled if not a.fault]
                self._take(progress[0] if progress else enabled[0])
                if self.found:
                    self._fail(self.found[0])
            else:
                self._fail(Violation("no-quiescence", self.monitor.line,
                                     f"the system did not go quiet within {QUIESCE_LIMIT} steps"))
            end = self.monitor.end_violations()
            if end:
                self._fail(end[0])

    HandoffMachine.__name__ = HandoffMachine.__qualname__ = f"Fuzz_{_ident(model.name)}"
    HandoffMachine.stats = stats  # type: ignore[attr-defined]
    HandoffMachine.model = model  # type: ignore[attr-defined]
    HandoffMachine.TestCase.settings = settings(  # type: ignore[attr-defined]
        HandoffMachine.TestCase.settings,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return HandoffMachine


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
