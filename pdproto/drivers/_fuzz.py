"""Fuzzing as a library: :func:`fuzz`, the entry point, checks its arguments
and runs the serial fuzzer (:mod:`._fuzz_serial`: a model's Hypothesis state
machine, :mod:`pdproto.drivers._machine`) or the parallel one
(:mod:`._parallel_fuzz`, processes or Ray tasks), and returns a
:class:`FuzzResult`.

What a fuzz run reports (the failure, the coverage and speed counters) is in
:mod:`._fuzz_results`, which every fuzz driver imports (this module re-exports
it); Hypothesis is imported only when :func:`fuzz` runs, so that ``import
pdproto`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._errors import UsageError
from ._fuzz_results import DEFAULT_DATABASE as DEFAULT_DATABASE
from ._fuzz_results import FAULT_ACTION_KINDS as FAULT_ACTION_KINDS
from ._fuzz_results import PHASE_NAMES as PHASE_NAMES
from ._fuzz_results import FuzzResult as FuzzResult
from ._fuzz_results import FuzzStats as FuzzStats
from ._fuzz_results import HandoffFailure as HandoffFailure
from ._fuzz_results import canonical_function as canonical_function
from ._fuzz_results import fault_kind as fault_kind
from ._fuzz_results import format_steps as format_steps
from ._fuzz_results import pick_failure as pick_failure
from ._fuzz_results import reachable_states as reachable_states
from ._fuzz_serial import fuzz_serial as fuzz_serial


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
