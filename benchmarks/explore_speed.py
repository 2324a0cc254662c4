"""How fast the explorer runs, and what a stored state costs.

    python benchmarks/explore_speed.py           # full run (a quarter of an hour)
    python benchmarks/explore_speed.py --quick   # CI smoke (seconds)
    python benchmarks/explore_speed.py --parallel-only   # the parallel section alone

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

Parallel (docs/scaling.md): serial, ``workers=2`` and Ray with 2 actors on
the same configuration (toy 4x31, 1,048,576 states, and the reference
model, default configuration and pull with 3 blocks: 1,712,927 states), each
in a fresh process, as states/s and speed-up over serial, with
the machine's load average (a shared machine gives no clean figure).  Then
two whole serial searches of the same configuration at once, in two
processes: they share nothing but the hardware, so their joint states/s over
one serial search's is the machine's ceiling for any 2-process search
(caches and memory bandwidth are shared; a dict-heavy search slows down
when another runs beside it).  For a
parallel run the RSS is that of the worker processes together (peak growth
after the seed / states).  Then one search of more than 10 million states in
fingerprint mode (toy 4x56: 57**4 = 10,556,001 states) on 2 workers, with
its peak memory (full run only).
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

from pdproto.drivers import explore  # noqa: E402

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
        from pdproto.drivers import load_model

        model, _ = load_model(None, **spec.get("config", {}))
    gc.collect()
    base = _rss()
    peak = [base]
    workers = spec.get("workers")
    ray = spec.get("ray")
    if ray:
        import ray as ray_mod

        ray_mod.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    wpeak: list[int] = []

    def progress(info: dict) -> None:
        if workers:
            if info.get("memory"):
                wpeak.append(info["memory"])
        else:
            peak.append(_rss())

    r = explore(model, symmetry=spec.get("symmetry", False), fingerprint=spec["fingerprint"],
                freeze_gc=spec.get("freeze_gc", True), max_states=spec.get("max_states"),
                intern=spec.get("intern", True), workers=workers, ray=ray or None,
                progress=progress, progress_interval=0.02 if not workers else 0.0)
    peak.append(_rss())
    if ray:
        ray_mod.shutdown()
    if workers and wpeak:  # the workers' RSS together: growth from the first report (after the seed)
        base, peak = wpeak[0], [wpeak[0]] + wpeak
    return {
        "model": r.model, "states": r.states, "seconds": r.seconds, "sps": r.states_per_second,
        "rss_bps": (max(peak) - base) / r.states, "stored_bps": r.bytes_per_state,
        "collision": r.collision_probability, "memory": dict(r.memory or {}), "symmetry": r.symmetry,
        "ok": r.ok, "peak_rss": max(peak), "workers": workers or 1,
    }


def _child_cmd(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]


def measure(spec: dict) -> dict:
    out = subprocess.run(_child_cmd(spec), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_by_side(spec: dict, copies: int = 2) -> list[dict]:
    """``copies`` serial searches of ``spec`` at once, each in its own fresh
    process: how fast the machine runs that many searches together."""
    procs = [subprocess.Popen(_child_cmd(spec), stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a side-by-side search failed: {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


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
    ap.add_argument("--parallel-only", action="store_true", help="only the parallel section")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    if args.parallel_only:
        parallel(args.quick)
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
        from pdproto.drivers import load_model

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
    parallel(args.quick)
    return 0


def _ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def parallel(quick: bool) -> None:
    """Serial, workers=2 and Ray x2 side by side; the 10M-state fingerprint run."""
    load = os.getloadavg()
    print(f"parallel search, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          "(1/5/15 min; a busy machine lowers the parallel figures):")
    configs = [("toy", "toy", {"config": [3, 9]})] if quick else [
        ("toy", "toy", {"config": [4, 31]}), ("reference", "reference", {"config": {}, "symmetry": True}),
        # the reference at 1M+ states: pull, 3 blocks a worker (1,712,927 states serial; minutes a run)
        ("ref pull 3 blocks", "reference", {"config": {"policy": "pull", "blocks": 3}, "symmetry": True})]
    for name, model, extra in configs:
        runs = [("serial", {}), ("workers=2", {"workers": 2})]
        if not quick and _ray_available():
            runs.append(("ray, 2 actors", {"workers": 2, "ray": True}))
        base = None
        for label, kw in runs:
            m = measure({"model": model, "fingerprint": False, **extra, **kw})
            base = base or m
            ratio = m["sps"] / base["sps"] if base["sps"] else float("nan")
            same = (m["states"] == base["states"] and m["ok"] == base["ok"])
            mem_row(f"{name} {label}", m)
            wall = "" if m["states"] == base["states"] else (
                f" ({base['seconds'] / m['seconds']:.2f}x in wall time: the counts differ, docs/scaling.md "
                f"'The same answers')")
            print(f"  {'':<38} speed-up {ratio:.2f}x over serial{wall}; same states and verdict: {same}; "
                  f"load now {os.getloadavg()[0]:.2f}", flush=True)
        # the machine's ceiling for 2 workers: two whole serial searches at
        # once share nothing but the hardware (caches, memory bandwidth), so
        # their joint states/s bounds what any 2-process search can reach here
        pair = side_by_side({"model": model, "fingerprint": False, **extra})
        joint = sum(p["states"] for p in pair) / max(p["seconds"] for p in pair)
        each = ", ".join(f"{p['sps'] / base['sps']:.2f}x" for p in pair)
        print(f"  {name + ' 2 serial searches at once':<38} {joint:>10,.0f} states/s together: the machine's "
              f"ceiling for 2 workers is {joint / base['sps']:.2f}x serial (each ran at {each})", flush=True)
    if quick:
        return
    m = measure({"model": "toy", "config": [4, 56], "fingerprint": True, "workers": 2})
    mem_row("toy 4x56, fingerprint, workers=2", m)
    print(f"  {'':<38} peak RSS of the 2 workers together {m['peak_rss'] / 2**20:,.0f} MiB "
          f"(coordinator not counted)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
