"""Traces out of a finished search: the path to a state, re-run through the
model, and the counterexample it makes (with the monitor's and the data
backend's verdicts on the history as written)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from ..spec import HistoryHeader, Monitor, Violation
from ._results import Counterexample, Step

__all__ = ["rerun"]


def _build_graph(name: str, n: int, edges: list, parents: array) -> Any:
    import networkx as nx

    g = nx.MultiDiGraph(name=name)
    for i in range(n):
        g.add_node(i, initial=parents[i] < 0)
    for a, b, label in edges:
        g.add_edge(a, b, action=label)
    return g


def _path(parents: array, via: array, idx: int) -> tuple[int, list[int]]:
    path = []
    while parents[idx] >= 0:
        path.append(via[idx])
        idx = parents[idx]
    path.reverse()
    return via[idx], path


def rerun(model: Any, initial: int, action_indices: Sequence[int]) -> tuple[list[Step], Any]:
    """Re-run ``model`` from its ``initial``-th initial state along the given
    action indices; return the steps (with their events) and the last state."""
    state = list(model.initial_states())[initial]
    steps = []
    for i, ai in enumerate(action_indices, 1):
        act = model.actions(state)[ai]
        state, events = model.step(state, act)
        steps.append(
            Step(i, getattr(act, "actor", "?"), act, tuple(events), bool(getattr(act, "fault", False)))
        )
    return steps, state


def _counterexample(
    model: Any,
    header: HistoryHeader,
    template: Monitor | None,
    parents: array,
    via: array,
    idx: int,
    kind: str,
    inv: str,
    message: str,
    backend: Callable[[], Any] | None = None,
) -> Counterexample:
    initial, path = _path(parents, via, idx)
    steps, state = rerun(model, initial, path)
    found: tuple[Violation, ...] = ()
    data: list[Violation] = []
    if backend is not None and kind != "state-invariant":
        # the data backend on the history as written (header on line 1); the
        # end of the history when the step itself showed nothing
        b = backend()
        line = 1
        for s in steps:
            for ev in s.events:
                line += 1
                data.extend(b.apply(ev, line))
        if not data:
            data.extend(b.finish())
        if inv == data[0].invariant if data else False:
            message = data[0].message
    if template is not None:
        # the monitor of the history as written: header on line 1, events after
        mon = Monitor.from_header(header, complete=True, skip=template.skip)
        line = 1
        out: list[Violation] = []
        for s in steps:
            for ev in s.events:
                line += 1
                out.extend(mon.feed(ev, line))
        if kind == "deadlock":
            out = mon.end_violations()
        found = tuple(out)
        match = [v for v in found if v.invariant == inv]
        if match:
            message = match[0].message
            found = tuple(match) + tuple(v for v in found if v.invariant != inv)
    if data:
        found = (tuple(data) + found) if data[0].invariant == inv else (found + tuple(data))
    return Counterexample(inv, message, tuple(steps), kind, found, initial, state)
