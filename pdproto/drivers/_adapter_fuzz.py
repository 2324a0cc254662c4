"""Fuzzing a real system through its adapter: :func:`fuzz_adapter`.

Each example resets the engine, then Hypothesis draws the run: at each step
whether to go on, and which of the actions the engine offers now to apply.
Every event the engine produced is fed to the monitor.  After the drawn
steps the run *drains*: the first non-fault action the engine offers is
applied until it offers none (the system is quiet), so that the end of the
history is complete and the ``leak`` and ``stuck`` checks apply.

A real engine shows several behaviours at once, and one of them would hide
the others from a fuzzer that stops at its first failure.  So a run goes in
rounds: a round stops at the first violation of an invariant not yet found,
Hypothesis shrinks it (every shrink step is a run of the real engine from a
reset, aiming at that same invariant), and the next round goes on with the
examples left, ignoring the invariants found so far.  The result lists one
shrunk failure per invariant, each a history that ``pdproto audit`` judges
the same way; the adapter's ``known`` triage is attached where it has one.

A Hypothesis example database is not used: the failures of a real engine
depend on its version and configuration, and runs stay repeatable from the
seed alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import PdprotoError
from ..protocol import Action, ActionNotEnabled
from ..spec import Event, HistoryHeader, Monitor, Violation, write_history

__all__ = ["AdapterFailure", "AdapterFuzzResult", "fuzz_adapter", "run_actions", "DRAIN_LIMIT"]

#: the most steps a drain may take before the run counts as ``no-quiescence``
DRAIN_LIMIT = 500
#: the id of a failure where the engine (or its adapter) raised
ADAPTER_ERROR = "adapter-error"


@attrs.frozen
class AdapterFailure:
    """One shrunk failure of a real system: the first ``violation`` of its
    invariant, the ``steps`` of the run as ``(action, events)`` pairs (drain
    included), the history (``header`` and ``events``; ``complete`` when the
    violation came from the end-of-history checks), the path it was written
    to, and the adapter's triage (``known``) when it has one."""

    violation: Violation
    steps: tuple[tuple[Action, tuple[Event, ...]], ...]
    header: HistoryHeader
    events: tuple[Event, ...]
    history: str | None = None
    known: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self.violation.to_dict()
        out["steps"] = len(self.steps)
        out["history"] = self.history
        out["known"] = self.known
        out["actions"] = [str(a) + (" [fault]" if a.fault else "") for a, _ in self.steps]
        return out


@attrs.frozen
class AdapterFuzzResult:
    """What :func:`fuzz_adapter` found and how fast.  ``examples`` counts the
    examples generated, ``runs`` every run of the engine (shrinking
    included), ``steps`` every action applied; ``signatures`` the distinct
    real-state signatures reached (None when the adapter offers none);
    ``startup_seconds`` is what building the engine took (the caller's
    measurement)."""

    adapter: str
    examples: int
    runs: int
    steps: int
    seconds: float
    failures: tuple[AdapterFailure, ...]
    signatures: int | None = None
    seed: int | None = None
    startup_seconds: float | None = None
    action_kinds: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def unexplained(self) -> tuple[AdapterFailure, ...]:
        """The failures the adapter's triage does not explain."""
        return tuple(f for f in self.failures if f.known is None)

    def to_dict(self) -> dict[str, Any]:
        secs = self.seconds or 1e-9
        return {
            "adapter": self.adapter,
            "ok": self.ok,
            "examples": self.examples,
            "runs": self.runs,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "startup_seconds": None if self.startup_seconds is None else round(self.startup_seconds, 3),
            "examples_per_second": round(self.examples / secs, 2),
            "runs_per_second": round(self.runs / secs, 2),
            "steps_per_second": round(self.steps / secs, 1),
            "signatures": self.signatures,
            "seed": self.seed,
            "action_kinds": dict(self.action_kinds),
            "violations": [f.to_dict() for f in self.failures],
            "unexplained": [f.violation.invariant for f in self.unexplained],
        }


class _Run:
    """One run of the engine from a reset: its steps, events and monitor."""

    __slots__ = ("adapter", "monitor", "steps", "events", "complete", "violation")

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.monitor = Monitor.from_header(adapter.header, complete=True)
        self.steps: list[tuple[Action, tuple[Event, ...]]] = []
        self.events: list[Event] = []
        self.complete = False
        self.violation: Violation | None = None

    def apply(self, action: Action) -> list[Violation]:
        try:
            events = tuple(self.adapter.apply(action))
        except ActionNotEnabled as exc:
            raise _AdapterBroke(f"it offered {action} and then refused it: {exc}") from None
        self.steps.append((action, events))
        found: list[Violation] = []
        for e in events:
            self.events.append(e)
            found.extend(self.monitor.feed(e, line=len(self.events) + 1))
        return found


class _AdapterBroke(Exception):
    """The engine or its adapter raised where it must not."""


class _Found(Exception):
    def __init__(self, run: _Run, violation: Violation) -> None:
        super().__init__(violation.invariant)
        self.run = run
        self.violation = violation


def _first_new(found: Sequence[Violation], ignore: frozenset[str]) -> Violation | None:
    for v in found:
        if v.invariant not in ignore:
            return v
    return None


def run_actions(
    adapter: Any,
    choose: Callable[[Sequence[Action]], Action | None],
    *,
    ignore: frozenset[str] = frozenset(),
    drain: bool = True,
    on_step: Callable[[Any], None] | None = None,
) -> _Run:
    """Reset ``adapter`` and run it: ``choose(actions)`` picks each next
    action (None stops), then the run drains to quiescence (``drain``).
    Stops at the first violation whose invariant is not in ``ignore``
    (``run.violation``); ``on_step(adapter)`` is called after every step."""
    adapter.reset()
    run = _Run(adapter)

    def progress(offered: Sequence[Action]) -> Action | None:
        return next((a for a in offered if not a.fault), None)

    try:
        phases = ((choose, None), (progress, DRAIN_LIMIT)) if drain else ((choose, None),)
        for pick, limit in phases:  # the drawn steps, then the drain
            taken = 0
            while True:
                offered = adapter.actions()
                action = pick(offered) if offered else None
                if action is None:
                    break
                if limit is not None and taken == limit:
                    run.violation = _first_new(
                        [
                            Violation(
                                "no-quiescence",
                                len(run.events) + 1,
                                f"the system did not go quiet within {limit} progress steps after "
                                "the drawn ones",
                            )
                        ],
                        ignore,
                    )
                    return run
                taken += 1
                run.violation = _first_new(run.apply(action), ignore)
                if on_step is not None:
                    on_step(adapter)
                if run.violation is not None:
                    return run
        if not drain:
            return run
        run.complete = True
        run.violation = _first_new(run.monitor.end_violations(), ignore)
    except _AdapterBroke as exc:
        run.violation = _first_new([Violation(ADAPTER_ERROR, len(run.events) + 1, str(exc))], ignore)
    except PdprotoError:
        raise
    except Exception as exc:  # the real engine raised: a finding, not a crash of pdproto
        run.violation = _first_new(
            [
                Violation(
                    ADAPTER_ERROR,
                    len(run.events) + 1,
                    f"{type(exc).__name__} while applying step {len(run.steps) + 1}: {exc}",
                )
            ],
            ignore,
        )
    return run


def fuzz_adapter(
    adapter: Any,
    *,
    examples: int = 100,
    steps: int = 40,
    seed: int | None = None,
    out: str | os.PathLike[str] | None = None,
    startup_seconds: float | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> AdapterFuzzResult:
    """Fuzz ``adapter`` (see :mod:`pdproto.drivers._adapter`) for
    ``examples`` examples of at most ``steps`` drawn steps each (then the
    drain).  ``out`` receives the first failure's history; each later one
    goes beside it as ``<stem>.<invariant><suffix>``.  ``progress(examples,
    steps, failures)`` is called after every run."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from ._hypothesis import Draws

    known: Mapping[str, str] = getattr(adapter, "known", None) or {}
    signature = getattr(adapter, "signature", None)
    seen_sigs: set[Hashable] = set()
    counts = {"examples": 0, "runs": 0, "steps": 0}
    kinds: dict[str, int] = {}
    failures: list[AdapterFailure] = []
    found: set[str] = set()
    p_more = 1.0 - 1.0 / max(steps, 2)

    def on_step(a: Any) -> None:
        counts["steps"] += 1
        if signature is not None:
            seen_sigs.add(signature())

    started = time.perf_counter()
    rnd = 0
    while counts["examples"] < examples:
        ignore = frozenset(found)
        target: list[str] = []  # the invariant this round shrinks
        generating = [True]

        # body runs within this round (Hypothesis calls it before the loop goes on), so it may read
        # the round's variables (B023)
        def body(data: Any) -> None:
            draws = Draws(data)
            taken = [0]

            def choose(offered: Sequence[Action]) -> Action | None:
                if taken[0] >= steps or not draws.boolean(p_more, "more"):
                    return None
                taken[0] += 1
                action = offered[draws.integer(0, len(offered) - 1, "action")]
                kinds[action.kind] = kinds.get(action.kind, 0) + 1
                return action

            counts["runs"] += 1
            if generating[0]:  # noqa: B023
                counts["examples"] += 1
            run = run_actions(adapter, choose, ignore=ignore, on_step=on_step)  # noqa: B023
            if progress is not None:
                progress(counts["examples"], counts["steps"], len(failures))
            v = run.violation
            if v is None:
                return
            if not target:  # noqa: B023
                target.append(v.invariant)  # noqa: B023
                generating[0] = False  # noqa: B023
            if v.invariant == target[0]:  # noqa: B023
                raise _Found(run, v)

        left = examples - counts["examples"]
        test = settings(
            max_examples=left,
            deadline=None,
            database=None,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            phases=[Phase.generate, Phase.shrink],
        )(given(st.data())(body))
        if seed is not None:
            test = hseed(seed + rnd)(test)
        rnd += 1
        try:
            test()
        except _Found as exc:
            found.add(exc.violation.invariant)
            failures.append(_failure(adapter, exc.run, exc.violation, known, out, len(failures)))
            continue
        break  # a round with no new violation used up the examples left
    seconds = time.perf_counter() - started
    return AdapterFuzzResult(
        adapter=getattr(adapter, "name", type(adapter).__name__),
        examples=counts["examples"],
        runs=counts["runs"],
        steps=counts["steps"],
        seconds=seconds,
        failures=tuple(failures),
        signatures=len(seen_sigs) if signature is not None else None,
        seed=seed,
        startup_seconds=startup_seconds,
        action_kinds=dict(sorted(kinds.items())),
    )


def _failure(
    adapter: Any,
    run: _Run,
    v: Violation,
    known: Mapping[str, str],
    out: str | os.PathLike[str] | None,
    index: int,
) -> AdapterFailure:
    header = attrs.evolve(adapter.header, complete=run.complete)
    path = None
    if out is not None:
        path = os.fspath(out)
        if index:
            stem, suffix = os.path.splitext(path)
            path = f"{stem}.{v.invariant}{suffix or '.jsonl'}"
        write_history(path, run.events, header)
    return AdapterFailure(v, tuple(run.steps), header, tuple(run.events), path, known.get(v.invariant))
