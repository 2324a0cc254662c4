"""Fuzzing speed and coverage: steps per CPU second, and distinct states of
``pdproto.fuzz`` against the uninstrumented baseline (one Hypothesis rule
drawing uniformly among the enabled actions, ``uniform_machine``) at the same
step budgets, measured in one run: each side runs once to the largest
budget, and its distinct states are read off its curve at every budget.

Steps are model steps taken, teardown's quiescence steps included (the
baseline has none).  The walk's look-ahead (stepping every enabled action to
see which successors are new) is not counted as steps; it shows in steps/s.
Speed is in CPU seconds (``time.process_time()``): other processes on the
machine do not count, but a loaded machine is still slower (shared caches);
the load average is printed beside the figures.

It also runs the same example budget serially and with ``--workers 2``
(issue 16) and reports both examples per wall second and their ratio.

    python benchmarks/fuzz_speed.py            # 30,000 and 144,000 steps, reference push default config
    python benchmarks/fuzz_speed.py --quick    # CI smoke: 3,000 steps, < 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis.stateful import get_state_machine_test  # noqa: E402

from pdproto import fuzz, load_model  # noqa: E402
from pdproto.drivers import FuzzStats, reachable_states  # noqa: E402
from pdproto.testing import uniform_machine  # noqa: E402

#: the issue's targets (issue 19)
TARGET_RATIO = 20.0
TARGET_STEPS_PER_SECOND = 5000


def run_ours(model, budget: int, steps_per_example: int, s: int) -> tuple[dict, FuzzStats]:
    """pdproto.fuzz, one run of enough examples to pass ``budget`` steps
    (another run with the next seed if it fell short)."""
    stats = FuzzStats(curve_every=100)
    c0, t0 = time.process_time(), time.perf_counter()
    while stats.steps < budget:
        examples = max(1, (budget - stats.steps) // steps_per_example + 1)
        result = fuzz(model, examples=examples, steps=steps_per_example, seed=s, database=None, stats=stats)
        assert result.ok, result.failure
        s += 1
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return _figures(stats, cpu, wall), stats


def run_uniform(model, budget: int, steps_per_example: int, s: int) -> tuple[dict, FuzzStats]:
    """The baseline machine, with doubling example counts until ``budget``."""
    machine = uniform_machine(model)
    stats = machine.stats
    stats.curve_every = 100
    examples = 10
    c0, t0 = time.process_time(), time.perf_counter()
    while stats.steps < budget:
        test = get_state_machine_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps_per_example, deadline=None,
            database=None, suppress_health_check=list(HealthCheck)))
        seed(s)(test)()
        s += 1
        examples *= 2
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return _figures(stats, cpu, wall), stats


def run_parallel(model, examples: int, steps_per_example: int, s: int, workers: int = 2) -> dict:
    """The same budget of ``examples`` serially and over ``workers`` worker
    processes: examples per wall second of each (worker start-up included),
    the speed-up, and the ratio of CPU seconds (the workers' added up; 1.0:
    no overhead).  The wall speed-up needs ``workers`` idle cores: compare
    the load average (and on Linux with autogroup scheduling, the processes
    of one session share one session's CPU share on a busy machine)."""
    out = {}
    for n in (1, workers):
        t0 = time.perf_counter()
        result = fuzz(model, examples=examples, steps=steps_per_example, seed=s, database=None, workers=n)
        wall = time.perf_counter() - t0
        assert result.ok, result.failure
        out["serial" if n == 1 else f"workers_{n}"] = {
            "examples": result.counters["examples"], "steps": result.counters["steps"],
            "wall_seconds": round(wall, 2), "examples_per_second": round(result.counters["examples"] / wall, 2),
            # the workers' CPU seconds added up: the parallel overhead is their excess over serial's
            "cpu_seconds": result.counters["cpu_seconds"],
            "distinct_states": result.counters["distinct_states"]}
    out["cpu_ratio"] = round(out[f"workers_{workers}"]["cpu_seconds"] / max(out["serial"]["cpu_seconds"], 1e-9), 2)
    out["speedup"] = round(out[f"workers_{workers}"]["examples_per_second"] / out["serial"]["examples_per_second"], 2)
    out["cpus"] = os.cpu_count()
    return out


def _figures(stats: FuzzStats, cpu: float, wall: float) -> dict:
    return {
        "steps": stats.steps, "examples": stats.examples, "cpu_seconds": round(cpu, 2),
        "wall_seconds": round(wall, 2), "steps_per_cpu_second": round(stats.steps / cpu),
        "distinct_states": stats.distinct_states,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: one budget of 3,000 steps")
    ap.add_argument("--budget", type=int, nargs="*", default=None, metavar="STEPS",
                    help="step budgets (default 30000 144000)")
    ap.add_argument("--model", default="reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-per-example", type=int, default=1000,
                    help="pdproto.fuzz's steps per example (default 1000; the baseline's is 50)")
    ap.add_argument("--parallel-examples", type=int, default=60,
                    help="examples of the serial vs --workers 2 run (300 steps each; --quick: 4 of 100)")
    args = ap.parse_args()
    budgets = sorted(args.budget or ([3000] if args.quick else [30_000, 144_000]))
    model, info = load_model(args.model)
    load = os.getloadavg()
    ours, ours_stats = run_ours(model, budgets[-1], args.steps_per_example, args.seed)
    uniform, uniform_stats = run_uniform(model, budgets[-1], 50, args.seed)
    parallel = run_parallel(model, 4 if args.quick else args.parallel_examples, 100 if args.quick else 300,
                            args.seed)
    reach = None if args.quick else reachable_states(model)
    at = []
    for budget in budgets:
        a, b = ours_stats.distinct_at(budget), uniform_stats.distinct_at(budget)
        at.append({
            "budget_steps": budget, "distinct_ours": a, "distinct_uniform": b,
            "ratio": round(a / max(1, b), 2),
            "coverage_ours": None if not reach else round(a / reach, 4),
            "coverage_uniform": None if not reach else round(b / reach, 4),
        })
    out = {
        "model": info.name, "budgets": at, "ours": ours, "uniform": uniform, "reachable_states": reach,
        "parallel": parallel,
        "load_average": {"start": [round(x, 2) for x in load], "end": [round(x, 2) for x in os.getloadavg()]},
        "targets": {"ratio": TARGET_RATIO, "steps_per_cpu_second": TARGET_STEPS_PER_SECOND},
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
