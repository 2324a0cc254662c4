"""Conformance speed: events/second of ``pdproto conform`` on a long history
with hundreds of concurrent requests.

The history is made of real reference behaviour: each request is one random
run of a one-request reference model (with cancels, timeouts, lost and
duplicated messages, transfer failures and retries), and the runs are
interleaved step by step, hundreds at a time, over 4 P and 4 D workers.
Every id is renamed as a real system would name it: request ``req-N``,
tickets ``tkt-…``, transfers ``xfer-…``, and block ids drawn from each
worker's shared pool at every allocation (so block ids differ from the
model's and are reused across requests).  The history therefore conforms;
the benchmark times :func:`pdproto.conform` on it.

    python benchmarks/conform_speed.py                     # 100,000 events, 300 concurrent
    python benchmarks/conform_speed.py --events 20000 --concurrent 100
    python benchmarks/conform_speed.py --quick             # 10,000 events, 50 concurrent (CI)

Target (issue 14): at least 100,000 events with hundreds of concurrent
requests, on this 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import attrs  # noqa: E402

from pdproto.protocol import HandoffModel, ModelConfig  # noqa: E402
from pdproto.spec import Free, HistoryHeader, PrefillStart, Reserve, TransferStart, WorkerSpec  # noqa: E402
from pdproto.spec import Decode  # noqa: E402
from pdproto.spec import write_history  # noqa: E402

FAULTS = {"cancel": 1, "dup": 1, "loss": 1, "reorder": 1, "timeout": 1, "transfer_fail": 1, "retry": 1}


def request_steps(model: HandoffModel, rng: random.Random, max_steps: int = 60) -> list[tuple]:
    """One random run of a one-request model, as its steps' events."""
    s = model.initial_states()[0]
    steps = []
    for _ in range(max_steps):
        acts = model.actions(s)
        if not acts:
            break
        s, evs = model.step(s, rng.choice(acts))
        if evs:
            steps.append(evs)
    return steps


class _Namer:
    """Renames one request's model ids to real-looking ones; draws block ids
    from the shared pools."""

    def __init__(self, n: int, p: str, d: str, pools: dict, rng: random.Random) -> None:
        self.n, self.pools, self.rng = n, pools, rng
        self.workers = {"P0": p, "D0": d}
        self.blocks: dict = {}  # (model worker, block) -> real block

    def ids(self, kind: str, model_id: str) -> str:
        return f"{kind}-{self.n}-{model_id.replace(':', '-')}"

    def take(self, w: str, blocks: tuple) -> tuple:
        pool = self.pools[self.workers[w]]
        out = []
        for b in blocks:
            real = pool.pop(self.rng.randrange(len(pool)))
            self.blocks[(w, b)] = real
            out.append(real)
        return tuple(out)

    def give(self, w: str, blocks: tuple) -> tuple:
        out = tuple(self.blocks.pop((w, b)) for b in blocks)
        self.pools[self.workers[w]].extend(out)
        return out

    def map(self, w: str, blocks: tuple) -> tuple:
        return tuple(self.blocks[(w, b)] for b in blocks)

    def rename(self, e: object) -> object:
        changes: dict = {}
        if hasattr(e, "request") and e.request is not None:  # type: ignore[attr-defined]
            changes["request"] = f"req-{self.n}"
        for f in ("ticket", "transfer"):
            if getattr(e, f, None) is not None:
                changes[f] = self.ids("tkt" if f == "ticket" else "xfer", getattr(e, f))
        for f in ("worker", "src", "dst"):
            if getattr(e, f, None) is not None:
                changes[f] = self.workers[getattr(e, f)]
        if isinstance(e, (Reserve, PrefillStart)):
            changes["blocks"] = self.take(e.worker, e.blocks)
        elif isinstance(e, Free):
            changes["blocks"] = self.give(e.worker, e.blocks)
        elif isinstance(e, TransferStart):
            changes["src_blocks"] = self.map(e.src, e.src_blocks)
            changes["dst_blocks"] = self.map(e.dst, e.dst_blocks)
        elif isinstance(e, Decode):
            changes["blocks"] = self.map(e.worker, e.blocks)
        return attrs.evolve(e, **changes)


def history(events: int, concurrent: int, seed: int = 1, workers: int = 4, pool: int = 4096,
            policy: str = "push") -> tuple[HistoryHeader, Iterator]:
    """A conforming history of about ``events`` events, ``concurrent``
    requests in flight at once."""
    rng = random.Random(seed)
    models = [HandoffModel(ModelConfig(policy=policy, requests=1, blocks=8, block_size=4, prompt_len=L,
                                       max_new_tokens=M, faults=FAULTS))
              for L in (5, 9, 13) for M in (2, 3, 4)]
    names = [f"prefill-{i}" for i in range(workers)], [f"decode-{i}" for i in range(workers)]
    pools = {w: list(range(pool)) for w in names[0] + names[1]}
    header = HistoryHeader(policy=policy, complete=False,
                           workers={w: WorkerSpec("prefill" if w.startswith("p") else "decode", pool)
                                    for w in names[0] + names[1]}, extra={"block_size": 4})

    def gen() -> Iterator:
        live: list = []
        n = made = 0
        while made < events:
            while len(live) < concurrent:
                namer = _Namer(n, rng.choice(names[0]), rng.choice(names[1]), pools, rng)
                live.append([namer, request_steps(rng.choice(models), rng), 0])
                n += 1
            k = rng.randrange(len(live))
            namer, steps, i = live[k]
            for e in steps[i]:
                yield namer.rename(e)
                made += 1
            live[k][2] += 1
            if live[k][2] >= len(steps):
                live[k] = live[-1]
                live.pop()
        # let the runs in flight end (so every step is seen whole)
        for namer, steps, i in live:
            for step in steps[i:]:
                for e in step:
                    yield namer.rename(e)

    return header, gen()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--concurrent", type=int, default=300)
    ap.add_argument("--policy", choices=("push", "pull"), default="push")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="10,000 events, 50 concurrent (CI's smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.events, args.concurrent = 10_000, 50
    from pdproto import conform

    header, events = history(args.events, args.concurrent, args.seed, policy=args.policy)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "history.jsonl")
        lines = write_history(path, events, header)
        t0, c0 = time.perf_counter(), time.process_time()
        result = conform(path)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{lines - 1:,} events, {result.requests:,} requests, up to {args.concurrent} concurrent "
          f"({args.policy}): conforms={result.ok} monitor_ok={result.monitor_ok} bounded={result.bounded}")
    if not result.ok:
        print(f"  line {result.line}: {result.reason}; expected {list(result.expected)[:4]}")
    print(f"conform: {dt:.2f} s wall, {cpu:.2f} s CPU: {(lines - 1) / dt:,.0f} events/s wall, "
          f"{(lines - 1) / cpu:,.0f} events per CPU second (reading, the monitor and the search)")


if __name__ == "__main__":
    main()
