"""What a search returns: its result, counterexamples and their steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from ..spec import Event, HistoryHeader, Violation

__all__ = ["Step", "Counterexample", "ExploreResult", "trace_header"]


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
    was reached (or ``max_seconds``): ``stopped_by`` says what ended an
    incomplete search: ``"max_states"``, ``"max_seconds"`` or
    ``"counterexample"`` (None for a complete one)."""

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
    stopped_by: str | None = None
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
            "partial": not self.complete,
            "stopped_by": self.stopped_by,
            "symmetry": self.symmetry,
            "fingerprint": self.fingerprint,
            "bytes_per_state": None if self.bytes_per_state is None else round(self.bytes_per_state, 1),
            "collision_probability": self.collision_probability,
            "monitor_states": self.monitor_states,
            "memory": dict(self.memory) if self.memory is not None else None,
        }


def trace_header(result_header: HistoryHeader, cx: Counterexample) -> HistoryHeader:
    """The header to write ``cx`` with: complete for a deadlock (leak and stuck
    are end-of-history checks), not complete for a safety violation (the
    history stops at the bad event, not at a quiet state)."""
    return attrs.evolve(result_header, complete=cx.kind == "deadlock")
