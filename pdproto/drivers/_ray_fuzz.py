"""The parallel fuzzer on Ray (``pdproto fuzz --ray [ADDRESS]``): each share
of the budget (:mod:`._parallel_fuzz`) runs as one Ray task of one CPU.

Ray is imported only here, and only when a run asks for it.  Without an
address this joins the Ray instance the process already started, or the
cluster ``RAY_ADDRESS`` names, or starts a local one of ``workers`` CPUs
(all of the machine's without ``workers``), and shuts down what it
started.  The model goes to the object store once, pickled by Ray (a
:class:`~pdproto.HandoffModel` as its class and configuration, rebuilt in
each task: :func:`~._parallel_fuzz.portable`; a model file that is not an
importable module by value); each task sends back its whole
:class:`~pdproto.drivers.FuzzResult`, distinct states included.  The
example database is a directory on each node: on a cluster, tasks on other
machines share it only when it is on a shared file system.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import UsageError
from ._fuzz_budget import BudgetSlice, FuzzWorkerError, _summary, plan, run_share
from ._fuzz_results import FuzzResult
from ._remote import import_ray, pickle_by_value, portable


def run_ray(
    model: Any,
    examples: int,
    workers: int | None,
    seed: int,
    options: dict[str, Any],
    *,
    address: str | None = None,
) -> tuple[list[FuzzResult], list[BudgetSlice], int]:
    """Run the shares of ``examples`` (over ``workers`` tasks, default: the
    cluster's CPUs) as Ray tasks; their results and the shares, in order,
    and the workers asked for (the cluster's CPUs when ``workers`` is None)."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if address is None and workers is not None:
            kw["num_cpus"] = workers  # a local instance of one CPU per worker (as check --ray)
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            # the value that failed: the address given (even ''), else RAY_ADDRESS, else the flag
            what, where = (
                ("--ray", address)
                if address is not None
                else ("RAY_ADDRESS", os.environ["RAY_ADDRESS"])
                if os.environ.get("RAY_ADDRESS")
                else ("--ray (a local Ray instance)", True)
            )
            raise UsageError(
                what,
                where,
                f"a Ray cluster to join or start ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else '?'})",
            ) from None
    try:
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        shares = plan(examples, workers, seed)
        pickle_by_value(model)  # a model file that is not an importable module travels by value
        task = ray.remote(num_cpus=1, max_retries=0)(run_share)
        model_ref = ray.put(portable(model))
        refs = [task.remote(model_ref, share, options) for share in shares]
        results = []
        for share, ref in zip(shares, refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                for other in refs:
                    ray.cancel(other, force=True)
                cause = getattr(exc, "cause", None)  # a task's own exception
                summary = _summary(cause) if isinstance(cause, BaseException) else None
                raise FuzzWorkerError(share.worker, str(exc), summary) from None
        return results, shares, workers
    finally:
        if started:
            ray.shutdown()


__all__ = ["run_ray", "import_ray"]  # import_ray: pdproto.drivers._remote's
