"""Auditing as a library: :func:`audit` judges a recorded history against the
invariants and returns an :class:`AuditResult`."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ..spec import (
    MAX_LINE_BYTES,
    HistoryHeader,
    Monitor,
    Observation,
    Violation,
    check_invariant_ids,
    open_history,
)

#: the event key an importer puts the 1-based line of the source log in
LOG_LINE = "log_line"


@attrs.frozen
class AuditResult:
    """What :func:`audit` found: the monitor's ``violations`` (sorted by
    line), how many ``events`` and ``requests`` the history held, the
    ``policy`` it was judged under and whether the end-of-history checks
    applied (``complete``).  For a partial history, ``observed`` lists the
    event kinds judged (None: a complete history) and ``not_judged`` the
    invariants their evidence cannot prove, each ``(invariant, needs,
    missing)``; ``log_lines`` maps history lines to the source log's lines
    (the events' ``log_line`` key), for the lines the violations name.
    :meth:`to_dict` is the JSON object of ``pdproto audit --json``."""

    events: int
    requests: int
    policy: str
    complete: bool
    violations: tuple[Violation, ...] = ()
    header: HistoryHeader | None = attrs.field(default=None, eq=False, repr=False)
    observed: tuple[str, ...] | None = None
    not_judged: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()
    log_lines: Mapping[int, int] = attrs.field(factory=dict, hash=False)

    @property
    def ok(self) -> bool:
        return not self.violations

    def violation_dict(self, v: Violation) -> dict[str, Any]:
        """One violation's JSON object: the monitor's, with the request and
        generation it names (None where unknown) and the source log's lines
        where the events carry them."""
        out = v.to_dict()
        out["request"] = v.request
        out["gen"] = v.gen
        if self.log_lines:
            log = self.log_lines.get(v.line)
            if log is not None:
                out["log_line"] = log
            out["witness_log_lines"] = [self.log_lines.get(w) for w in v.witness]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "events": self.events,
            "violations": [self.violation_dict(v) for v in self.violations],
            "requests": self.requests,
            "policy": self.policy,
            "complete": self.complete,
            "observed": None if self.observed is None else list(self.observed),
            "not_judged": [
                {"invariant": inv, "needs": list(needs), "missing": list(missing)}
                for inv, needs, missing in self.not_judged
            ],
        }


def _observation(
    observed: str | Iterable[str] | Observation | None, header: HistoryHeader
) -> Observation | None:
    """The ``observed`` override as an Observation: its kinds, each with the
    fields the header says it records."""
    if observed is None or isinstance(observed, Observation):
        return observed
    kinds = Observation.parse_kinds(observed).kinds
    fields = header.observed.fields if header.observed is not None else {}
    return Observation(kinds, {k: v for k, v in fields.items() if k in kinds})


def audit(
    path: str | os.PathLike[str],
    *,
    policy: str | None = None,
    complete: bool = False,
    skip: Iterable[str] = (),
    max_line_bytes: int = MAX_LINE_BYTES,
    observed: str | Iterable[str] | Observation | None = None,
) -> AuditResult:
    """Audit the history at ``path`` (``"-"``: standard input).

    ``policy`` overrides the header's protocol family; ``complete`` says the
    history runs until the system went quiet (apply leak and stuck);
    ``skip``: invariant ids not to report; ``observed`` (event kinds, comma-
    or space-separated, or an :class:`~pdproto.spec.Observation`) overrides
    the header's: only those kinds are judged, events of others are ignored.
    A malformed history raises :class:`~pdproto.HistoryFormatError` naming
    the file and line; an unknown invariant id or kind,
    :class:`~pdproto.UsageError`."""
    skipped = check_invariant_ids(skip)
    if observed is not None and not isinstance(observed, Observation):
        Observation.parse_kinds(observed)  # a bad kind is a usage error before the file is read
    log_lines: dict[int, int] = {}
    # The monitor's tables hold no reference cycles; the cyclic collector would
    # only walk them again and again as they grow (a third of the time on a
    # million events), so it is paused while the history is read.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with open_history(os.fspath(path), max_line_bytes=max_line_bytes) as reader:
            header = reader.header
            monitor = Monitor.from_header(
                header,
                policy=policy,
                complete=complete,
                skip=skipped,
                observed=_observation(observed, header),
            )
            feed = monitor.feed
            for line, event in reader:
                if feed(event, line) and event.extra:
                    log = event.extra.get(LOG_LINE)
                    if type(log) is int:
                        log_lines[line] = log
            monitor.line = max(monitor.line, reader.line)
            monitor.finish()
    finally:
        if gc_was_enabled:
            gc.enable()
    violations = tuple(monitor.violations)
    if log_lines and path != "-":
        _witness_log_lines(path, violations, log_lines, max_line_bytes)
    partial = getattr(monitor, "observed", None)
    return AuditResult(
        events=monitor.events,
        requests=monitor.requests,
        policy=monitor.policy,
        complete=monitor.complete,
        violations=violations,
        header=header,
        observed=None if partial is None else tuple(sorted(partial.kinds)),
        not_judged=getattr(monitor, "not_judged", ()),
        log_lines=log_lines,
    )


def _witness_log_lines(
    path: str | os.PathLike[str],
    violations: tuple[Violation, ...],
    log_lines: dict[int, int],
    max_line_bytes: int,
) -> None:
    """Add the source log's lines of the witnesses (a second pass over the
    file, keeping only those lines: memory stays small)."""
    wanted = {w for v in violations for w in v.witness} - set(log_lines)
    if not wanted:
        return
    last = max(wanted)
    with open_history(os.fspath(path), max_line_bytes=max_line_bytes) as reader:
        for line, event in reader:
            if line in wanted:
                log = event.extra.get(LOG_LINE) if event.extra else None
                if type(log) is int:
                    log_lines[line] = log
            if line >= last:
                break


__all__ = ["audit", "AuditResult"]
