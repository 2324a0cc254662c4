"""Replay speed on a long generated clean history (issue 10, section 5).

Generates a deterministic clean history (benchmarks/_long_history.py: four
workers, up to 12 interleaved requests in flight, ~17 events per request;
format 1.1 adds chunked two-range transfers and prefix shares), replays it
through ``pdproto.drivers.replay`` at two layouts:

- ``default``: the replay defaults (2 layers x 4 KV heads x 8 head dim, block size 4);
- ``large``: 8 layers x 8 KV heads x 128 head dim (block size 4);

and prints for each (after an untimed warm-up replay): events, seconds,
events/s, verified KV bytes/s, the raw ``copy_`` throughput of the same
number of KV bytes on the same device, and the ratio raw / verified (how
many times slower verification is than copying).  "Verified KV bytes" are the bytes of every position a generation
ends up with on its decode worker (prompt + decoded positions, all layers, K
and V, all heads): what commit and decode verification must cover at least
once.

When both layouts replay the same history, the large layout also gets a
*data path* figure: its KV bytes over its time minus the default layout's
time (the per-event cost of parsing, the monitor and bookkeeping is the same
at both layouts, so the difference is what the bytes cost).

Targets: >= 5,000 events/s at the default layout; raw / verified <= 3 at
the large layout.  The replay must find the history clean (exit 1 if not).

Usage::

    python benchmarks/replay_speed.py [--quick] [--events N] [--large-events N]
        [--layout default|large|both] [--policy push|pull] [--version 1|1.1]
        [--seed S] [--prompt LO:HI] [--device cpu|cuda] [--threads N] [--json]
        [--write FILE]

``--events`` sizes the history (default 14,000, about 800 requests: the
issue's reference point); ``--large-events`` replays a shorter history at
the large layout (default: the same one).  ``--quick`` is the CI smoke run
(400 events, 120 at the large layout).  ``--write FILE`` saves the
generated history so that ``pdproto replay FILE`` replays it by hand (with
``--layers 8 --kv-heads 8 --head-dim 128`` for the large layout).
``--version`` defaults to 1.1 when this pdproto reads format 1.1, else 1.
``--json`` prints exactly one JSON object.  On a CPU shared with other
work, ``--threads 1`` gives steadier figures (torch's intra-op threads wait
for each other when the cores are oversubscribed: every op, replay's and the
raw copy's alike, then costs milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _long_history  # noqa: E402
from pdproto.drivers import replay  # noqa: E402

LAYOUTS = {
    "default": {"layers": 2, "kv_heads": 4, "head_dim": 8},
    "large": {"layers": 8, "kv_heads": 8, "head_dim": 128},
}
DTYPE = "bfloat16"
TARGET_EVENTS_S = 5000.0
TARGET_RATIO = 3.0


def _reads_v11() -> bool:
    try:
        from pdproto.spec import _events
    except ImportError:  # pragma: no cover
        return False
    return "share" in getattr(_events, "FEATURES", {})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_copy_rate(nbytes: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``device`` for a buffer of ``nbytes``
    bytes (at most 256 MiB), copied as often as it takes to fill 50 ms; the
    best of 3."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = max(1, min(nbytes, 256 << 20) // elem)
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up (first touch)
    best = 0.0
    for _ in range(3):
        copies = 0
        _sync(device)
        t0 = time.perf_counter()
        while True:
            dst.copy_(src)
            copies += 1
            if copies % 8 == 0 or n * elem * copies >= nbytes:
                _sync(device)
                dt = time.perf_counter() - t0
                if dt >= 0.05:
                    break
        best = max(best, copies * n * elem / dt)
    return best


_WARM: list[str] = []


def _warm_up_history() -> str:
    """A short history (written once) replayed untimed before each timed run."""
    if not _WARM:
        header, evs, _ = _long_history.generate(60, seed=1, version="1.1" if _reads_v11() else "1")
        fd, path = tempfile.mkstemp(prefix="pdproto-warm-", suffix=".jsonl")
        os.close(fd)
        _long_history.write(path, header, evs)
        _WARM.append(path)
    return _WARM[0]


def run_layout(path: str, stats: dict, layout: str, device: str) -> dict:
    shape = LAYOUTS[layout]
    elem = torch.empty((), dtype=getattr(torch, DTYPE)).element_size()
    pos_bytes = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * elem
    kv_bytes = stats["positions"] * pos_bytes
    replay(_warm_up_history(), device=device, dtype=DTYPE, max_memory=None, **shape)  # imports, first calls
    t0 = time.perf_counter()
    result = replay(path, device=device, dtype=DTYPE, max_memory=None, **shape)
    dev = torch.device(result.backend["device"])
    _sync(dev)
    seconds = time.perf_counter() - t0
    raw = raw_copy_rate(kv_bytes, dev)
    verified = kv_bytes / seconds
    return {
        "layout": layout, **shape, "block_size": result.backend["block_size"], "dtype": DTYPE,
        "device": str(dev), "events": result.events, "requests": result.requests,
        "seconds": seconds, "events_per_s": result.events / seconds,
        "kv_bytes": kv_bytes, "verified_bytes_per_s": verified, "raw_copy_bytes_per_s": raw,
        "raw_over_verified": raw / verified, "bytes_copied": result.backend.get("bytes_copied"),
        "ok": result.ok, "violations": len(result.violations),
        "first_violation": result.violations[0].to_dict() if result.violations else None,
    }


def _data_path(runs: list[dict]) -> None:
    """When both layouts replayed the same history, the large layout's extra
    time over the default layout's is its bytes-proportional cost (events,
    parsing and the monitor cost the same at both): add its throughput."""
    by = {r["layout"]: r for r in runs}
    d, big = by.get("default"), by.get("large")
    if d and big and d["history"] == big["history"] and big["seconds"] > d["seconds"]:
        rate = big["kv_bytes"] / (big["seconds"] - d["seconds"])
        big["data_path_bytes_per_s"] = rate
        big["raw_over_data_path"] = big["raw_copy_bytes_per_s"] / rate


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB/s" if x >= 2**24 else f"{x / 2**20:.2f} MiB/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small history, for a CI smoke run")
    ap.add_argument("--events", type=int, default=None, help="events in the history (default 14000)")
    ap.add_argument("--large-events", type=int, default=None,
                    help="events of the history replayed at the large layout (default: --events)")
    ap.add_argument("--layout", choices=("default", "large", "both"), default="both")
    ap.add_argument("--policy", choices=("push", "pull"), default="push")
    ap.add_argument("--version", choices=("1", "1.1"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="4:48", metavar="LO:HI", help="prompt lengths drawn from [LO, HI]")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (torch.set_num_threads; default: torch's own)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--write", metavar="FILE", help="also save the generated history (--events) to FILE")
    args = ap.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    events = args.events or (400 if args.quick else 14_000)
    large_events = args.large_events or (120 if args.quick else events)
    version = args.version or ("1.1" if _reads_v11() else "1")
    try:
        lo, hi = (int(v) for v in args.prompt.split(":"))
        if not 4 <= lo <= hi:
            raise ValueError
    except ValueError:
        ap.error(f"--prompt: LO:HI with 4 <= LO <= HI, got {args.prompt!r}")
    layouts = ("default", "large") if args.layout == "both" else (args.layout,)

    runs = []
    histories = {}
    with tempfile.TemporaryDirectory(prefix="pdproto-bench-") as tmp:
        for layout in layouts:
            n = large_events if layout == "large" else events
            if n not in histories:
                header, evs, stats = _long_history.generate(n, seed=args.seed, policy=args.policy,
                                                            version=version, prompt=(lo, hi))
                path = os.path.join(tmp, f"history-{n}.jsonl")
                _long_history.write(path, header, evs)
                histories[n] = (path, stats)
                if args.write and n == events:
                    _long_history.write(args.write, header, evs)
            path, stats = histories[n]
            runs.append(dict(run_layout(path, stats, layout, args.device), history=stats))
        if args.write and events not in histories:
            header, evs, _ = _long_history.generate(events, seed=args.seed, policy=args.policy,
                                                    version=version, prompt=(lo, hi))
            _long_history.write(args.write, header, evs)

    for path in _WARM:
        os.remove(path)
    _data_path(runs)
    ok = all(r["ok"] for r in runs)
    out = {"version": version, "policy": args.policy, "seed": args.seed, "ok": ok,
           "threads": torch.get_num_threads(), "runs": runs,
           "targets": {"events_per_s_default": TARGET_EVENTS_S, "raw_over_verified_large": TARGET_RATIO}}
    if args.json:
        print(json.dumps(out))
    else:
        for r in runs:
            h = r["history"]
            print(f"{r['layout']:7} ({r['layers']} layers x {r['kv_heads']} KV heads x {r['head_dim']} head dim, "
                  f"bs {r['block_size']}, {DTYPE}, {r['device']}), format {version} {args.policy}: "
                  f"{r['events']} events, {r['requests']} requests ({h['chunked']} chunked, {h['shares']} shared)")
            print(f"        {r['seconds']:.2f} s, {r['events_per_s']:,.0f} events/s, verified KV "
                  f"{_gib(r['verified_bytes_per_s'])} of {r['kv_bytes'] / 2**20:.1f} MiB; raw copy_ "
                  f"{_gib(r['raw_copy_bytes_per_s'])}; raw / verified {r['raw_over_verified']:.1f}x")
            if "raw_over_data_path" in r:
                print(f"        data path (this time minus the default layout's on the same history): "
                      f"{_gib(r['data_path_bytes_per_s'])}; raw / data path {r['raw_over_data_path']:.1f}x")
            if not r["ok"]:
                print(f"        NOT CLEAN: {r['violations']} violations, first {r['first_violation']}")
        for r in runs:
            if r["layout"] == "default":
                verdict = "meets" if r["events_per_s"] >= TARGET_EVENTS_S else "is below"
                print(f"  default layout {verdict} the {TARGET_EVENTS_S:,.0f} events/s target")
            if r["layout"] == "large":
                verdict = "meets" if r["raw_over_verified"] <= TARGET_RATIO else "is outside"
                print(f"  large layout {verdict} the {TARGET_RATIO:.0f}x-of-raw-copy target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
