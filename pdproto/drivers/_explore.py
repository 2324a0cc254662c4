"""The explicit-state explorer: breadth-first search over the product of a
model's state and the monitor's verdict state.

Any object following :class:`pdproto.Model` can be explored: the explorer
asks for the initial states, the enabled actions of a state (in a fixed
order), and the next state plus the history events of each action.  Every
event is fed to a :class:`~pdproto.Monitor`; the search key is the pair
(model state, monitor verdict state), so two paths reaching the same model
state with different histories are both explored, and every counterexample
found is a shortest one (breadth-first order).

Soundness of symmetry reduction (see docs/modeling.md):

- ``model.canonical_product(state, monitor_key)`` (optional) returns the
  search key of the whole product; the model must apply *one* renaming to
  both halves.
- ``model.symmetry(state) -> (canonical_state, Renaming)`` (optional): the
  model says which renaming of its ids maps ``state`` to its canonical form;
  the explorer applies the same renaming to the monitor's verdict state
  (:meth:`Monitor.renamed_key`; :func:`rename_monitor_key` is the same).
  Two product states get the same key only if one renaming maps one onto
  the other, so the reduction is sound whenever the model and the monitor
  treat the renamed ids alike (the monitor does: it never compares ids
  except for equality, and block ids only against the pool size).
- ``model.canonical(state)`` alone is paired with the *concrete* monitor
  key.  That is sound only when the model state determines the monitor's
  verdict state (every fact the monitor tracks is also in the model state),
  and it reduces little, since symmetric states usually have renamed monitor
  states.  Prefer ``symmetry``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._errors import UsageError
from ..protocol import Renaming
from ..spec import HistoryHeader, Monitor
from ._results import Counterexample, ExploreResult, Step, trace_header
from ._search import _Search
from ._traces import rerun

__all__ = [
    "Step",
    "Counterexample",
    "ExploreResult",
    "Renaming",
    "explore",
    "rerun",
    "rename_monitor_key",
    "trace_header",
]


def rename_monitor_key(
    key: tuple, names: Mapping[str, str], blocks: Mapping[tuple[str, int], int] | None = None
) -> tuple:
    """Apply a renaming of ids to a :meth:`Monitor.key` value: the key of a
    monitor fed the renamed events (:meth:`Monitor.renamed_key`)."""
    return Monitor.renamed_key(key, names, {} if blocks is None else blocks)


def explore(
    model: Any,
    *,
    max_states: int | None = None,
    symmetry: bool = True,
    fingerprint: bool = False,
    monitor_factory: Callable[[], Monitor] | None = None,
    monitor: bool = True,
    progress: Callable[[dict[str, Any]], None] | None = None,
    progress_interval: float = 0.2,
    keep_graph: bool = False,
    graph_limit: int = 20_000,
    stop_on_first: bool = True,
    check_deadlock: bool = True,
    freeze_gc: bool = True,
    intern: bool = True,
    backend: Callable[[], Any] | None = None,
    max_seconds: float | None = None,
    workers: int | None = None,
    ray: bool | str | None = None,
) -> ExploreResult:
    """Explore ``model`` breadth-first; return what was found.

    ``monitor_factory`` makes the monitor of an empty history (default:
    ``Monitor.from_header(model.header, complete=True)``: its policy, pools and KV layout);
    ``monitor=False`` explores the model alone (no event checking).
    ``fingerprint`` keeps 64-bit hashes of visited states instead of the
    states.  ``stop_on_first`` stops at the first counterexample; otherwise
    the search goes on and keeps the first (shortest) one of each invariant.
    ``keep_graph`` builds a :mod:`networkx` ``MultiDiGraph`` of the explored
    space (``result.graph``; ``None`` above ``graph_limit`` states).
    ``progress`` is called about every ``progress_interval`` seconds with a
    dict of counters.  ``intern`` shares equal parts of stored states (see
    docs/modeling.md, "Memory").

    ``backend`` (a factory of data backends such as
    :class:`pdproto.TorchBackend`: ``apply(event) ->
    violations``, ``finish()``, ``copy()``) runs along the BFS tree: every
    new state gets a copy of its parent's backend (the backend of the first
    path that reached it) with the step's events applied; only states of the
    frontier hold one.  Its violations are reported like the monitor's, with
    the shortest trace of the tree; on a transition the monitor rejects, and
    at a quiet state, the backend also finishes the history (in-flight
    transfers land, everything readable is verified).

    ``max_seconds`` stops the search once that much time has passed (like
    ``max_states``: ``truncated``, ``stopped_by`` says which limit).

    ``workers`` (an int >= 1) runs the search on that many worker processes,
    each owning the states that hash to it (docs/scaling.md); ``ray`` runs it
    on Ray actors instead, ``workers`` of them (default 2): ``True`` for a
    local Ray instance, an address (``"ray://host:10001"``, ``"auto"``) for
    a cluster.  A parallel search that runs to its end gives the serial
    search's answers: the same counts, deadlocks, unmet sometimes and, for
    each invariant, a counterexample of the same length; one that stops
    early stops at the end of a level.  Neither takes ``backend`` nor
    ``keep_graph``.
    """
    header: HistoryHeader = getattr(model, "header", None) or HistoryHeader()
    if keep_graph and fingerprint:
        raise UsageError("fingerprint with a state graph", True, "exact mode (a graph needs the states)")
    if max_states is not None and (type(max_states) is not int or max_states < 1):
        raise UsageError("max_states", max_states, "an integer >= 1")
    if max_seconds is not None and (
        isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0
    ):
        raise UsageError("max_seconds", max_seconds, "a number of seconds > 0")
    parallel = workers is not None or (ray is not None and ray is not False)
    if workers is not None and (type(workers) is not int or workers < 1):
        raise UsageError("workers", workers, "an integer >= 1")
    if parallel and backend is not None:
        raise UsageError(
            "a parallel search with a data backend", "backend", "a serial search (no workers, no ray)"
        )
    if parallel and keep_graph:
        raise UsageError(
            "a parallel search with a state graph", "keep_graph", "a serial search (no workers, no ray)"
        )
    template = None
    if monitor:
        template = (
            monitor_factory() if monitor_factory is not None else Monitor.from_header(header, complete=True)
        )
    if parallel:
        return _explore_parallel(
            model,
            workers=workers,
            ray=ray,
            header=header,
            template=template,
            max_states=max_states,
            max_seconds=max_seconds,
            symmetry=symmetry,
            fingerprint=fingerprint,
            progress=progress,
            progress_interval=progress_interval,
            stop_on_first=stop_on_first,
            check_deadlock=check_deadlock,
            intern=intern,
        )
    return _Search(
        model,
        header=header,
        template=template,
        max_states=max_states,
        max_seconds=max_seconds,
        symmetry=symmetry,
        fingerprint=fingerprint,
        progress=progress,
        progress_interval=progress_interval,
        keep_graph=keep_graph,
        graph_limit=graph_limit,
        stop_on_first=stop_on_first,
        check_deadlock=check_deadlock,
        freeze_gc=freeze_gc,
        intern=intern,
        backend=backend,
    ).run()


def _explore_parallel(model: Any, *, workers: int | None, ray: bool | str | None, **kw: Any) -> ExploreResult:
    """:func:`explore` on worker processes or Ray actors."""
    from ._parallel import ProcessPool, explore_parallel

    if ray is not None and ray is not False:
        from ._ray import ray_pool_factory

        return explore_parallel(
            model,
            pool_factory=ray_pool_factory(None if ray is True else ray),
            workers=workers if workers is not None else 2,
            **kw,
        )
    return explore_parallel(model, pool_factory=ProcessPool, workers=workers, **kw)
