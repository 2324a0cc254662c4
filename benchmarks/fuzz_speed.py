"""Fuzzing speed and coverage: steps/s, examples/s, and distinct states of
pdproto.testing's machine against the uninstrumented baseline (one rule
drawing uniformly among the enabled actions) at the same step budget.

Steps are model steps taken, teardown's quiescence steps included (the
baseline has none).  Steering's look-ahead (stepping every enabled action to
see which successors are new) is not counted as steps; it shows in steps/s.

    python benchmarks/fuzz_speed.py            # 30,000 steps, reference push default config
    python benchmarks/fuzz_speed.py --quick    # CI smoke, < 30 s
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

from pdproto import load_model  # noqa: E402
from pdproto.drivers import reachable_states  # noqa: E402
from pdproto.testing import handoff_machine, uniform_machine  # noqa: E402


def run(machine, budget: int, steps_per_example: int, s: int) -> dict:
    stats = machine.stats
    examples = 10
    t0 = time.perf_counter()
    while stats.steps < budget:  # grow until the step budget is spent
        test = get_state_machine_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps_per_example, deadline=None,
            database=None, suppress_health_check=list(HealthCheck)))
        seed(s)(test)()
        s += 1
        examples *= 2
    seconds = time.perf_counter() - t0
    return {
        "steps": stats.steps, "examples": stats.examples, "seconds": round(seconds, 2),
        "steps_per_second": round(stats.steps / seconds), "examples_per_second": round(stats.examples / seconds, 1),
        "distinct_at_budget": stats.distinct_at(budget),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--model", default="reference")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    budget = args.budget or (3000 if args.quick else 30_000)
    model, info = load_model(args.model)
    ours = handoff_machine(model)
    ours.stats.curve_every = 100
    base = uniform_machine(model)
    base.stats.curve_every = 100
    r_ours = run(ours, budget, 300 if args.quick else 1000, args.seed)
    r_base = run(base, budget, 50, args.seed)
    reach = None if args.quick else reachable_states(model)
    out = {
        "model": info.name, "budget_steps": budget, "ours": r_ours, "uniform": r_base,
        "ratio": round(r_ours["distinct_at_budget"] / max(1, r_base["distinct_at_budget"]), 2),
        "reachable_states": reach,
        "coverage_ours": None if not reach else round(r_ours["distinct_at_budget"] / reach, 4),
        "coverage_uniform": None if not reach else round(r_base["distinct_at_budget"] / reach, 4),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
