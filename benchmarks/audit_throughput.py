"""Audit throughput: events/second and peak memory of ``pdproto audit``.

Generates a long, clean, synthetic history (many concurrent requests
interleaved over 2 P and 2 D workers, push mode, with decode steps and the
occasional cancel mid-transfer), writes it to a temporary file, and audits it
in a fresh process so that the peak memory (max RSS) belongs to the audit
alone.

    python benchmarks/audit_throughput.py               # 1,000,000 events
    python benchmarks/audit_throughput.py --events 50000 --quick

Targets (issue 2): >= 100,000 events/s and peak memory under 300 MB for a
1,000,000-event history on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def request_events(i: int, gen: int, p: str, d: str, pb: list[int], db: list[int], cancel: bool) -> list[dict]:
    r, t, x = f"r{i}", f"t{i}", f"x{i}"
    first = 1000 + i % 5000
    ev: list[dict] = [
        {"ev": "submit", "request": r, "gen": gen, "prompt_len": 64, "max_new_tokens": 6},
        {"ev": "reserve", "request": r, "gen": gen, "ticket": t, "worker": d, "blocks": db},
        {"ev": "prefill_start", "request": r, "gen": gen, "worker": p, "blocks": pb},
        {"ev": "prefill_done", "request": r, "gen": gen, "worker": p, "first_token": first, "processed_len": 64},
        {"ev": "transfer_start", "transfer": x, "ticket": t, "request": r, "gen": gen, "src": p,
         "src_blocks": pb, "dst": d, "dst_blocks": db},
    ]
    if cancel:
        ev += [
            {"ev": "cancel", "request": r, "gen": gen},
            {"ev": "transfer_abort", "transfer": x},
            {"ev": "transfer_failed", "transfer": x},
        ]
    else:
        ev += [
            {"ev": "transfer_read_done", "transfer": x},
            {"ev": "transfer_write_done", "transfer": x},
            {"ev": "commit", "request": r, "gen": gen, "ticket": t, "worker": d},
        ]
        tok = first
        for k in range(5):
            ev.append({"ev": "decode", "request": r, "gen": gen, "worker": d, "position": 64 + k,
                       "input_token": tok, "output_token": tok + 1, "blocks": db, "t": i + k})
            tok += 1
        ev.append({"ev": "finish", "request": r, "gen": gen, "reason": "length"})
    ev.append({"ev": "free", "worker": p, "blocks": pb, "request": r, "gen": gen})
    ev.append({"ev": "free", "worker": d, "blocks": db, "request": r, "gen": gen})
    return ev


def generate(path: str, n_events: int, concurrency: int = 256, blocks_per_request: int = 4) -> int:
    """Write a clean history of about ``n_events`` events; returns the count."""
    pool = concurrency * blocks_per_request
    workers = {"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"}
    free = {w: list(range(pool)) for w in workers}
    header = {"pdproto": "history", "version": 1, "policy": "push", "complete": True,
              "workers": {w: {"role": role, "blocks": pool} for w, role in workers.items()}}
    active: list[list] = []  # [events, next index, worker blocks to return]
    written = 0
    i = 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
        while written < n_events or active:
            while written < n_events and len(active) < concurrency:
                p, d = f"P{i % 2}", f"D{(i // 2) % 2}"
                pb = [free[p].pop() for _ in range(blocks_per_request)]
                db = [free[d].pop() for _ in range(blocks_per_request)]
                evs = request_events(i, 0, p, d, pb, db, cancel=(i % 17 == 3))
                active.append([evs, 0, (p, pb, d, db)])
                i += 1
            still = []
            lines = []
            for entry in active:
                evs, k, owned = entry
                lines.append(json.dumps(evs[k]))
                k += 1
                if k == len(evs):
                    p, pb, d, db = owned
                    free[p].extend(pb)
                    free[d].extend(db)
                else:
                    entry[1] = k
                    still.append(entry)
            fh.write("\n".join(lines) + "\n")
            written += len(lines)
            active = still
    return written


def audit_in_child(path: str, orjson: bool = True) -> dict:
    code = (
        "import json, sys, time\n"
        + ("" if orjson else "sys.modules['orjson'] = None  # the standard library's json only\n")
        + 
        "try:\n"
        "    from pdproto.drivers._audit import audit  # the library driver\n"
        "except ImportError:  # before the drivers moved out of the CLI\n"
        "    from pdproto._cli._audit import audit\n"
        "t = time.perf_counter()\n"
        f"r = audit({path!r})\n"
        "s = time.perf_counter() - t\n"
        "m = r[0] if isinstance(r, tuple) else r\n"
        "print(json.dumps({'seconds': s, 'events': m.events, 'violations': len(m.violations)}))\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT},
    )
    result = json.loads(out.stdout)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result["note"] = "max RSS of the audit process" if before == 0 else "max RSS over child processes"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="a small run for CI (50,000 events)")
    ap.add_argument("--no-orjson", action="store_true", help="read with the standard library's json only")
    args = ap.parse_args()
    n = 50_000 if args.quick else args.events
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "history.jsonl")
        t = time.perf_counter()
        written = generate(path, n, args.concurrency)
        gen_s = time.perf_counter() - t
        size_mb = os.path.getsize(path) / 2**20
        result = audit_in_child(path, orjson=not args.no_orjson)
    rate = result["events"] / result["seconds"]
    print(f"history: {written:,} events, {size_mb:.1f} MiB, {args.concurrency} concurrent requests "
          f"(generated in {gen_s:.1f} s)")
    reader = "json" if args.no_orjson else "orjson if installed"
    print(f"audit ({reader}): {result['seconds']:.2f} s, {rate:,.0f} events/s, "
          f"peak memory {result['peak_rss_mb']:.0f} MB ({result['note']}), "
          f"{result['violations']} violations")
    if result["violations"]:
        sys.exit("the synthetic history should be clean")


if __name__ == "__main__":
    main()
