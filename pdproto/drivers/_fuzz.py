"""Fuzzing as a library: :func:`fuzz` runs a model's Hypothesis state machine
(:mod:`pdproto.drivers._machine`) and returns a :class:`FuzzResult`.

This module holds what a fuzz run reports (the failure, the coverage and
speed counters) and imports Hypothesis only when :func:`fuzz` runs, so that
``import pdproto`` stays light.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import UsageError
from ..protocol import Action
from ..spec import Event, Violation, write_history

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


# -- the library driver ----------------------------------------------------------


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


def fuzz(
    model: Any,
    *,
    examples: int = 200,
    steps: int = 300,
    seed: int | None = None,
    out: str | os.PathLike[str] | None = None,
    database: str | None = DEFAULT_DATABASE,
    backend: Callable[[Any], Any] | None = None,
    coverage_states: int | None = None,
    name: str | None = None,
    expected: str | None = None,
    stats: FuzzStats | None = None,
    explain: bool = False,
    workers: int | None = None,
    ray: bool | str = False,
) -> FuzzResult:
    """Fuzz ``model`` with its Hypothesis state machine; return a :class:`FuzzResult`.

    ``examples`` runs of at most ``steps`` rule steps each (then teardown
    drives the run to quiescence).  ``seed`` makes the run repeatable.
    ``out``: write the shrunk failing history there.  ``database``: the
    directory of Hypothesis's example database (None: none), kept apart per
    model and configuration.  ``backend``: a factory ``backend(header)`` of a
    data backend (e.g. :func:`pdproto.drivers.torch_backend_factory`).
    ``coverage_states``: first count the reachable states (up to that many)
    and report the fraction covered.  ``name``/``expected`` label the result
    (default: the model's name).  ``stats``: a :class:`FuzzStats` to count
    into (for a live progress line).  ``explain``: run Hypothesis's explain
    phase after shrinking (off by default: it took about 95% of the time of a
    run that found a bug, and the shrunk history is the same without it).
    ``workers``: split the examples over that many worker processes (None
    or 1: the serial run); ``ray``: over Ray tasks instead (True: a local Ray
    instance, or a cluster's address; ``workers`` tasks, None: one per CPU of
    the cluster); see :mod:`pdproto.drivers._parallel_fuzz`.
    Whatever Hypothesis prints is swallowed.
    """
    out_path = os.fspath(out) if out is not None else None
    if out_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise UsageError("out", out_path, "a file in an existing directory")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise UsageError("workers", workers, "an integer >= 1 (or None)")
    name = name if name is not None else getattr(model, "name", type(model).__name__)
    stats = stats if stats is not None else FuzzStats()
    if (workers is not None and workers > 1) or ray is not False:
        from ._parallel_fuzz import fuzz_parallel

        return fuzz_parallel(
            model,
            dict(
                examples=examples,
                steps=steps,
                seed=seed,
                out=out_path,
                database=database,
                backend=backend,
                coverage_states=coverage_states,
                name=name,
                expected=expected,
                stats=stats,
                explain=explain,
            ),
            workers=workers,
            ray=ray,
        )
    if coverage_states is not None:
        stats.reachable = reachable_states(model, max_states=coverage_states)
    return fuzz_serial(
        model,
        examples=examples,
        steps=steps,
        seed=seed,
        out=out_path,
        database=database,
        backend=backend,
        name=name,
        expected=expected,
        stats=stats,
        explain=explain,
    )


def fuzz_serial(
    model: Any,
    *,
    examples: int,
    steps: int,
    seed: int | None,
    out: str | None,
    database: str | None,
    backend: Callable[[Any], Any] | None,
    name: str,
    expected: str | None,
    stats: FuzzStats,
    explain: bool,
    seeded_database: bool = False,
) -> FuzzResult:
    """The serial run of :func:`fuzz` (its arguments checked, ``name`` and
    ``stats`` set).  ``seeded_database``: a seeded run still uses the
    database (a worker of a parallel run; see
    :func:`~pdproto.drivers._machine.run_machine`)."""
    from ._machine import run_machine

    identity = f"pdproto-fuzz:{name}:{getattr(model, 'config', None)!r}"
    phases: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        failure = run_machine(
            model,
            examples=examples,
            steps=steps,
            seed=seed,
            out=out,
            database=database,
            identity=identity,
            backend=backend,
            stats=stats,
            explain=explain,
            phase_seconds=phases,
            seeded_database=seeded_database,
        )
    if failure is not None and out is not None:
        # with several distinct bugs Hypothesis replays each; the file must
        # hold the one reported here
        write_history(out, failure.events, failure.header)
    seconds = time.perf_counter() - t0
    counters = stats.to_dict()
    counters["seconds"] = round(seconds, 3)
    counters["steps_per_second"] = round(stats.steps / seconds, 1) if seconds else 0.0
    counters["examples_per_second"] = round(stats.examples / seconds, 2) if seconds else 0.0
    counters["cpu_seconds"] = round(time.process_time() - c0, 3)
    counters["phase_seconds"] = {phase: round(phases.get(phase, 0.0), 3) for phase in PHASE_NAMES}
    counters["workers"] = 1
    return FuzzResult(
        model=name,
        expected=expected,
        seed=seed,
        seconds=seconds,
        counters=counters,
        failure=failure,
        stats=stats,
    )


__all__ = [
    "fuzz",
    "FuzzResult",
    "FuzzStats",
    "HandoffFailure",
    "pick_failure",
    "format_steps",
    "fault_kind",
    "canonical_function",
    "reachable_states",
]
