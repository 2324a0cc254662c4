"""The parallel fuzzer: one fuzz run's example budget split over worker
processes (or Ray tasks, :mod:`._ray_fuzz`), merged into one
:class:`~pdproto.drivers.FuzzResult` that reads like a serial run's.

- **Budget.**  ``examples`` is split as evenly as it goes: worker ``i`` of
  ``n`` runs ``examples // n`` examples, one more when ``i < examples % n``
  (:func:`split_examples`); a worker with no example is not started, and
  a run on this machine asks for at most :data:`WORKERS_PER_CPU` workers
  per CPU (:func:`check_local_workers`).
- **Seeds.**  Worker ``i`` fuzzes with :func:`worker_seed` ``(seed, i)``, a
  digest of the user's seed and ``i``: distinct per worker and the same on
  every run, so the same seed gives the same merged result without an
  example database.  With no seed, one is drawn and
  reported, so the run can be repeated.
- **Database.**  Every worker opens the same example-database directory
  under the same key (the model and its configuration): a failure one
  worker saved is replayed first by every worker of the next run, parallel
  or serial and unseeded.  Unlike a serial seeded run, each worker keeps the
  database on under its seed (``seeded_database``).
- **Merge** (:func:`merge`).  Examples, steps, episodes and the action and
  fault counts add up; distinct states are the union of the workers' sets;
  the reported failure is the shortest one (ties: the lowest worker,
  ``found_by_worker``; ``found_at_example`` is that worker's own example), and
  ``invariants_found`` names, per invariant, the worker that found its
  shortest failure.  Rates divide by the wall time of the whole run;
  ``cpu_seconds`` and ``phase_seconds`` add up the workers'.

A worker does not stop when another finds a failure (that would make the
merged counts depend on timing); a parallel run that finds nothing takes as
long as one that does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import time
import traceback
from collections.abc import Sequence
from typing import Any

from .._errors import UsageError
from ..spec import write_history
from ._fuzz_budget import (
    WORKERS_PER_CPU,
    BudgetSlice,
    FuzzWorkerError,
    Share,
    _summary,
    check_local_workers,
    max_local_workers,
    plan,
    run_share,
    split_examples,
    worker_seed,
)
from ._fuzz_results import PHASE_NAMES, FuzzResult, FuzzStats, HandoffFailure, reachable_states
from ._remote import portable

# -- worker processes --------------------------------------------------------------


def _child(conn: Any, model: Any, share: BudgetSlice, options: dict[str, Any]) -> None:
    try:
        reply = (True, run_share(model, share, options))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        reply = (False, (traceback.format_exc(), _summary(exc)))
    try:
        conn.send(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle
        conn.send((False, (traceback.format_exc(), _summary(exc))))
    conn.close()


def run_processes(model: Any, shares: Sequence[BudgetSlice], options: dict[str, Any]) -> list[FuzzResult]:
    """Run each share in a worker process of this machine (forked where the
    platform can: the model is not pickled then) and return their results
    in share order.  Replies are read as they come: the first worker that
    fails raises :class:`FuzzWorkerError` at once, and the others are
    terminated; every worker is ended before this returns."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    procs, conns = [], []
    failed = True  # until every reply came back
    sent = model if ctx.get_start_method() == "fork" else portable(model)
    try:
        for share in shares:
            here, there = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(there, sent, share, options),
                daemon=True,
                name=f"pdproto-fuzz-{share.worker}",
            )
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        replies: dict[int, FuzzResult] = {}
        waiting = {conn: i for i, conn in enumerate(conns)}
        while waiting:
            for conn in multiprocessing.connection.wait(list(waiting)):
                i = waiting.pop(conn)  # type: ignore[call-overload]
                try:  # receive before join: a large reply fills the pipe
                    ok, value = conn.recv()
                except EOFError:
                    p = procs[i]
                    p.join(timeout=5)
                    ok, value = False, ("", f"the worker process exited (code {p.exitcode})")
                if not ok:
                    raise FuzzWorkerError(shares[i].worker, *value)
                replies[i] = value
        failed = False
        return [replies[i] for i in range(len(shares))]
    finally:
        for p in procs:
            if failed and p.is_alive():
                p.terminate()  # a worker failed: the others' work is not reported
            p.join(timeout=0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in conns:
            conn.close()


# -- the merge --------------------------------------------------------------------


def merge(
    results: Sequence[FuzzResult],
    shares: Sequence[BudgetSlice],
    *,
    workers: int,
    seed: int,
    seconds: float,
    name: str,
    expected: str | None,
    reachable: int | None = None,
    stats: FuzzStats | None = None,
    out: str | None = None,
) -> FuzzResult:
    """One :class:`FuzzResult` from the workers' (see the module doc).
    ``workers``: the workers asked for (``workers_requested``; ``workers``
    counts the shares that ran).  ``stats``: a :class:`FuzzStats` to merge
    into (else a new one); ``out``: where the failure's history is (to be)
    written."""
    merged = stats if stats is not None else FuzzStats()
    merged.reachable = reachable
    failed = []
    for share, r in zip(shares, results):
        s = r.stats
        merged.examples += s.examples
        merged.steps += s.steps
        merged.teardown_steps += s.teardown_steps
        merged.episodes += s.episodes
        merged.states |= s.states
        merged.actions.update(s.actions)
        merged.faults.update(s.faults)
        if r.failure is not None:
            failed.append((len(r.failure.trace), share.worker, r))
    merged.seconds = seconds
    failure, found_by = None, None
    if failed:
        _, found_by, first = min(failed, key=lambda f: f[:2])
        f = first.failure
        failure = merged.failure = HandoffFailure(f.violation, f.trace, out, f.events, f.header)
        merged.found_at = first.counters.get("found_at_example")
    counters = merged.to_dict()
    counters["seconds"] = round(seconds, 3)
    counters["cpu_seconds"] = round(sum(r.counters.get("cpu_seconds", 0.0) for r in results), 3)
    counters["phase_seconds"] = {
        phase: round(sum(r.counters.get("phase_seconds", {}).get(phase, 0.0) for r in results), 3)
        for phase in PHASE_NAMES
    }
    counters["workers"] = len(shares)
    counters["workers_requested"] = workers
    # found_at_example is the finding worker's own example number
    counters["found_by_worker"] = found_by
    best: dict[str, dict[str, Any]] = {}
    for steps, worker, r in sorted(failed, key=lambda f: f[:2]):
        best.setdefault(
            r.failure.violation.invariant,
            {"worker": worker, "steps": steps, "found_at_example": r.counters.get("found_at_example")},
        )
    counters["invariants_found"] = best
    counters["worker_runs"] = [
        {
            "worker": share.worker,
            "seed": share.seed,
            "examples": r.counters["examples"],
            "steps": r.counters["steps"],
            "distinct_states": r.counters["distinct_states"],
            "seconds": r.counters["seconds"],
            "invariant": None if r.failure is None else r.failure.violation.invariant,
        }
        for share, r in zip(shares, results)
    ]
    return FuzzResult(
        model=name,
        expected=expected,
        seed=seed,
        seconds=seconds,
        counters=counters,
        failure=failure,
        stats=merged,
    )


def fuzz_parallel(
    model: Any, arguments: dict[str, Any], *, workers: int | None = None, ray: bool | str = False
) -> FuzzResult:
    """:func:`~pdproto.fuzz` (``arguments``: its keyword arguments, all of
    them, ``out`` checked and ``name`` and ``stats`` set) with its budget
    split over ``workers`` worker processes, or Ray tasks with ``ray`` (True:
    a local Ray instance, or the address of a cluster; ``workers`` defaults
    to the cluster's CPUs then).  ``stats`` is filled in at the end (the
    workers count in their own processes)."""
    if workers is not None and workers < 1:
        raise UsageError("workers", workers, "an integer >= 1")
    if workers is not None and (ray is False or (ray is True and "RAY_ADDRESS" not in os.environ)):
        check_local_workers(workers)  # processes, or a local Ray instance's CPUs
    examples, database, name = arguments["examples"], arguments["database"], arguments["name"]
    out_path, expected, coverage_states = (
        arguments["out"],
        arguments["expected"],
        arguments["coverage_states"],
    )
    seed = arguments["seed"] if arguments["seed"] is not None else random.SystemRandom().getrandbits(32)
    reachable = reachable_states(model, max_states=coverage_states) if coverage_states is not None else None
    options = {key: arguments[key] for key in ("steps", "backend", "name", "expected", "explain")}
    # one directory for every worker, wherever it runs from
    options.update(out=None, database=None if database is None else os.path.abspath(database))
    t0 = time.perf_counter()
    if ray is not False:
        from ._ray_fuzz import run_ray

        results, shares, workers = run_ray(
            model, examples, workers, seed, options, address=None if ray is True else str(ray)
        )
    else:
        workers = workers or 1
        shares = plan(examples, workers, seed)
        results = run_processes(model, shares, options)
    seconds = time.perf_counter() - t0
    result = merge(
        results,
        shares,
        workers=workers,
        seed=seed,
        seconds=seconds,
        name=name,
        expected=expected,
        reachable=reachable,
        stats=arguments["stats"],
        out=out_path,
    )
    if result.failure is not None and out_path is not None:
        write_history(out_path, result.failure.events, result.failure.header)
    return result


__all__ = [
    "fuzz_parallel",
    "FuzzWorkerError",
    "BudgetSlice",
    "Share",
    "plan",
    "split_examples",
    "worker_seed",
    "WORKERS_PER_CPU",
    "max_local_workers",
    "check_local_workers",
    "portable",
    "run_share",
    "run_processes",
    "merge",
]
