"""A parallel fuzz run's budget, shared by its two harnesses (worker processes,
:mod:`._parallel_fuzz`, and Ray tasks, :mod:`._ray_fuzz`): how the example
budget is split into :class:`BudgetSlice` s, one per worker, with each
worker's seed, how many workers this machine allows, what one worker runs
(:func:`run_share`) and the error a failed worker raises.  See
:mod:`._parallel_fuzz` for the rules.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import attrs

from .._errors import PdprotoError, UsageError
from ._fuzz_results import FuzzResult, FuzzStats
from ._fuzz_serial import fuzz_serial
from ._remote import rebuilt


class FuzzWorkerError(PdprotoError):
    """A worker of a parallel fuzz run failed with something other than a
    violation: ``worker`` its number, ``detail`` its traceback."""

    def __init__(self, worker: int, detail: str, summary: str | None = None) -> None:
        self.worker = worker
        self.detail = detail
        lines = detail.strip().splitlines()
        #: the error in one line (``Type: message``)
        self.summary = summary or (lines[-1] if lines else "?")
        super().__init__(f"fuzz worker {worker} failed: {self.summary}")


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def split_examples(examples: int, workers: int) -> list[int]:
    """The examples of each of ``workers`` shares of ``examples`` (they add
    up to ``examples``; the first ``examples % workers`` get one more).  At
    most ``max(examples, 1)`` shares: a worker with no example gets no entry."""
    if workers < 1:
        raise UsageError("workers", workers, "an integer >= 1")
    workers = min(workers, max(examples, 1))
    base, extra = divmod(examples, workers)
    return [base + (1 if i < extra else 0) for i in range(workers)]


#: worker processes (or tasks of a local Ray instance) allowed per CPU of
#: this machine: more only time-slice the same CPUs
WORKERS_PER_CPU = 4


def max_local_workers() -> int:
    """The most workers a run on this machine may ask for:
    :data:`WORKERS_PER_CPU` per CPU this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return WORKERS_PER_CPU * max(cpus, 1)


def check_local_workers(workers: int) -> None:
    """:class:`UsageError` naming ``workers`` when it is far above this
    machine's CPUs (:func:`max_local_workers`)."""
    limit = max_local_workers()
    if workers > limit:
        raise UsageError(
            "workers",
            workers,
            f"at most {limit} on this machine ({WORKERS_PER_CPU} per CPU; "
            "a Ray cluster's address takes more)",
        )


def worker_seed(seed: int, worker: int) -> int:
    """Worker ``worker``'s seed: 32 bits of a SHA-256 digest of the run's
    seed and the worker's number (distinct per worker, the same every run)."""
    digest = hashlib.sha256(f"pdproto-fuzz:{seed}:{worker}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@attrs.frozen
class BudgetSlice:
    """What one worker runs: its number, examples and seed (its slice of the
    run's example budget)."""

    worker: int
    examples: int
    seed: int


#: the old name of :class:`BudgetSlice` (kept working; the history event
#: ``share`` is :class:`pdproto.spec.Share`, another thing)
Share = BudgetSlice


def plan(examples: int, workers: int, seed: int) -> list[BudgetSlice]:
    """The budget slices of a run, one per worker (workers with no example left out)."""
    return [
        BudgetSlice(i, n, worker_seed(seed, i)) for i, n in enumerate(split_examples(examples, workers)) if n
    ]


def run_share(model: Any, share: BudgetSlice, options: dict[str, Any]) -> FuzzResult:
    """Fuzz ``model`` (or what :func:`portable` made of it) for one share:
    what a worker process or Ray task runs."""
    model = rebuilt(model)
    # seeded, and still on the shared database (a serial seeded run is not)
    return fuzz_serial(
        model, examples=share.examples, seed=share.seed, stats=FuzzStats(), seeded_database=True, **options
    )


__all__ = [
    "FuzzWorkerError",
    "BudgetSlice",
    "Share",
    "plan",
    "split_examples",
    "worker_seed",
    "WORKERS_PER_CPU",
    "max_local_workers",
    "check_local_workers",
    "run_share",
]
