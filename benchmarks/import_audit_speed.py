"""Import + audit speed: a 1,000,000-line vLLM DEBUG log, streaming.

Generates a vLLM DEBUG log of P and D together (vLLM 0.32.0's line format
and messages, see pdproto/importers/_vllm.py) with a realistic mix: for each
handoff the connector's DEBUG lines (get_num_new_matched_tokens,
update_state_after_alloc, request_finished on both sides, the lease, Finished
sending / recving), and around them the lines a DEBUG log is mostly made of
(HTTP access lines, "Added request", the scheduler's and model runner's DEBUG
chatter, the metrics line every few hundred lines); 1% of the handoffs have a
lease expiry followed by a late READ (early-source-free), 0.5% a NIXL
transfer failure, 1% an abort at D while loading.  Then, in two fresh
processes (so that each peak memory is its own), `pdproto import vllm` to a
file and `pdproto audit` of that file, each timed (wall and CPU).

    python benchmarks/import_audit_speed.py                 # 1,000,000 lines
    python benchmarks/import_audit_speed.py --lines 100000

Target (issue 14): import + audit under 30 s on this machine, in constant
memory: the import's peak RSS is the same for 100,000 and 1,000,000 lines
(the audit's grows with the live ids it tracks, not with the file).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

P_PREFIX, D_PREFIX, API = "(EngineCore_DP0 pid=41)", "(EngineCore_DP0 pid=52)", "(APIServer pid=40)"
CHATTER = (
    "DEBUG {t} [v1/engine/core.py:1012] EngineCore loop active.",
    "DEBUG {t} [v1/core/sched/scheduler.py:611] Scheduled 3 requests, 1 running, 0 waiting, 96 tokens",
    "DEBUG {t} [v1/worker/gpu_model_runner.py:2310] Running batch of 3 requests (padded to 4) with cudagraph",
    "DEBUG {t} [v1/core/kv_cache_manager.py:288] Allocated 2 new blocks, 4021 free",
    "DEBUG {t} [v1/engine/output_processor.py:455] Detokenized 3 outputs",
    "INFO {t} [v1/metrics/loggers.py:236] Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation "
    "throughput: 96.0 tokens/s, Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit "
    "rate: 0.0%",
)
ACCESS = 'INFO:     10.0.0.9:{port} - "POST /v1/completions HTTP/1.1" 200 OK'


def handoff_lines(i: int, t: str, fault: str) -> list[str]:
    p, d = f"cmpl-{i:08x}-0-p{i % 9973:04x}", f"cmpl-{i:08x}-0-d{i % 9967:04x}"
    p_params = "{'do_remote_decode': True, 'do_remote_prefill': False}"
    d_params = (f"{{'do_remote_prefill': True, 'do_remote_decode': False, 'remote_block_ids': [[{i % 4000}, "
                f"{i % 4000 + 1}]], 'remote_engine_id': 'e5a1', 'remote_request_id': '{p}', "
                "'remote_host': '10.0.0.1', 'remote_port': 5600, 'tp_size': 1}")
    fin = "NIXLConnector request_finished({r}), request_status={s}, kv_transfer_params={k}"
    out = [
        f"{API} INFO {t} [v1/engine/async_llm.py:578] Added request {p}.",
        f"{P_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:52] NIXLConnector get_num_new_matched_tokens: "
        f"num_computed_tokens=0, kv_transfer_params={p_params}",
        f"{P_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:112] NIXLConnector update_state_after_alloc: "
        f"num_external_tokens=0, kv_transfer_params={p_params}",
        f"{P_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:202] " + fin.format(r=p, s="FINISHED_LENGTH_CAPPED", k=p_params),
        f"{P_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:258] NIXLConnector request_finished({p}) waiting for 30 "
        "seconds before releasing blocks",
        f"{API} INFO {t} [v1/engine/async_llm.py:578] Added request {d}.",
        f"{D_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:52] NIXLConnector get_num_new_matched_tokens: "
        f"num_computed_tokens=0, kv_transfer_params={d_params}",
        f"{D_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:112] NIXLConnector update_state_after_alloc: "
        f"num_external_tokens=40, kv_transfer_params={d_params}",
    ]
    if fault == "expiry":
        out += [
            f"{P_PREFIX} WARNING {t} [nixl/base_worker.py:3033] Releasing expired KV blocks for request {p} which "
            "were retrieved by 0 remote worker(s) before lease expired.",
            f"{P_PREFIX} DEBUG {t} [v1/core/sched/scheduler.py:3233] Finished sending KV transfer for request {p}",
            f"{P_PREFIX} ERROR {t} [nixl/pull_worker.py:668] Potentially invalid KV blocks for unrecognized request "
            f"{p} were retrieved by a decode worker. They may have expired.",
        ]
    if fault == "failure":
        out.append(f"{D_PREFIX} ERROR {t} [nixl/base_worker.py:1261] NIXL transfer failure: transfer_failed | "
                   f"Context: {{'failure_type': 'transfer_failed', 'request_id': '{d}', 'engine_id': 'e5a2', "
                   f"'remote_engine_id': 'e5a1', 'remote_request_id': '{p}', 'num_local_blocks': 2}}")
    if fault == "abort":
        out.append(f"{D_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:202] "
                   + fin.format(r=d, s="FINISHED_ABORTED", k=d_params.replace("True", "False", 1)))
    out.append(f"{D_PREFIX} DEBUG {t} [v1/core/sched/scheduler.py:3223] Finished recving KV transfer for request {d}")
    if fault != "expiry":
        out.append(f"{P_PREFIX} DEBUG {t} [v1/core/sched/scheduler.py:3233] Finished sending KV transfer for request {p}")
    if fault != "abort":
        status = "FINISHED_ERROR" if fault == "failure" else "FINISHED_STOPPED"
        out.append(f"{D_PREFIX} DEBUG {t} [nixl/pull_scheduler.py:202] "
                   + fin.format(r=d, s=status, k=d_params.replace("True", "False", 1)))
    return out


def write_log(path: str, lines: int, seed: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    written = handoffs = 0
    faults = {"expiry": 0, "failure": 0, "abort": 0}
    with open(path, "w") as fh:
        i = 0
        while written < lines:
            t = f"12-01 10:{(i // 600) % 60:02d}:{(i // 10) % 60:02d}"
            roll = rng.random()
            fault = "expiry" if roll < 0.01 else "failure" if roll < 0.015 else "abort" if roll < 0.025 else ""
            if fault:
                faults[fault] += 1
            chunk = handoff_lines(i, t, fault)
            handoffs += 1
            # about 85% of a DEBUG log is not the connector's
            for _ in range(rng.randint(60, 80)):
                if rng.random() < 0.3:
                    chunk.append(f"{API} " + ACCESS.format(port=30000 + rng.randrange(20000)))
                else:
                    chunk.append(f"{P_PREFIX if rng.random() < 0.5 else D_PREFIX} "
                                 + rng.choice(CHATTER).format(t=t))
            take = chunk[: lines - written]
            fh.write("\n".join(take) + "\n")
            written += len(take)
            i += 1
    return {"lines": written, "handoffs": handoffs, **faults}


IMPORT = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from pdproto.importers import import_log
imported = import_log("vllm", sys.argv[1], sys.argv[2])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"import_s": time.perf_counter() - t0, "events": imported.events, "dropped": imported.dropped,
                  "unrecognised": imported.unrecognised, "import_cpu_s": usage.ru_utime + usage.ru_stime,
                  "import_rss_mb": usage.ru_maxrss / 1024}))
"""
AUDIT = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from pdproto.drivers._audit import audit
result = audit(sys.argv[1])
usage = resource.getrusage(resource.RUSAGE_SELF)
found = {}
for v in result.violations:
    found[v.invariant] = found.get(v.invariant, 0) + 1
print(json.dumps({"audit_s": time.perf_counter() - t0, "violations": found,
                  "not_judged": len(getattr(result, "not_judged", ()) or ()),
                  "audit_cpu_s": usage.ru_utime + usage.ru_stime, "audit_rss_mb": usage.ru_maxrss / 1024}))
"""


def _run(script: str, *args: str) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def measure(lines: int) -> dict:
    """Import and audit, each in a fresh process (its time counts its
    imports of pdproto; its peak RSS is its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        log, out = os.path.join(tmp, "vllm-debug.log"), os.path.join(tmp, "imported.jsonl")
        t0 = time.perf_counter()
        mix = write_log(log, lines)
        gen_s = time.perf_counter() - t0
        size = os.path.getsize(log)
        got = {**_run(IMPORT, log, out), **_run(AUDIT, out)}
    return {**mix, "log_mb": size / 2**20, "generate_s": gen_s, **got}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the 100,000-line run the memory is compared with")
    parser.add_argument("--quick", action="store_true", help="20,000 lines only (CI's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.no_baseline = 20_000, True
    runs = [args.lines] if args.no_baseline or args.lines <= 100_000 else [100_000, args.lines]
    for lines in runs:
        r = measure(lines)
        total = r["import_s"] + r["audit_s"]
        print(f"{r['lines']:>9,} lines ({r['log_mb']:.0f} MiB, {r['handoffs']:,} handoffs: {r['expiry']} lease "
              f"expiries then a late read, {r['failure']} transfer failures, {r['abort']} aborts at D)")
        print(f"  import {r['import_s']:6.2f} s wall, {r['import_cpu_s']:.2f} s CPU "
              f"({r['lines'] / r['import_s']:,.0f} lines/s), {r['events']:,} events ({r['dropped']} of requests the log "
              f"cut left out), {r['unrecognised']} "
              f"unrecognised; peak RSS {r['import_rss_mb']:.0f} MiB")
        print(f"  audit  {r['audit_s']:6.2f} s wall, {r['audit_cpu_s']:.2f} s CPU; violations {r['violations']}; "
              f"not judged {r['not_judged']}; peak RSS {r['audit_rss_mb']:.0f} MiB")
        print(f"  import + audit {total:.2f} s wall (target < 30 s: {'met' if total < 30 else 'NOT met'}), "
              f"{r['import_cpu_s'] + r['audit_cpu_s']:.2f} s CPU (each process's start-up included)")
        print(f"  load average {os.getloadavg()[0]:.1f} (the machine is shared: wall time grows with it)")


if __name__ == "__main__":
    main()
