"""``pdproto replay``: execute a history on real paged KV buffers (torch) while
the monitor judges it; report protocol and data-level violations together."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from .._errors import PdprotoError, UsageError
from ..spec._history import POLICIES, open_history
from ..spec._monitor import INVARIANTS, Monitor, Violation, check_invariant_ids
from . import EXIT_OK, EXIT_VIOLATION

BACKENDS = ("torch",)
DTYPE_CHOICES = ("bfloat16", "float16", "float32", "float64", "bf16", "fp16", "fp32")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="execute a history on real paged KV buffers and verify every byte decode reads",
        description=(
            "Replay a history (format v1, JSON Lines; '-' reads standard input) on one paged "
            "KV pool per worker (torch), with adversarial timing: transfers read their source "
            "at transfer_read_done and their writes land at transfer_write_done; free and "
            "restart poison memory. Every decode checks that positions 0..position-1 hold "
            "exactly its generation's KV; a mismatch is reported as kv-corruption, next to "
            "the monitor's violations. Exit 0 when clean, 1 on any violation, 2 on bad input."
        ),
    )
    p.add_argument("file", metavar="FILE", help="the history to replay, or - for standard input")
    p.add_argument("--backend", choices=BACKENDS, default="torch", help="data backend (default torch)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N); default cpu")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES, help="KV dtype (default bfloat16)")
    p.add_argument("--tp", default="1:1", metavar="P:D",
                   help="tensor-parallel sizes of prefill and decode workers (default 1:1)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    p.add_argument("--head-dim", type=int, default=8, help="head dimension, >= 5 (default 8)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: the header's block_size, else 4)")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="protocol family for the monitor (overrides the header)")
    p.add_argument("--complete", action="store_true",
                   help="the history runs until the system went quiet: apply leak and stuck")
    p.add_argument("--skip", default="", metavar="INVARIANT[,INVARIANT]",
                   help="monitor invariant ids not to report, comma-separated")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(run=run)


def _load_backend() -> Any:
    try:
        _torch_backend = importlib.import_module("pdproto._torch_backend")
    except ModuleNotFoundError as exc:
        if exc.name == "torch" or (exc.name or "").startswith("torch."):
            raise PdprotoError(
                "the torch backend needs PyTorch, which is not installed: "
                "pip install 'pdproto[torch]'"
            ) from None
        raise
    return _torch_backend


def replay(path: str, *, device: str = "cpu", dtype: str = "bfloat16", tp: str = "1:1",
           layers: int = 2, kv_heads: int = 4, head_dim: int = 8, block_size: int | None = None,
           policy: str | None = None, complete: bool = False, skip: Any = ()) -> tuple[Monitor, Any, list[Violation]]:
    """Replay the history at ``path``: returns the finished monitor, the
    finished backend, and every violation of both, sorted by line."""
    tb = _load_backend()
    skipped = check_invariant_ids(skip)
    for name, value, low in (("--layers", layers, 1), ("--kv-heads", kv_heads, 1), ("--head-dim", head_dim, 5)):
        if value < low:
            raise UsageError(name, value, f"an integer >= {low}")
    if block_size is not None and block_size < 1:
        raise UsageError("--block-size", block_size, "an integer >= 1")
    with open_history(path) as reader:
        monitor = Monitor.from_header(reader.header, policy=policy, complete=complete, skip=skipped)
        backend = tb.TorchBackend(reader.header, device=device, dtype=dtype, tp=tb.parse_tp(tp),
                                  layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                  block_size=block_size)
        feed, apply = monitor.feed, backend.apply
        for line, event in reader:
            feed(event, line)
            apply(event, line)
        last = max(monitor.line, reader.line)
        monitor.line = last
        backend.line = max(backend.line, last)
        monitor.finish()
        backend.finish()
    merged = sorted(
        [(v.line, 0, i, v) for i, v in enumerate(monitor.violations)]
        + [(v.line, 1, i, v) for i, v in enumerate(backend.violations)]
    )
    return monitor, backend, [m[3] for m in merged]


def run(args: argparse.Namespace, console: Any) -> int:
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    monitor, backend, violations = replay(
        args.file, device=args.device, dtype=args.dtype, tp=args.tp, layers=args.layers,
        kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
        policy=args.policy, complete=args.complete, skip=skip,
    )
    data = [v for v in violations if v.invariant == "kv-corruption"]
    if args.json:
        obj = {
            "ok": not violations,
            "events": monitor.events,
            "violations": [_to_dict(v) for v in violations],
            "protocol_violations": len(violations) - len(data),
            "data_violations": len(data),
            "requests": monitor.requests,
            "policy": monitor.policy,
            "complete": monitor.complete,
            "backend": _backend_info(backend),
        }
        print(json.dumps(obj))
    else:
        _print_report(console, args.file, monitor, backend, violations)
    return EXIT_VIOLATION if violations else EXIT_OK


def _to_dict(v: Violation) -> dict[str, Any]:
    out = v.to_dict()
    out["level"] = "data" if v.invariant == "kv-corruption" else "protocol"
    return out


def _backend_info(backend: Any) -> dict[str, Any]:
    L = backend.layout
    return {
        "name": "torch",
        "device": str(backend.device),
        "dtype": L.dtype,
        "tp": list(backend.tp),
        "layers": L.layers,
        "kv_heads": L.kv_heads,
        "head_dim": L.head_dim,
        "block_size": L.block_size,
        "bytes_copied": backend.bytes_copied,
    }


def _print_report(console: Any, path: str, monitor: Monitor, backend: Any, violations: list[Violation]) -> None:
    from rich.table import Table

    name = "<stdin>" if path == "-" else path
    L = backend.layout
    console.print(
        f"[bold]{name}[/]: {monitor.events} events, {monitor.requests} requests, replayed on "
        f"{backend.device} ({L.dtype}, {L.layers} layers x {L.kv_heads} KV heads x head dim "
        f"{L.head_dim}, block size {L.block_size}, tp {backend.tp[0]}:{backend.tp[1]}); "
        f"{backend.bytes_copied} bytes transferred",
        markup=True,
    )
    if not violations:
        console.print("[green]ok[/]: no invariant violated, every byte decode read was right")
        return
    table = Table(show_lines=False)
    table.add_column("line", justify="right")
    table.add_column("level")
    table.add_column("invariant", style="red")
    table.add_column("message")
    table.add_column("witness")
    for v in violations:
        level = "data" if v.invariant == "kv-corruption" else "protocol"
        table.add_row(str(v.line), level, v.invariant, v.message, ", ".join(map(str, v.witness)) or "-")
    console.print(table)
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.invariant] = counts.get(v.invariant, 0) + 1
    summary = ", ".join(f"{inv} x{n}" for inv, n in counts.items())
    console.print(f"[red]{len(violations)} violation(s)[/]: {summary}")


__all__ = ["add_parser", "run", "replay", "INVARIANTS"]
