"""Copy bandwidth of the torch replay backend's transfer path.

Replays P->D handoffs of the seed's teaching model (32 layers, 8 KV heads,
head dim 128, bf16, 4096 tokens: 512 MiB of K and V per request) on the
torch backend and times the transfer path (``transfer_read_done`` +
``transfer_write_done``), against a plain ``torch`` copy of the same bytes
on the same device in the same run.  Reports the ratio of the two
bandwidths (target on CPU: >= 0.5).

Two paths are timed:

- ``direct``: the source is untouched between read_done and write_done, so
  the write copies straight from the source (the common case);
- ``staged``: the source is freed (legitimately) right after read_done, so
  the read is materialised into a staging buffer first (copy-on-write) and
  the write copies from there: twice the bytes moved, so about 0.5 at best.
  The free's poison (a fill of the freed blocks, not copy work) is taken
  off, as the backend's :meth:`~pdproto.backends.TorchBackend.statistics`
  times it (the same ``time.perf_counter`` clock).

Usage: python benchmarks/replay_bandwidth.py [--quick] [--device cpu|cuda]
[--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pdproto import (  # noqa: E402
    Commit,
    Finish,
    Free,
    HistoryHeader,
    PrefillDone,
    PrefillStart,
    Reserve,
    Submit,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
)
from pdproto.backends import TorchBackend  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timing only: not part of the copy path


class Handoffs:
    """Handoffs of ``tokens`` tokens in ``blocks`` (the same blocks on P and
    D every time) applied to ``backend``; ``handoff(i, staged, verify)``
    returns the seconds of the transfer path (``transfer_read_done`` +
    ``transfer_write_done``; with ``staged`` the source is freed between
    them and the free's poison is taken off).  Also used by
    benchmarks/transport_bandwidth.py."""

    def __init__(self, backend: TorchBackend, tokens: int, blocks: tuple[int, ...]) -> None:
        self.backend = backend
        self.tokens = tokens
        self.blocks = blocks
        self.line = 1

    def ap(self, ev):
        self.line += 1
        return self.backend.apply(ev, self.line)

    def __call__(self, i: int, staged: bool, verify: bool) -> float:
        ap, backend, blocks, tokens = self.ap, self.backend, self.blocks, self.tokens
        device = backend.device
        r = f"r{i}"
        ap(Submit(r, 0, prompt_len=tokens, max_new_tokens=1))
        ap(Reserve(r, 0, f"t{i}", "D0", blocks))
        ap(PrefillStart(r, 0, "P0", blocks))
        ap(PrefillDone(r, 0, "P0", first_token=1, processed_len=tokens))
        ap(TransferStart(f"x{i}", f"t{i}", r, 0, "P0", blocks, "D0", blocks))
        _sync(device)
        poison0 = backend.statistics().poison_seconds
        t0 = time.perf_counter()
        ap(TransferReadDone(f"x{i}"))
        if staged:
            ap(Free("P0", blocks, r, 0))  # legal after read_done: forces the staging copy
        ap(TransferWriteDone(f"x{i}"))
        _sync(device)
        dt = time.perf_counter() - t0
        if not staged:
            ap(Free("P0", blocks, r, 0))
        else:
            # the free's poison is not copy work: take off what the backend spent
            # poisoning (its own timing, the same clock, of the fill it does)
            dt -= backend.statistics().poison_seconds - poison0
        if verify:
            bad = ap(Commit(r, 0, f"t{i}", "D0"))
            assert not bad, bad
        ap(Finish(r, 0))
        ap(Free("D0", blocks, r, 0))
        return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=None, help="handoffs timed per path")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--verify", action="store_true", help="also verify every commit (slow at full size)")
    args = ap.parse_args(argv)

    if args.quick:
        layers, heads, head_dim, tokens, bs = 4, 8, 128, 512, 16
        repeat = args.repeat or 3
    else:
        layers, heads, head_dim, tokens, bs = 32, 8, 128, 4096, 16
        repeat = args.repeat or 5
    nblocks = tokens // bs
    header = HistoryHeader(policy="push", workers={
        "P0": WorkerSpec("prefill", nblocks), "D0": WorkerSpec("decode", nblocks)})
    backend = TorchBackend(header, device=args.device, dtype="bfloat16", layers=layers,
                           kv_heads=heads, head_dim=head_dim, block_size=bs,
                           max_memory=None)  # the sizes are fixed above
    device = backend.device
    blocks = tuple(range(nblocks))
    nbytes = nblocks * backend.layout.block_bytes
    handoff = Handoffs(backend, tokens, blocks)

    def plain() -> float:
        src = backend.pool("P0")
        dst = backend.pool("D0")
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        return time.perf_counter() - t0

    handoff(0, staged=False, verify=True)  # warm up, and check the bytes once
    plain()
    i = 1
    results = {}
    for path, staged in (("direct", False), ("staged", True)):
        times, plains = [], []
        for k in range(repeat):
            times.append(handoff(i, staged, verify=args.verify))
            i += 1
            plains.append(plain())
        t, p = statistics.median(times), statistics.median(plains)
        results[path] = {
            "transfer_s": t,
            "plain_copy_s": p,
            "transfer_GiB_s": nbytes / t / 2**30,
            "plain_GiB_s": nbytes / p / 2**30,
            "ratio": p / t,
        }
    assert backend.ok, backend.violations[:3]
    out = {
        "device": str(device),
        "bytes_per_handoff": nbytes,
        "MiB_per_handoff": nbytes / 2**20,
        "layers": layers, "kv_heads": heads, "head_dim": head_dim, "tokens": tokens,
        "block_size": bs, "dtype": "bfloat16", "threads": torch.get_num_threads(),
        "repeat": repeat, **results,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['MiB_per_handoff']:.0f} MiB per handoff ({layers} layers x {heads} KV heads x "
              f"{head_dim} x {tokens} tokens, bf16) on {device}, {repeat} handoffs per path")
        for path in ("direct", "staged"):
            r = results[path]
            print(f"  {path:6}: transfer {r['transfer_GiB_s']:6.2f} GiB/s, plain copy "
                  f"{r['plain_GiB_s']:6.2f} GiB/s, ratio {r['ratio']:.2f}")
    # a figure, not a test: the target (>= 0.5 on CPU) is judged on the full
    # size; small --quick copies are dominated by per-call overhead
    verdict = "meets" if results["direct"]["ratio"] >= 0.5 else "is below"
    print(f"  the direct path {verdict} the 0.5 target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
