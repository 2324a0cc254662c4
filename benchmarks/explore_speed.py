"""How fast the explorer runs, and what a stored state costs.

    python benchmarks/explore_speed.py           # full run (a few minutes)
    python benchmarks/explore_speed.py --quick   # CI smoke (seconds)

Prints distinct states per second on a model whose step is nearly free
(benchmarks/toy_model.py: the explorer's own overhead; a plain Python BFS
over a set of tuples on the same model is printed alongside), on the
reference model with the monitor attached (when pdproto/protocol/_reference.py
exists), and the memory a state costs, in exact and fingerprint mode, with
the cyclic GC frozen (the default) and not.

Bytes per state, two measures:

- RSS: (peak resident set size during the search - RSS just before it) /
  distinct states.  Everything the search holds counts: the visited set and
  its keys, interned parts, parent links, the BFS frontier (a whole level),
  the monitor's interned states and memo.  Each RSS measurement runs in a
  fresh Python process (``--child``), so memory freed by an earlier run
  cannot hide a later run's growth.  The peak is sampled by the progress
  callback (every 20 ms) and at the end.
- stored: ``ExploreResult.bytes_per_state``, the explorer's own accounting of
  what it keeps for the rest of the search (``sys.getsizeof`` of the visited
  set, of every stored key and interned part, the link arrays; in
  fingerprint mode the hash table and the links).  It leaves out the
  frontier and the monitor's tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from pdproto.drivers._explore import explore  # noqa: E402

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
    print(f"  {label:<38} {r.states:>10,} states {r.seconds:>7.2f} s {r.states_per_second:>10,.0f} states/s {extra}",
          flush=True)


def _child(spec: dict) -> dict:
    """One measured search in this (fresh) process."""
    if spec["model"] == "toy":
        model = toy_model.build(tuple(spec["config"]))
    else:
        from pdproto.drivers._loader import load_model

        model, _ = load_model(None, **spec.get("config", {}))
    gc.collect()
    base = _rss()
    peak = [base]
    r = explore(model, symmetry=spec.get("symmetry", False), fingerprint=spec["fingerprint"],
                freeze_gc=spec.get("freeze_gc", True), max_states=spec.get("max_states"),
                intern=spec.get("intern", True),
                progress=lambda info: peak.append(_rss()), progress_interval=0.02)
    peak.append(_rss())
    return {
        "model": r.model, "states": r.states, "seconds": r.seconds, "sps": r.states_per_second,
        "rss_bps": (max(peak) - base) / r.states, "stored_bps": r.bytes_per_state,
        "collision": r.collision_probability, "memory": dict(r.memory or {}), "symmetry": r.symmetry,
        "ok": r.ok,
    }


def measure(spec: dict) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mem_row(label: str, m: dict) -> None:
    extra = f"RSS {m['rss_bps']:>6.0f} B/state, stored {m['stored_bps']:>6.1f} B/state"
    if m["collision"] is not None:
        extra += f", P(collision) {m['collision']:.1e}"
    print(f"  {label:<38} {m['states']:>10,} states {m['seconds']:>7.2f} s {m['sps']:>10,.0f} states/s {extra}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--reference-states", type=int, default=None,
                    help="max states of the reference model run (default: all; quick 20000)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    cfg = (4, 12) if args.quick else (4, 24)
    model = toy_model.build(cfg)
    print(f"toy model {model.name}: {model.states():,} states, step nearly free")
    n, dt = plain_bfs(model)
    print(f"  {'plain Python BFS (set of tuples)':<38} {n:>10,} states {dt:>7.2f} s {n / dt:>10,.0f} states/s")
    r = explore(model, symmetry=False)
    row("explore, exact, GC frozen", r)
    r = explore(model, symmetry=False, freeze_gc=False)
    row("explore, exact, GC on", r)
    r = explore(model, symmetry=False, fingerprint=True)
    row("explore, fingerprint", r, f"{r.bytes_per_state:.1f} B/state, P(collision) {r.collision_probability:.1e}")
    r = explore(model, symmetry=True)
    row("explore, exact, symmetry", r)

    # memory per state, each in a fresh process
    big = (4, 12) if args.quick else (4, 31)  # (4, 31): 32**4 = 1,048,576 states
    print(f"memory per state (RSS: peak growth in a fresh process; stored: the explorer's accounting), "
          f"toy {big[0]}x{big[1]} ({(big[1] + 1) ** big[0]:,} states):")
    for fp in (False, True):
        for frozen in (True, False):
            m = measure({"model": "toy", "config": list(big), "fingerprint": fp, "freeze_gc": frozen})
            mem_row(f"{'fingerprint' if fp else 'exact'}, GC {'frozen' if frozen else 'on'}", m)

    if os.path.exists(os.path.join(ROOT, "pdproto", "protocol", "_reference.py")):
        from pdproto.drivers._loader import load_model

        ref, info = load_model(None)
        limit = args.reference_states or (20_000 if args.quick else None)
        print(f"reference model (default config), {'first %s' % format(limit, ',') if limit else 'all'} states:")
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
            if limit and len(seen) >= limit:
                break
        dt = time.perf_counter() - t
        print(f"  {'plain BFS, model only, no monitor':<38} {len(seen):>10,} states {dt:>7.2f} s "
              f"{len(seen) / dt:>10,.0f} states/s")
        del seen, queue
        row("explore, no monitor", explore(ref, max_states=limit, monitor=False))
        r = explore(ref, max_states=limit)
        row("explore, with monitor", r, f"({r.monitor_states:,} distinct monitor states, symmetry {r.symmetry})")
        row("explore, with monitor, fingerprint", explore(ref, max_states=limit, fingerprint=True))
        if r.symmetry != "none offered":
            row("explore, with monitor, no symmetry", explore(ref, max_states=limit, symmetry=False))
        for fp in (False, True):
            for sym in (True, False):
                m = measure({"model": "reference", "fingerprint": fp, "symmetry": sym, "max_states": limit})
                mem_row(f"memory, {'fingerprint' if fp else 'exact'}, symmetry {m['symmetry']}", m)
    else:
        print("reference model: pdproto/protocol/_reference.py not present; skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
