"""Auditing as a library: :func:`audit` judges a recorded history against the
invariants and returns an :class:`AuditResult`."""

from __future__ import annotations

import gc
import os
from typing import Any, Iterable

import attrs

from ..spec._history import MAX_LINE_BYTES, HistoryHeader, open_history
from ..spec._monitor import Monitor, Violation, check_invariant_ids


@attrs.frozen
class AuditResult:
    """What :func:`audit` found: the monitor's ``violations`` (sorted by
    line), how many ``events`` and ``requests`` the history held, the
    ``policy`` it was judged under and whether the end-of-history checks
    applied (``complete``).  :meth:`to_dict` is the JSON object of
    ``pdproto audit --json``."""

    events: int
    requests: int
    policy: str
    complete: bool
    violations: tuple[Violation, ...] = ()
    header: HistoryHeader | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "events": self.events,
            "violations": [v.to_dict() for v in self.violations],
            "requests": self.requests,
            "policy": self.policy,
            "complete": self.complete,
        }


def audit(
    path: str | os.PathLike[str],
    *,
    policy: str | None = None,
    complete: bool = False,
    skip: Iterable[str] = (),
    max_line_bytes: int = MAX_LINE_BYTES,
) -> AuditResult:
    """Audit the history at ``path`` (``"-"``: standard input).

    ``policy`` overrides the header's protocol family; ``complete`` says the
    history runs until the system went quiet (apply leak and stuck);
    ``skip``: invariant ids not to report.  A malformed history raises
    :class:`~pdproto.HistoryFormatError` naming the file and line; an
    unknown invariant id, :class:`~pdproto.UsageError`."""
    skipped = check_invariant_ids(skip)
    # The monitor's tables hold no reference cycles; the cyclic collector would
    # only walk them again and again as they grow (a third of the time on a
    # million events), so it is paused while the history is read.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with open_history(os.fspath(path), max_line_bytes=max_line_bytes) as reader:
            monitor = Monitor.from_header(reader.header, policy=policy, complete=complete, skip=skipped)
            feed = monitor.feed
            for line, event in reader:
                feed(event, line)
            monitor.line = max(monitor.line, reader.line)
            monitor.finish()
            header = reader.header
    finally:
        if gc_was_enabled:
            gc.enable()
    return AuditResult(events=monitor.events, requests=monitor.requests, policy=monitor.policy,
                       complete=monitor.complete, violations=tuple(monitor.violations), header=header)


__all__ = ["audit", "AuditResult"]
