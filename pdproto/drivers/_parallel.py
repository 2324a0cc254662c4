"""The parallel explorer: a level-synchronous breadth-first search over
shards (:mod:`._parallel_shard`), one per worker process, or per Ray actor
(:mod:`._ray`).

Per level the coordinator asks every shard to expand its frontier, hands
each shard the batches the others made for it, and asks it to merge them;
the merged states are the next level.  Only the counters, the batches and,
at the end, the findings and the links along each counterexample pass
through the coordinator (with Ray the batches go from actor to actor
through the object store).

The result equals the serial search's on a search that runs to its end:
the same states, transitions, depth, deadlocks, unmet ``sometimes``
properties, and for each invariant a counterexample of the same (shortest)
length.  Under a symmetry reduction that leaves two states of one class
apart (the reference's, where the monitor remembers the blocks of ended
transfers), which duplicates survive depends on the order of discovery, so
state counts can differ a little; verdicts and depths cannot
(docs/scaling.md, "The same answers").  A search that stops early stops at the end of a
level: at its first counterexample (with ``stop_on_first``; the shallowest
finding is reported, of the same length as the serial search's), or once
``max_states`` or ``max_seconds`` is passed; its counts are those of the
levels it finished, so they can differ from the serial search's, which stops
in the middle of a level.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import traceback
from array import array
from collections.abc import Callable
from typing import Any

from .._errors import PdprotoError
from ..spec import HistoryHeader, Monitor
from ._parallel_shard import Shard
from ._remote import hash_seed_env
from ._results import Counterexample, ExploreResult
from ._traces import _counterexample
from ._visited import _collision_probability


class WorkerError(PdprotoError):
    """A worker of a parallel search failed: ``worker`` its number,
    ``detail`` the traceback it printed."""

    def __init__(self, worker: int, detail: str) -> None:
        self.worker = worker
        self.detail = detail
        last = detail.strip().splitlines()[-1] if detail.strip() else "?"
        super().__init__(f"parallel search worker {worker} failed: {last}")


def _serve(conn: Any, args: tuple, kwargs: dict) -> None:
    """A worker process: build the shard, then answer calls until told to stop.
    The cyclic GC is off, as in the serial search (states are acyclic tuples)."""
    gc.freeze()
    gc.disable()
    try:
        shard = Shard(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the coordinator
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        name, margs = msg
        try:
            conn.send((True, getattr(shard, name)(*margs)))
        except BaseException:  # noqa: BLE001 - reported to the coordinator
            conn.send((False, traceback.format_exc()))


class ProcessPool:
    """Shards in worker processes on this machine (fork where there is one)."""

    def __init__(self, model: Any, template: Monitor | None, n: int, opts: dict[str, Any]) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.n = n
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        saved = {k: os.environ.get(k) for k in hash_seed_env()}
        if ctx.get_start_method() != "fork":  # spawned interpreters must hash alike
            os.environ.update(hash_seed_env())
        try:
            for wid in range(n):
                here, there = ctx.Pipe()
                p = ctx.Process(
                    target=_serve,
                    args=(there, (model, template, wid, n), opts),
                    daemon=True,
                    name=f"pdproto-explore-{wid}",
                )
                p.start()
                there.close()
                self.conns.append(here)
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._gather()
        self.pending: list[list] = [[] for _ in range(n)]

    def _gather(self) -> list[Any]:
        out = []
        error = None
        for wid, conn in enumerate(self.conns):
            try:
                ok, value = conn.recv()
            except EOFError:
                ok, value = False, f"worker process exited (code {self.procs[wid].exitcode})"
            if not ok and error is None:
                error = WorkerError(wid, value)
            out.append(value)
        if error is not None:
            raise error
        return out

    def call(self, name: str, per_worker: list[tuple] | None = None) -> list[Any]:
        for wid, conn in enumerate(self.conns):
            conn.send((name, per_worker[wid] if per_worker is not None else ()))
        return self._gather()

    def expand(self) -> list[dict[str, Any]]:
        res = self.call("expand")
        self.pending = [[res[w][1][d] for w in range(self.n)] for d in range(self.n)]
        return [r[0] for r in res]

    def merge(self) -> list[dict[str, Any]]:
        pending, self.pending = self.pending, [[] for _ in range(self.n)]
        return self.call("merge", [(p,) for p in pending])

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()


def explore_parallel(
    model: Any,
    *,
    pool_factory: Callable[[Any, Monitor | None, int, dict[str, Any]], Any],
    workers: int,
    header: HistoryHeader,
    template: Monitor | None,
    max_states: int | None,
    max_seconds: float | None,
    symmetry: bool,
    fingerprint: bool,
    progress: Callable[[dict[str, Any]], None] | None,
    progress_interval: float,
    stop_on_first: bool,
    check_deadlock: bool,
    intern: bool,
) -> ExploreResult:
    """Run the level-synchronous search on ``workers`` shards made by
    ``pool_factory`` (see the module doc)."""
    opts = {
        "symmetry": symmetry,
        "fingerprint": fingerprint,
        "intern": intern,
        "check_deadlock": check_deadlock,
    }
    t0 = time.perf_counter()
    pool = pool_factory(model, template, workers, opts)
    try:
        probes = pool.call("probe")
        if any(p != probes[0] for p in probes):
            raise PdprotoError(
                "the worker processes hash this model's states differently (a state holds an object "
                "hashed by identity, or the workers run with different PYTHONHASHSEED): run without "
                "--workers/--ray"
            )
        t0 = time.perf_counter()
        run = _Run(pool, workers, t0, progress, progress_interval)
        run.account(pool.call("seed"), False)
        stopped_by = None
        if stop_on_first and run.found:
            stopped_by = "counterexample"
        while stopped_by is None and run.frontier:
            if max_states is not None and run.states >= max_states:
                stopped_by = "max_states"
                break
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                stopped_by = "max_seconds"
                break
            run.account(pool.expand(), True)
            run.account(pool.merge(), False)
            run.level += 1
            if stop_on_first and run.found:
                stopped_by = "counterexample"
        seconds = time.perf_counter() - t0
        finals = pool.call("finish")
        return _result(
            model,
            header,
            template,
            pool,
            run,
            finals,
            seconds,
            stopped_by,
            stop_on_first,
            fingerprint,
            symmetry,
        )
    finally:
        pool.close()


class _Run:
    """The coordinator's counters, summed over the shards after each call."""

    def __init__(self, pool: Any, n: int, t0: float, progress: Callable | None, interval: float) -> None:
        self.pool, self.n, self.t0, self.progress, self.interval = pool, n, t0, progress, interval
        self.states = self.transitions = self.frontier = self.peak_frontier = self.level = 0
        self.found = False
        self.rss = self.peak_rss = 0
        self.levels: list[int] = []  # states per finished level
        self.next_report = t0

    def account(self, stats: list[dict[str, Any]], expanding: bool) -> None:
        self.transitions = sum(s["transitions"] for s in stats)
        self.rss = sum(s["rss"] for s in stats)
        self.peak_rss = max(self.peak_rss, self.rss)
        self.found = self.found or any(s["found"] is not None for s in stats)
        if expanding:
            return
        states = sum(s["states"] for s in stats)
        self.levels.append(states - self.states)
        self.states = states
        self.frontier = sum(s["frontier"] for s in stats)
        self.peak_frontier = max(self.peak_frontier, self.frontier)
        now = time.perf_counter()
        if self.progress is not None and now >= self.next_report:
            self.next_report = now + self.interval
            self.progress(self.info(now))

    def info(self, now: float, done: bool = False) -> dict[str, Any]:
        out = {
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.level,
            "queue": self.frontier,
            "seconds": now - self.t0,
            "violations": int(self.found),
            "level": self.level,
            "frontier": self.frontier,
            "memory": self.rss,
            "workers": self.n,
            "levels": list(self.levels),
        }
        if done:
            out["done"] = True
        return out


def _result(
    model: Any,
    header: HistoryHeader,
    template: Monitor | None,
    pool: Any,
    run: _Run,
    finals: list[dict[str, Any]],
    seconds: float,
    stopped_by: str | None,
    stop_on_first: bool,
    fingerprint: bool,
    symmetry: bool,
) -> ExploreResult:
    n = run.n
    # the shallowest finding of each invariant over the shards
    best: dict[str, tuple] = {}
    for fin in finals:
        for inv, f in fin["found"].items():
            if inv not in best or f[:3] < best[inv][:3]:
                best[inv] = f
    chosen = sorted(best.items(), key=lambda kv: kv[1][:3])
    if stop_on_first:
        chosen = chosen[:1]
    paths = _paths(pool, n, [f[2] for _, f in chosen])
    found: dict[str, list[Counterexample]] = {"violation": [], "deadlock": [], "state-invariant": []}
    for (inv, (_, _, _, kind, message)), (initial, acts) in zip(chosen, paths):
        parents = array("q", range(-1, len(acts)))
        via = array("q", [initial, *acts])
        found[kind].append(
            _counterexample(model, header, template, parents, via, len(acts), kind, inv, message)
        )
    met = set().union(*(fin["met"] for fin in finals))
    sometimes = list(getattr(model, "sometimes", None) or {})
    memory: dict[str, int] = {}
    for fin in finals:
        for k, v in fin["memory"].items():
            memory[k] = memory.get(k, 0) + v
    states = sum(fin["states"] for fin in finals)
    bps = sum(memory.values()) / states if states else None
    monitor_states = len(set().union(*(fin["monitor_keys"] for fin in finals))) if template is not None else 0
    memory["peak_frontier_entries"] = run.peak_frontier
    memory["monitor_states"] = monitor_states
    memory["workers"] = n
    memory["worker_rss"] = sum(fin["rss"] for fin in finals)
    if progress := run.progress:
        progress(run.info(time.perf_counter(), True))
    stopped = stopped_by is not None
    return ExploreResult(
        model=getattr(model, "name", type(model).__name__),
        states=states,
        transitions=run.transitions,
        depth=max((i for i, c in enumerate(run.levels) if c), default=0),
        seconds=seconds,
        violations=tuple(found["violation"]),
        deadlocks=tuple(found["deadlock"]),
        invariant_failures=tuple(found["state-invariant"]),
        unmet_sometimes=tuple(s for s in sometimes if s not in met),
        met_sometimes=tuple(s for s in sometimes if s in met),
        complete=not stopped,
        truncated=stopped_by in ("max_states", "max_seconds"),
        symmetry=_mode(model, symmetry),
        fingerprint=fingerprint,
        bytes_per_state=bps,
        collision_probability=_collision_probability(states) if fingerprint else None,
        monitor_states=monitor_states,
        graph=None,
        header=header,
        memory=memory,
        stopped_by=stopped_by,
    )


def _mode(model: Any, symmetry: bool) -> str:
    from ._search import _symmetry_hooks

    return _symmetry_hooks(model, symmetry)[0]


def _paths(pool: Any, n: int, gids: list[int]) -> list[tuple[int, list[int]]]:
    """(initial index, action indices) of the path to each state, asking the
    shards that own the states along it (one call per shard per step)."""
    cur = list(gids)
    acts: list[list[int]] = [[] for _ in gids]
    initial = [0] * len(gids)
    live = [i for i in range(len(gids))]
    while live:
        asks: list[list[int]] = [[] for _ in range(n)]
        for i in live:
            asks[cur[i] % n].append(cur[i])
        answers = pool.call("links", [(a,) for a in asks])
        got = {g: link for w in range(n) for g, link in zip(asks[w], answers[w])}
        still = []
        for i in live:
            parent, ai = got[cur[i]]
            if parent < 0:
                initial[i] = ai
            else:
                acts[i].append(ai)
                cur[i] = parent
                still.append(i)
        live = still
    return [(initial[i], acts[i][::-1]) for i in range(len(gids))]
