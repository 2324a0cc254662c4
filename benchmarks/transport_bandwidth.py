"""Bandwidth and per-transfer latency of the replay backend's transports,
side by side in one run: ``copy`` (``Tensor.copy_``) against ``nixl`` (NIXL
agents over UCX on host memory) and ``mooncake`` (Mooncake's transfer engine
over TCP on loopback) where they load.

At the sizes of benchmarks/replay_bandwidth.py (the seed's teaching model:
32 layers x 8 KV heads x head dim 128, bf16, 4096 tokens = 512 MiB per
handoff; ``--quick``: 4 layers x 512 tokens = 8 MiB) plus one block of 16
tokens (``tiny``, where the per-transfer latency shows), a handoff's direct
path (``transfer_read_done`` + ``transfer_write_done``: one transfer of
every block, P to D, push: a WRITE by P) is timed on the torch backend with
each transport; the median of ``--repeat`` handoffs after one warm-up
(which also verifies the bytes: a commit checks them).  Reported per size
and transport: GiB/s, the ratio to copy's, the handoff's latency, and the
transport's own post-to-completion latency (its statistics).

Usage: python benchmarks/transport_bandwidth.py [--quick] [--repeat N]
[--transports copy,nixl,mooncake] [--pull] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdproto import HistoryHeader, WorkerSpec  # noqa: E402
from pdproto._errors import PdprotoError  # noqa: E402
from pdproto.backends import TorchBackend  # noqa: E402
from pdproto.backends import make_transport  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_bandwidth import Handoffs  # noqa: E402

#: name -> (layers, tokens); 8 KV heads x head dim 128, bf16, block size 16
SIZES = {"tiny": (1, 16), "quick": (4, 512), "full": (32, 4096)}


def measure(transport, layers: int, tokens: int, repeat: int, pull: bool) -> dict:
    bs = 16
    nblocks = tokens // bs
    header = HistoryHeader(policy="pull" if pull else "push", workers={
        "P0": WorkerSpec("prefill", nblocks), "D0": WorkerSpec("decode", nblocks)})
    backend = TorchBackend(header, dtype="bfloat16", layers=layers, kv_heads=8, head_dim=128, block_size=bs,
                           max_memory=None, transport=transport)
    blocks = tuple(range(nblocks))
    nbytes = nblocks * backend.layout.block_bytes
    handoff = Handoffs(backend, tokens, blocks)
    handoff(0, staged=False, verify=True)  # warm up (connections, registration), and check the bytes once
    before = backend.transport.statistics()
    first = len(backend.transport._latencies)
    times = [handoff(i, staged=False, verify=False) for i in range(1, repeat + 1)]
    after = backend.transport.statistics()
    lat = backend.transport._latencies[first:]
    assert backend.ok, backend.violations[:3]
    n = after.transfers - before.transfers
    t = statistics.median(times)
    return {
        "bytes": nbytes,
        "handoff_s": t,
        "GiB_s": nbytes / t / 2**30,
        "transport_latency_s": statistics.median(lat) if lat else None,
        "notify_s": (after.notify_seconds - before.notify_seconds) / n if n else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny and quick sizes only (no 512 MiB handoff)")
    ap.add_argument("--repeat", type=int, default=None, help="handoffs timed per size and transport")
    ap.add_argument("--transports", default="copy,nixl,mooncake")
    ap.add_argument("--pull", action="store_true", help="pull (a READ by D) instead of push (a WRITE by P)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    sizes = ["tiny", "quick"] + ([] if args.quick else ["full"])
    transports = {}
    skipped = {}
    for name in args.transports.split(","):
        try:
            transports[name] = make_transport(name)
        except (PdprotoError, ImportError) as exc:
            skipped[name] = str(exc)
    results: dict[str, dict] = {}
    for size in sizes:
        layers, tokens = SIZES[size]
        repeat = args.repeat or (5 if size == "full" else 20)
        row = {}
        for name, tr in transports.items():
            row[name] = measure(tr, layers, tokens, repeat, args.pull)
        for name in row:
            if "copy" in row:
                row[name]["ratio_to_copy"] = row[name]["GiB_s"] / row["copy"]["GiB_s"]
        results[size] = row
    for tr in transports.values():
        tr.close()
    out = {"mode": "pull" if args.pull else "push", "sizes": {s: SIZES[s] for s in sizes}, "results": results,
           "skipped": skipped}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"transports side by side ({out['mode']}; 8 KV heads x head dim 128, bf16, block size 16)")
    for size in sizes:
        layers, tokens = SIZES[size]
        any_row = next(iter(results[size].values()))
        print(f"{size}: {layers} layers x {tokens} tokens = {any_row['bytes'] / 2**20:.2f} MiB per handoff")
        for name, r in results[size].items():
            lat = r["transport_latency_s"]
            extra = f", library post->done {lat * 1e6:8.0f} us" if lat is not None else ""
            if r.get("notify_s") is not None and name == "nixl":
                extra += f", then notification {r['notify_s'] * 1e6:6.0f} us"
            print(f"  {name:8}: {r['GiB_s']:8.3f} GiB/s, ratio to copy {r.get('ratio_to_copy', 0):6.3f}, "
                  f"handoff {r['handoff_s'] * 1e6:10.0f} us{extra}")
    for name, why in skipped.items():
        print(f"  {name}: skipped ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
