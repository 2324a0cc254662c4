"""The serial fuzz run: one Hypothesis state machine (:mod:`._machine`) in this
process, timed and counted into a :class:`~._fuzz_results.FuzzResult`.
Imports Hypothesis only when it runs.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from typing import Any

from ..spec import write_history
from ._fuzz_results import (
    PHASE_NAMES,
    FuzzResult,
    FuzzStats,
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


__all__ = ["fuzz_serial"]
