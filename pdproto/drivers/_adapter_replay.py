"""Re-enacting a history on a real system: :func:`replay_on_adapter`.

A history records what happened; some of its events are *decisions* (a
client submits or cancels, a worker takes a scheduler step, a transfer
fails) and the rest are their consequences.  The driver walks the history
from a reset engine.  For each event the engine has not produced yet it asks
the adapter which action makes the engine do it (``decision(event)``),
applies that action, and matches every event the engine produced against
the history's events not matched yet (by kind, request, generation and
worker; transfer ids, tickets and block ids are the engine's own).  What
does not match is a divergence:

- ``refused``: the history's decision is not one the engine offers there;
- ``missing``: the history has an event that the engine did not produce when
  it took the decision that should have produced it (or no decision does);
- ``extra``: the engine produced an event the history does not have.

The monitor judges the engine's own events as they come, so the result
also says which invariants the engine broke while re-enacting, each named
by the history line of the event it matched (an extra event: the line being
re-enacted).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from .._errors import UsageError
from ..protocol import Action
from ..spec import Event, Monitor, Violation, open_history

__all__ = ["Divergence", "AdapterReplayResult", "replay_on_adapter", "event_key", "lookahead_decision"]


@attrs.frozen
class Divergence:
    """Where the engine and the history part: ``kind`` is ``refused``,
    ``missing`` or ``extra``; ``line`` the history line (for ``extra``, the
    line of the history event being re-enacted when the engine did it)."""

    kind: str
    line: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "line": self.line, "message": self.message}


@attrs.frozen
class AdapterReplayResult:
    """What :func:`replay_on_adapter` found: the history's event count, how
    many the engine matched, the divergences, the violations the monitor
    found in the engine's own events, and those events."""

    adapter: str
    history: str
    events: int
    matched: int
    actions: int
    divergences: tuple[Divergence, ...]
    violations: tuple[Violation, ...]
    engine_events: tuple[Event, ...] = attrs.field(repr=False, default=())

    @property
    def ok(self) -> bool:
        return not self.divergences and not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "history": self.history,
            "ok": self.ok,
            "events": self.events,
            "matched": self.matched,
            "actions": self.actions,
            "divergences": [d.to_dict() for d in self.divergences],
            "violations": [v.to_dict() for v in self.violations],
        }


def event_key(event: Event, owner: dict[str, tuple[Any, Any]]) -> Hashable:
    """What matching compares: the kind, and the request, generation and
    worker the event concerns (an event that names only a transfer gets the
    request and generation of that transfer's start, from ``owner``: transfer
    id -> (request, gen), which this call fills in)."""
    d = event.to_dict()
    kind = d.get("ev")
    request, gen = d.get("request"), d.get("gen")
    tid = d.get("transfer")
    if kind == "transfer_start" and tid is not None:
        owner[tid] = (request, gen)
    elif tid is not None and request is None:
        request, gen = owner.get(tid, (None, None))
    return (kind, request, gen, d.get("worker"), d.get("src"), d.get("dst"))


def lookahead_decision(adapter: Any, event: Event, depth: int = 4) -> tuple[Action, ...] | None:
    """For an adapter over a pure model (:class:`~pdproto.drivers.ModelAdapter`):
    the shortest run of actions, all silent (producing no event) but the
    last, whose last step produces an event like ``event``; at most
    ``depth`` actions long."""
    model = adapter.model
    want = event_key(event, {})
    level: list[tuple[Any, tuple[Action, ...]]] = [(adapter.state, ())]
    seen = {adapter.state}
    for _ in range(depth):
        nxt: list[tuple[Any, tuple[Action, ...]]] = []
        for state, path in level:
            for action in model.actions(state):
                after, events = model.step(state, action)
                owner: dict[str, tuple[Any, Any]] = {}
                if any(event_key(e, owner) == want for e in events):
                    return path + (action,)
                if not events and after not in seen:
                    seen.add(after)
                    nxt.append((after, path + (action,)))
        level = nxt
    return None


def replay_on_adapter(path: str | os.PathLike[str], adapter: Any) -> AdapterReplayResult:
    """Re-enact the history at ``path`` on ``adapter`` (reset first); see the
    module docstring.  The adapter must offer ``decision(event)``, returning
    an action, a sequence of actions (silent steps first), or None (an
    adapter over a model gets :func:`lookahead_decision`)."""
    decide: Any = getattr(adapter, "decision", None)
    if decide is None and hasattr(adapter, "model"):

        def decide(event: Event) -> Any:
            return lookahead_decision(adapter, event)

    if decide is None:
        raise UsageError(
            "--adapter",
            getattr(adapter, "name", adapter),
            "an adapter that offers decision(event) (docs/adapters.md)",
        )
    with open_history(path) as reader:
        history = [(line, event) for line, event in reader]
        complete = reader.header.complete
    source = os.fspath(path)
    adapter.reset()
    # a complete history ran until the system went quiet: so must the re-enactment
    monitor = Monitor.from_header(attrs.evolve(adapter.header, complete=complete))
    hist_owner: dict[str, tuple[Any, Any]] = {}
    keys = [event_key(e, hist_owner) for _, e in history]
    engine_owner: dict[str, tuple[Any, Any]] = {}
    matched = [False] * len(history)
    divergences: list[Divergence] = []
    produced: list[Event] = []
    actions = 0
    for i, (line, event) in enumerate(history):
        if matched[i]:
            continue
        decided = decide(event)
        if decided is None:
            divergences.append(
                Divergence("missing", line, f"{_brief(event)}: no action of the engine makes it happen here")
            )
            continue
        path = (decided,) if isinstance(decided, Action) else tuple(decided)
        events = []
        refused = False
        for action in path:
            offered: Sequence[Action] = adapter.actions()
            if action not in offered:
                shown = ", ".join(map(str, offered[:8])) + (" ..." if len(offered) > 8 else "")
                divergences.append(
                    Divergence(
                        "refused",
                        line,
                        f"{_brief(event)} needs {action}, which the engine does not offer "
                        f"here (it offers: {shown or 'nothing'})",
                    )
                )
                refused = True
                break
            events.extend(adapter.apply(action))
            actions += 1
        for e in events:  # what the engine did, the silent steps before a refusal included
            produced.append(e)
            k = event_key(e, engine_owner)
            j = next((j for j in range(i, len(history)) if not matched[j] and keys[j] == k), None)
            if j is None:
                divergences.append(
                    Divergence(
                        "extra",
                        line,
                        f"the engine did {_brief(e)} (while "
                        f"re-enacting line {line}), which the history does not have",
                    )
                )
                monitor.feed(e, line=line)
            else:
                matched[j] = True
                monitor.feed(e, line=history[j][0])  # named by the history line it matched
        if not matched[i] and not refused:
            divergences.append(
                Divergence("missing", line, f"{_brief(event)}: the engine took {path[-1]} but did not do it")
            )
    monitor.line = history[-1][0] if history else 1  # the end checks name the history's last line
    monitor.finish()
    return AdapterReplayResult(
        adapter=getattr(adapter, "name", type(adapter).__name__),
        history=source,
        events=len(history),
        matched=sum(matched),
        actions=actions,
        divergences=tuple(divergences),
        violations=tuple(monitor.violations),
        engine_events=tuple(produced),
    )


def _brief(event: Event) -> str:
    d = event.to_dict()
    kind = d.pop("ev")
    return f"{kind}(" + ", ".join(f"{k}={v}" for k, v in d.items() if k != "extra") + ")"
