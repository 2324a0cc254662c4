"""Time to find: fuzz every mutant of the model catalogue (``pdproto check
--list``: ``pdproto.list_models()``, so mutants added to ``models/`` are
included) with a fixed seed and no example database, and print per mutant
the examples and CPU seconds to the first failure and after shrinking, the
shrunk trace's length and whether the invariant is the expected one; then
the totals.  The reference model is fuzzed too and must stay clean.

CPU seconds are ``time.process_time()`` (other processes on the machine do
not count, but they still slow a run through shared caches: say how loaded
the machine was when you quote a figure).

    python benchmarks/fuzz_time_to_find.py              # every mutant; the reference at 2,000 examples
    python benchmarks/fuzz_time_to_find.py --quick      # CI smoke: three mutants, the reference at 20 examples
    python benchmarks/fuzz_time_to_find.py --explain    # with Hypothesis's explain phase (the old default)
    python benchmarks/fuzz_time_to_find.py --json       # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdproto import fuzz, list_models, load_model  # noqa: E402
from pdproto.drivers import FuzzStats  # noqa: E402

#: the issue's target: found and shrunk within this many CPU seconds each
TARGET_CPU = 10.0


class _TimedStats(FuzzStats):
    """FuzzStats that notes the CPU time and example count when the first
    failure is recorded (works whatever counters the fuzz driver reports)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "found_at" and value is not None and getattr(self, "found_at", None) is None:
            object.__setattr__(self, "found_cpu", time.process_time())
        super().__setattr__(name, value)


def find(name: str, *, examples: int, steps: int, seed: int, explain: bool) -> dict:
    model, info = load_model(name)
    stats = _TimedStats()
    kwargs = {"explain": True} if explain else {}
    t0 = time.process_time()
    result = fuzz(model, examples=examples, steps=steps, seed=seed, database=None, stats=stats,
                  name=info.name, expected=info.expected, **kwargs)
    total = time.process_time() - t0
    found_cpu = getattr(stats, "found_cpu", None)
    row = {
        "model": info.name,
        "expected": info.expected,
        "found": result.violation is not None,
        "invariant": None if result.violation is None else result.violation.invariant,
        "examples_to_find": stats.found_at,
        "cpu_to_find": None if found_cpu is None else round(found_cpu - t0, 3),
        "examples_total": stats.examples,
        "cpu_total": round(total, 3),
        "shrunk_steps": None if result.failure is None else len(result.failure.trace),
        "phase_seconds": result.counters.get("phase_seconds"),
    }
    # found: any violation of a mutant (its defect may first show as another
    # invariant than the catalogue names: printed, not failed); none of the reference
    row["ok"] = row["found"] == (info.expected is not None) and (info.expected is None or total < TARGET_CPU)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="three mutants, the reference at 20 examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=2000, help="budget per mutant (default 2000)")
    ap.add_argument("--steps", type=int, default=100, help="rule steps per example (default 100)")
    ap.add_argument("--reference-examples", type=int, default=None,
                    help="examples of the clean reference run (default 2000; --quick 20)")
    ap.add_argument("--explain", action="store_true", help="run Hypothesis's explain phase too")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="these mutants only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mutants = [name for name, expected, _ in list_models() if expected]
    if args.only:
        mutants = [m for m in mutants if m in args.only]
    elif args.quick:
        mutants = mutants[:3]
    ref_examples = args.reference_examples or (20 if args.quick else 2000)
    rows = []
    for name in mutants:
        row = find(name, examples=args.examples, steps=args.steps, seed=args.seed, explain=args.explain)
        rows.append(row)
        if not args.json:
            print(f"{row['model']:<36} {'found' if row['found'] else 'MISSED':<6} "
                  f"{row['examples_to_find'] or '-':>5} ex {row['cpu_to_find'] or 0:7.2f} s to find | "
                  f"{row['examples_total']:>5} ex {row['cpu_total']:7.2f} s shrunk to "
                  f"{row['shrunk_steps'] or '-':>3} steps  {row['invariant'] or '-'}"
                  f"{'' if row['invariant'] == row['expected'] else ' (catalogue: ' + row['expected'] + ')'}"
                  f"{'' if row['ok'] else '  <-- not OK'}", flush=True)
    ref = find("reference", examples=ref_examples, steps=args.steps, seed=args.seed, explain=args.explain)
    found = [r for r in rows if r["found"]]
    totals = {
        "mutants": len(rows),
        "found": len(found),
        "expected_invariant": sum(1 for r in rows if r["invariant"] == r["expected"]),
        "examples_to_find": sum(r["examples_to_find"] or 0 for r in found),
        "cpu_to_find": round(sum(r["cpu_to_find"] or 0 for r in found), 2),
        "examples_total": sum(r["examples_total"] for r in rows),
        "cpu_total": round(sum(r["cpu_total"] for r in rows), 2),
        "max_cpu_total": round(max((r["cpu_total"] for r in rows), default=0.0), 2),
        "under_target": sum(1 for r in rows if r["found"] and r["cpu_total"] < TARGET_CPU),
        "reference_clean": ref["found"] is False,
        "reference_examples": ref["examples_total"],
        "reference_cpu": ref["cpu_total"],
    }
    ok = totals["found"] == len(rows) == totals["under_target"] and totals["reference_clean"]
    if args.json:
        print(json.dumps({"seed": args.seed, "explain": args.explain, "mutants": rows, "reference": ref,
                          "totals": totals, "ok": ok}, indent=2))
    else:
        print(f"totals: {totals['found']}/{totals['mutants']} found ({totals['expected_invariant']} with the "
              f"expected invariant), {totals['examples_to_find']} examples and {totals['cpu_to_find']} s CPU to "
              f"find, {totals['examples_total']} examples and {totals['cpu_total']} s CPU with shrinking "
              f"(slowest {totals['max_cpu_total']} s; {totals['under_target']} under {TARGET_CPU:g} s)")
        print(f"reference: {'clean' if totals['reference_clean'] else 'VIOLATION ' + str(ref['invariant'])} "
              f"at {ref['examples_total']} examples in {ref['cpu_total']} s CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
