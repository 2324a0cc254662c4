"""Simulated requests per wall second of ``pdproto simulate``'s engine.

The figure the issue sets: a 10,000-request PD run with the monitor judging
every handoff inline, at least 2,500 simulated requests per wall second on
the 2-core development machine (2x SplitwiseSim's ~1,270 measured there,
docs/simulate.md).  Workload: SplitwiseSim's measured scenario (Poisson,
lognormal lengths, mean prompt ~1,070, mean output ~195; here median 900 /
160, sigma 0.6), llama-3-8b on H100, 2P2D, 64-token blocks, Poisson at
16 rps (the pools about half busy).  Also printed: the same run without the
monitor, and the colocated and chunked arms at the same 4 devices.

    python benchmarks/simulate_speed.py           # the 10,000-request figure
    python benchmarks/simulate_speed.py --quick   # 1,000 requests
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from pdproto.sim import SimConfig, simulate
from pdproto.sim import Metrics
from pdproto.sim import Lengths, WorkloadSpec, make_workload

TARGET = 2500.0


def measure(n: int, cfg: SimConfig, monitor: bool, rate: float) -> tuple[float, float, object, float]:
    spec = WorkloadSpec.poisson(rate, Lengths.lognormal(900, 0.6, 16, 16_000), Lengths.lognormal(160, 0.6, 1, 4000))
    reqs = list(make_workload(spec, n, seed=1))  # drawn first: the figure is the engine's
    m = Metrics(cfg.label(), devices=cfg.used_devices, weight_copies=cfg.weight_copies)
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    res = simulate(reqs, cfg, metrics=m, monitor=monitor)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    assert res.ok, res.violation
    return n / wall, wall, res, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 requests instead of 10,000")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of the monitored PD case; the best is shown")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per KV block (default 64, the CLI's)")
    args = ap.parse_args()
    n = args.requests or (1000 if args.quick else 10_000)
    pd = SimConfig(arm="pd", n_p=2, n_d=2, devices=4, block_size=args.block_size)
    load = os.getloadavg()[0]
    runs = [measure(n, pd, True, args.rate) for _ in range(max(1, args.repeat))]
    speed, wall, res, _ = max(runs, key=lambda r: r[0])
    cpu = max(r[3] for r in runs)
    median = statistics.median(r[0] for r in runs)
    print(f"PD 2P2D, monitor on : {speed:8,.0f} simulated requests / wall s, {cpu:8,.0f} / CPU s  (best of "
          f"{len(runs)}, median {median:,.0f}; {n:,} requests in "
          f"{wall:.2f} s, {res.events:,} events judged, {res.duration:,.0f} simulated s = {res.duration / wall:,.0f}x "
          f"real time)")
    speed_off, wall_off, _, cpu_off = measure(n, pd, False, args.rate)
    print(f"PD 2P2D, monitor off: {speed_off:8,.0f} simulated requests / wall s, {cpu_off:8,.0f} / CPU s  "
          f"({wall_off:.2f} s)")
    for arm in ("colocated", "chunked"):
        s, w, _, c = measure(n, SimConfig(arm=arm, devices=4, block_size=args.block_size), False, args.rate)
        print(f"{arm:9} 4 devices   : {s:8,.0f} simulated requests / wall s, {c:8,.0f} / CPU s  ({w:.2f} s)")
    print(f"(load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; wall and CPU differ when "
          "other processes share the cores; the target is wall time on an idle machine)")
    if n == 10_000:
        verdict = "meets" if speed >= TARGET else "MISSES"
        print(f"target {TARGET:,.0f} req/s (PD, monitor on, 10,000 requests): the best run {verdict} it, the median "
              f"{'meets' if median >= TARGET else 'MISSES'} it")
    else:
        print(f"(the target, {TARGET:,.0f} req/s, is for 10,000 requests; this run had {n:,})")


if __name__ == "__main__":
    main()
