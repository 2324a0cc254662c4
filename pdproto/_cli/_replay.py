"""``pdproto replay``: execute a history on real paged KV buffers (torch) while
the monitor judges it; report protocol and data-level violations together."""

from __future__ import annotations

import argparse
from typing import Any

from .._errors import UsageError
from ..backends import TRANSPORTS
from ..drivers import ReplayResult, level, replay
from ..spec import INVARIANTS, MAX_LINE_BYTES, POLICIES
from ._args import esc, int_type, positive_int, print_result, size_type
from ._audit import print_violations

BACKENDS = ("torch",)
DTYPE_CHOICES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "bf16",
    "fp16",
    "fp32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)
LAYOUT_CHOICES = ("mha", "mla")
SCALE_CHOICES = ("per-tensor", "per-block", "per-head")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="execute a history on real paged KV buffers and verify every byte decode reads",
        description=(
            "Replay a history (format v1 or 1.1, JSON Lines; '-' reads standard input) on paged "
            "KV pools per worker (torch), with adversarial timing: transfers read their source "
            "at transfer_read_done and their writes land at transfer_write_done; free and "
            "restart poison memory. Every decode checks that positions 0..position-1 hold "
            "exactly its generation's KV; a mismatch is reported as kv-corruption, next to "
            "the monitor's violations. The KV layout comes from the header's kv object and "
            "each worker's tp/pp (format 1.1); a flag given here overrides the header. "
            "Exit 0 when clean, 1 on any violation, 2 on bad input."
        ),
    )
    p.add_argument("file", metavar="FILE", help="the history to replay, or - for standard input")
    p.add_argument("--backend", choices=BACKENDS, default="torch", help="data backend (default torch)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N); default cpu")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="how transfers move KV between pools: copy (default, Tensor.copy_), nixl (NIXL "
        "agents over UCX on host memory; pdproto[nixl]) or mooncake (Mooncake's transfer engine "
        "over TCP on loopback; pdproto[mooncake]); see docs/replay.md",
    )
    p.add_argument(
        "--transfer-timing",
        choices=("adversarial", "eager"),
        default=None,
        help="when a transfer's bytes move: adversarial (default: read at transfer_read_done, "
        "written at transfer_write_done, the latest) or eager (posted at transfer_start and "
        "complete before the next event, as a transfer library on an idle host)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_CHOICES,
        help="KV dtype (default: the header's kv.dtype, else bfloat16)",
    )
    p.add_argument(
        "--scale",
        default=None,
        choices=SCALE_CHOICES,
        help="fp8 scale granularity (default: the header's kv.scale, else per-tensor)",
    )
    p.add_argument(
        "--layout",
        default=None,
        choices=LAYOUT_CHOICES,
        help="KV layout: mha, or mla (one latent per token and layer) (default: the header's, else mha)",
    )
    p.add_argument(
        "--tp",
        default=None,
        metavar="P:D",
        help="tensor-parallel sizes of prefill and decode workers, for every worker "
        "(default: each worker's tp in the header, else 1:1)",
    )
    p.add_argument("--layers", type=int_type(), default=None, help="layers (default: the header's, else 2)")
    p.add_argument(
        "--kv-heads", type=int_type(), default=None, help="KV heads (default: the header's, else 4)"
    )
    p.add_argument(
        "--head-dim",
        type=int_type(),
        default=None,
        help="head dimension, >= 5 (default: the header's, else 8)",
    )
    p.add_argument(
        "--block-size",
        type=int_type(),
        default=None,
        help="tokens per block (default: the header's block_size, else 4)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="protocol family for the monitor (overrides the header)",
    )
    p.add_argument(
        "--complete",
        action="store_true",
        help="the history runs until the system went quiet: apply leak and stuck",
    )
    p.add_argument(
        "--skip",
        default="",
        metavar="INVARIANT[,INVARIANT]",
        help="monitor invariant ids not to report, comma-separated",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument(
        "--max-memory",
        type=size_type,
        default=None,
        metavar="SIZE",
        help="most memory the KV pools may take, e.g. 16G (default 4G); computed before "
        "anything is allocated",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch intra-op threads during the replay (default 1: per-block work is small)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=positive_int,
        default=MAX_LINE_BYTES,
        metavar="N",
        help=f"longest history line accepted, in bytes (default {MAX_LINE_BYTES:,})",
    )
    p.add_argument(
        "--transformer",
        "--model",
        dest="model",
        metavar="NAME|PATH",
        help="also run a real transformer: prefill on P, its real KV through the history's "
        "blocks, decode on D, logits compared bit for bit with a colocated run "
        "(logit-divergence): tiny-llama, tiny-qwen2, tiny-mistral, smollm2-135m, or a local "
        "Hugging Face model folder (needs pdproto[model]; nothing is downloaded; --model is "
        "the same flag)",
    )
    p.add_argument(
        "--adapter",
        metavar="NAME",
        help="instead of KV buffers, re-enact the history's decisions on a real system "
        "(vllm, vllm:push, model:NAME, module:attribute; docs/adapters.md) and report where "
        "it did something the history did not, or refused something the history did",
    )
    p.set_defaults(run=run)


#: replay flags that configure the KV buffers, and so mean nothing with --adapter
KV_ONLY = (
    "dtype",
    "scale",
    "layout",
    "tp",
    "layers",
    "kv_heads",
    "head_dim",
    "block_size",
    "max_memory",
    "model",
    "transport",
    "transfer_timing",
)


def run(args: argparse.Namespace, console: Any) -> int:
    if args.adapter is not None:
        return run_adapter(args, console)
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    result = replay(
        args.file,
        device=args.device,
        dtype=args.dtype,
        tp=args.tp,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        layout=args.layout,
        scale=args.scale,
        policy=args.policy,
        complete=args.complete,
        skip=skip,
        max_line_bytes=args.max_line_bytes,
        max_memory=args.max_memory,
        threads=args.threads,
        model=args.model,
        transport=args.transport,
        timing=args.transfer_timing or "adversarial",
    )
    return print_result(result, args.json, lambda: _print_report(console, args.file, result))


def _print_report(console: Any, path: str, result: ReplayResult) -> None:
    name = "<stdin>" if path == "-" else path
    b = result.backend
    heads = "MLA latent" if b.get("layout") == "mla" else f"{b['kv_heads']} KV heads"
    scale = f" {b['scale']} scales" if b.get("scale") else ""
    par = ", ".join(
        f"{n} tp {w['tp']}" + (f" pp {w['pp']}" if w["pp"] > 1 else "")
        for n, w in b.get("workers", {}).items()
    )
    console.print(
        f"[bold]{esc(name)}[/]: {result.events} events, {result.requests} requests, replayed on "
        f"{b['device']} ({b['dtype']}{scale}, {b['layers']} layers x {heads} x head dim "
        f"{b['head_dim']}, block size {b['block_size']}; {esc(par) or 'no worker'}); "
        f"{b['bytes_copied']} bytes transferred"
        + (f" through {b['transport']}" if b.get("transport", "copy") != "copy" else "")
        + f", {b['bytes_verified']} bytes verified",
        markup=True,
    )
    ts = b.get("transport_statistics")
    if ts:
        mean = ts["seconds"] / ts["transfers"] * 1e6 if ts["transfers"] else 0.0
        console.print(
            f"{esc(ts['name'])}: {ts['transfers']} transfers, {mean:.0f} us each on average (post to "
            f"completion), {ts['notifications']} peer notifications ({ts['notifications_missing']} missing), "
            f"{ts['aborts']} handles released by an abort ({ts['aborts_landed']} landed anyway), "
            f"{ts['failures']} failures reported by the library, {ts['restarts']} agents re-added"
        )
    m = b.get("model")
    if m:
        console.print(
            f"model {esc(str(m.get('name')))}: {m.get('layers')} layers x {m.get('kv_heads')} KV "
            "heads x head "
            f"dim {m.get('head_dim')}, boundary {m.get('boundary')}; {m.get('prefills')} prefills, "
            f"{m.get('decodes')} decode steps compared bit for bit with a colocated run"
        )
    violations = result.violations
    if not violations:
        console.print(
            "[green]ok[/]: no invariant violated, every byte decode read was right"
            + (", every logit bit-exact" if m else "")
        )
        return
    print_violations(console, violations, level)


def run_adapter(args: argparse.Namespace, console: Any) -> int:
    """``pdproto replay HISTORY --adapter NAME``: re-enact it on a real system."""
    from ..drivers import load_adapter, replay_on_adapter

    given = [k for k in KV_ONLY if getattr(args, k) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(flag, getattr(args, given[0]), "no KV buffer flag with --adapter")
    if args.file == "-":
        raise UsageError("FILE", "-", "a history file with --adapter (it is read before the engine starts)")
    options = {"policy": args.policy} if args.policy and args.adapter.startswith("model:") else {}
    adapter = load_adapter(args.adapter, **options)
    try:
        result = replay_on_adapter(args.file, adapter)
    finally:
        adapter.close()
    return print_result(result, args.json, lambda: _print_adapter_report(console, result))


def _print_adapter_report(console: Any, result: Any) -> None:
    console.print(
        f"[bold]{esc(result.history)}[/] re-enacted on {esc(result.adapter)}: {result.matched} of "
        f"{result.events} events matched, {result.actions} actions applied",
        markup=True,
    )
    for d in result.divergences:
        console.print(f"  line {d.line}: [red]{d.kind}[/]: {esc(d.message)}", markup=True)
    if result.violations:
        console.print("the engine's own events broke:")
        print_violations(console, result.violations, level)
    if result.ok:
        console.print("[green]ok[/]: the engine did exactly what the history records, and broke no invariant")


__all__ = ["add_parser", "run", "replay", "INVARIANTS"]
