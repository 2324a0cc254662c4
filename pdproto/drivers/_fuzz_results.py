"""What a fuzz run reports: the failure (:class:`HandoffFailure`), the coverage
and speed counters (:class:`FuzzStats`) and the result (:class:`FuzzResult`),
apart from the drivers that produce them (:mod:`._fuzz`, :mod:`._fuzz_serial`,
:mod:`._parallel_fuzz`, :mod:`._machine`), which all import them from here.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from ..protocol import Action
from ..spec import Event, Violation

#: where ``pdproto fuzz`` keeps Hypothesis's example database
DEFAULT_DATABASE = ".hypothesis/examples"
#: the phases of a run whose wall seconds ``phase_seconds`` reports: replaying
#: the example database, generating examples, shrinking a failure, and
#: Hypothesis's explain phase (0 unless ``explain``)
PHASE_NAMES = ("reuse", "generate", "shrink", "explain")


class HandoffFailure(AssertionError):
    """A fuzzed run broke an invariant.

    ``violation`` is the monitor's report (or a model state invariant, with
    invariant id ``"model:<name>"``, or ``"no-quiescence"``), ``trace`` the
    steps as ``(actor, action, events)``, ``history`` the path it was
    written to (None when no ``out`` was given).
    """

    def __init__(
        self,
        violation: Violation,
        trace: Sequence[tuple[str, Action, tuple[Event, ...]]],
        history: str | None,
        events: Sequence[Event] = (),
        header: Any = None,
    ) -> None:
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

    def __reduce__(self) -> Any:
        # a parallel run's workers send their failures back pickled
        return (type(self), (self.violation, self.trace, self.history, self.events, self.header))


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
    (the same form :func:`pdproto.explore` keys model states by)."""
    sym = getattr(model, "symmetry", None)
    if callable(sym):
        return lambda s: sym(s)[0]
    canon = getattr(model, "canonical", None)
    if callable(canon):
        return canon
    return lambda s: s


def reachable_states(model: Any, max_states: int = 2_000_000) -> int | None:
    """The number of distinct reachable model states (canonical form, no
    monitor), by a breadth-first search with :func:`pdproto.explore`; None
    when there are more than ``max_states``.  This is what
    :attr:`FuzzStats.coverage` divides by: the explorer's own ``states``
    count pairs each model state with a monitor state, which fuzzing does
    not count."""
    from ._explore import explore

    result = explore(model, monitor=False, check_deadlock=False, max_states=max_states, stop_on_first=False)
    if result.truncated or not result.complete:
        return None
    return result.states


# -- the result of a run


@attrs.frozen
class FuzzResult:
    """What :func:`fuzz` found.  ``ok`` when no run failed; ``failure`` is
    the (shrunk) :class:`HandoffFailure` otherwise.  The counters are those of
    :class:`FuzzStats`, with ``seconds`` the wall time of the whole run (the
    per-second rates divide by it).  :meth:`to_dict` is the JSON object of
    ``pdproto fuzz --json``."""

    model: str
    expected: str | None
    seed: int | None
    seconds: float
    counters: Mapping[str, Any]
    failure: HandoffFailure | None = attrs.field(default=None, eq=False)
    stats: FuzzStats | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def violation(self) -> Violation | None:
        return None if self.failure is None else self.failure.violation

    @property
    def out(self) -> str | None:
        """Where the failing history was written (None: nowhere)."""
        return None if self.failure is None else self.failure.history

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "ok": self.ok,
            "model": self.model,
            "expected": self.expected,
            **self.counters,
            "seed": self.seed,
            "violation": None,
        }
        if self.failure is not None:
            result["violation"] = _failure_dict(self.failure)
            result["out"] = self.failure.history
        return result


def _failure_dict(failure: HandoffFailure) -> dict[str, Any]:
    v = failure.violation
    return {
        "invariant": v.invariant,
        "line": v.line,
        "message": v.message,
        "witness": list(v.witness),
        "trace": [
            {
                "step": i,
                "actor": actor,
                "action": str(action),
                "fault": action.fault,
                "events": [e.to_dict() for e in events],
            }
            for i, (actor, action, events) in enumerate(failure.trace, 1)
        ],
    }
