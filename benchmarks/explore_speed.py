"""How fast the explorer runs, and what a stored state costs.

    python benchmarks/explore_speed.py           # full run (a few minutes)
    python benchmarks/explore_speed.py --quick   # CI smoke (seconds)

Prints distinct states per second on a model whose step is nearly free
(benchmarks/toy_model.py: the explorer's own overhead; a plain Python BFS
over a set of tuples on the same model is printed alongside), on the
reference model with the monitor attached (when pdproto/_reference.py
exists), bytes per stored state in exact and fingerprint mode (process RSS
growth for exact mode), and the effect of freezing the cyclic GC.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from pdproto._explore import explore  # noqa: E402

import toy_model  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def plain_bfs(model) -> tuple[int, float]:
    t = time.perf_counter()
    s0 = model.initial_states()[0]
    seen = {s0}
    queue = [s0]
    for s in queue:
        for a in model.actions(s):
            n, _ = model.step(s, a)
            if n not in seen:
                seen.add(n)
                queue.append(n)
    return len(seen), time.perf_counter() - t


def row(label: str, r, extra: str = "") -> None:
    print(f"  {label:<34} {r.states:>10,} states {r.seconds:>7.2f} s {r.states_per_second:>10,.0f} states/s {extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--reference-states", type=int, default=None,
                    help="max states of the reference model run (default 300000; quick 20000)")
    args = ap.parse_args()
    cfg = (4, 12) if args.quick else (4, 24)
    model = toy_model.build(cfg)
    print(f"toy model {model.name}: {model.states():,} states, step nearly free")
    n, dt = plain_bfs(model)
    print(f"  {'plain Python BFS (set of tuples)':<34} {n:>10,} states {dt:>7.2f} s {n / dt:>10,.0f} states/s")
    r = explore(model, symmetry=False)
    row("explore, exact, GC frozen", r)
    r = explore(model, symmetry=False, freeze_gc=False)
    row("explore, exact, GC on", r)
    r = explore(model, symmetry=False, fingerprint=True)
    row("explore, fingerprint", r, f"{r.bytes_per_state:.1f} B/state, P(collision) {r.collision_probability:.1e}")
    r = explore(model, symmetry=True)
    row("explore, exact, symmetry", r)

    # bytes per state by RSS growth, on a bigger toy (exact and fingerprint)
    big = toy_model.build((4, 20) if args.quick else (5, 24))
    for fp in (False, True):
        gc.collect()
        before = _rss()
        keep = []

        def progress(info, keep=keep):
            keep.append(_rss())

        r = explore(big, symmetry=False, fingerprint=fp, progress=progress, progress_interval=0.05)
        peak = max(keep + [_rss()])
        label = "fingerprint" if fp else "exact"
        row(f"RSS, {label} ({big.name})", r, f"{(peak - before) / r.states:.0f} B/state of RSS (frontier included)"
            + (f"; table+links {r.bytes_per_state:.1f} B/state" if fp else ""))
        del r
        gc.collect()

    ref_path = os.path.join(os.path.dirname(HERE), "pdproto", "_reference.py")
    if os.path.exists(ref_path):
        from pdproto._loader import load_model

        ref, info = load_model(None)
        limit = args.reference_states or (20_000 if args.quick else 300_000)
        print(f"reference model (default config), first {limit:,} states:")
        t = time.perf_counter()
        s0 = ref.initial_states()[0]
        seen = {s0}
        queue = [s0]
        for s in queue:
            for a in ref.actions(s):
                nxt, _ = ref.step(s, a)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
            if len(seen) >= limit:
                break
        dt = time.perf_counter() - t
        print(f"  {'plain BFS, model only, no monitor':<34} {len(seen):>10,} states {dt:>7.2f} s {len(seen) / dt:>10,.0f} states/s")
        row("explore, no monitor", explore(ref, max_states=limit, monitor=False))
        r = explore(ref, max_states=limit)
        row("explore, with monitor", r, f"({r.monitor_states:,} distinct monitor states)")
        row("explore, with monitor, fingerprint", explore(ref, max_states=limit, fingerprint=True))
        if any(callable(getattr(ref, h, None)) for h in ("symmetry", "canonical_product", "canonical")):
            row("explore, with monitor, no symmetry", explore(ref, max_states=limit, symmetry=False))
    else:
        print("reference model: pdproto/_reference.py not present; skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
