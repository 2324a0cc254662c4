"""The parallel explorer on Ray (``pdproto check --ray [ADDRESS]``): the
shards of :mod:`._parallel_shard` as Ray actors, one CPU each.

Ray is imported only here, and only when a run asks for it.  Without an
address this joins the Ray instance the process already started, or starts
a local one (and shuts down what it started); with one (``auto``,
``ray://head:10001``, ``head:6379``) it joins that cluster.  The model and
the monitor template go to each actor once, pickled by Ray (a model file
that is not an importable module travels by value).  Actors run with
``PYTHONHASHSEED=0`` so that they partition alike.

Per level each actor's ``expand`` returns its counters and one object per
peer shard (``num_returns``); the coordinator passes those object
references on to the owners' ``merge``, which fetch them from the object
store: the batches go from node to node, never through the coordinator.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from .._errors import PdprotoError
from ._parallel_shard import Shard
from ._remote import hash_seed_env, import_ray, pickle_by_value, portable, rebuilt


class _ShardActor:
    """A shard in a Ray actor (wrapped by ``ray.remote`` when Ray is there)."""

    def __init__(self, model: Any, template: Any, wid: int, n: int, opts: dict[str, Any]) -> None:
        gc.freeze()
        gc.disable()  # as in the serial search: states are acyclic tuples
        self.shard = Shard(rebuilt(model), template, wid, n, **opts)
        self.n = n

    def call(self, name: str, *args: Any) -> Any:
        return getattr(self.shard, name)(*args)

    def expand(self) -> tuple:
        stats, batches = self.shard.expand()
        return (stats, *batches)

    def merge(self, refs: list) -> Any:
        import ray

        return self.shard.merge(ray.get(refs) if refs else [])


class RayPool:
    """``n`` shard actors on a Ray instance (see the module doc)."""

    def __init__(self, model: Any, template: Any, n: int, opts: dict[str, Any], address: str | None) -> None:
        ray = self.ray = import_ray("pdproto check --ray")
        self.n = n
        self.started = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": False,
            }
            if address is None:
                kw["num_cpus"] = max(n, 1)
            try:
                ray.init(address=address, **kw)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise PdprotoError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
            self.started = True
        pickle_by_value(model)
        actor = ray.remote(num_cpus=1)(_ShardActor)
        env = {"env_vars": hash_seed_env()}
        shipped = ray.put(portable(model))
        self.actors = [
            actor.options(runtime_env=env).remote(shipped, template, wid, n, opts) for wid in range(n)
        ]
        self.pending: list[list] = [[] for _ in range(n)]

    def _get(self, refs: list) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayError as exc:
            from ._parallel import WorkerError

            raise WorkerError(-1, str(exc)) from None

    def call(self, name: str, per_worker: list[tuple] | None = None) -> list[Any]:
        return self._get(
            [
                a.call.remote(name, *(per_worker[w] if per_worker is not None else ()))
                for w, a in enumerate(self.actors)
            ]
        )

    def expand(self) -> list[dict[str, Any]]:
        n = self.n
        refs = [a.expand.options(num_returns=n + 1).remote() for a in self.actors]
        stats = self._get([r[0] for r in refs])
        self.pending = [[refs[w][1 + d] for w in range(n) if w != d] for d in range(n)]
        return stats

    def merge(self) -> list[dict[str, Any]]:
        pending, self.pending = self.pending, [[] for _ in range(self.n)]
        return self._get([a.merge.remote(pending[d]) for d, a in enumerate(self.actors)])

    def close(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        if self.started:
            self.ray.shutdown()


def ray_pool_factory(address: str | None) -> Callable[[Any, Any, int, dict[str, Any]], RayPool]:
    """A pool factory for :func:`~._parallel.explore_parallel` on Ray at ``address``."""
    return lambda model, template, n, opts: RayPool(model, template, n, opts, address)
