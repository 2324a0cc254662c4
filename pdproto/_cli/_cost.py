"""``pdproto cost``: the bytes of one KV handoff, its time bound, and both timelines.

With no flags it reproduces the seed's worked example (teaching GQA model,
4096 tokens, 25 GiB/s, P 40 ms, D 4 ms/step, coordination 2 ms, J 30 ms).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._errors import UsageError
from ..cost import (
    DTYPE_BYTES,
    PRESETS,
    CostModel,
    CostReport,
    KVShape,
    Link,
    Timing,
    estimate,
    format_bytes,
)
from ._args import esc, int_type

__all__ = ["add_parser", "run"]

DEFAULT_PRESET = "teaching-gqa"
_INT = int_type()  # ASCII digits only; the model checks the range

# Library field name -> the flag that sets it, so errors name what the user typed.
_FLAGS = {
    "layers": "--layers",
    "kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "latent_dim": "--latent-dim",
    "bytes_per_element": "--dtype",
    "dtype": "--dtype",
    "preset": "--preset",
    "tokens": "--tokens",
    "tp": "--tp",
    "links": "--links",
    "bandwidth_gibps": "--bandwidth",
    "latency_ms": "--latency-ms",
    "prefill_ms": "--prefill-ms",
    "decode_ms": "--decode-ms",
    "coord_ms": "--coord-ms",
    "wait_ms": "--wait-ms",
    "first_tokens": "--first-tokens",
}

# Text timeline: one letter per span kind (readable without colour), and a style.
_GLYPHS = {"wait": "J", "prefill": "P", "coordination": "c", "transfer": "T", "decode": "D"}
_STYLES = {
    "wait": "black on grey70",
    "prefill": "white on blue",
    "coordination": "black on dark_orange",
    "transfer": "white on red",
    "decode": "black on green",
}


def add_parser(subparsers: Any) -> None:
    """Add the ``cost`` command to the ``pdproto`` parser."""
    presets = ", ".join(PRESETS)
    parser = subparsers.add_parser(
        "cost",
        help="bytes and time of one KV handoff; colocated vs disaggregated timeline",
        description=(
            "Cost one prefill->decode KV handoff: KV bytes from the model shape, the transfer "
            "lower bound (latency + bytes / bandwidth), and one request's timeline colocated vs "
            "disaggregated, with the break-even colocated wait.  With no flags: the seed's worked "
            "example.  Binary units: MiB = 2**20 B, GiB/s = 2**30 B/s."
        ),
        epilog=f"presets: {presets}.  dtypes: {', '.join(f'{k} ({v} B)' for k, v in DTYPE_BYTES.items())}.",
    )
    shape = parser.add_argument_group("KV shape (a preset, optionally overridden)")
    shape.add_argument("--preset", metavar="NAME", help=f"model shape preset (default {DEFAULT_PRESET})")
    shape.add_argument("--layers", type=_INT, metavar="N", help="transformer layers")
    shape.add_argument("--kv-heads", type=_INT, metavar="N", help="KV heads (not attention heads; GQA)")
    shape.add_argument("--head-dim", type=_INT, metavar="N", help="elements per head")
    shape.add_argument(
        "--latent-dim", type=_INT, metavar="N", help="MLA: latent + RoPE elements per token per layer"
    )
    shape.add_argument(
        "--dtype", metavar="NAME|BYTES", help=f"KV dtype ({', '.join(DTYPE_BYTES)}) or bytes per element"
    )
    shape.add_argument(
        "--tokens", type=_INT, default=4096, metavar="N", help="positions in the KV (default 4096)"
    )
    shape.add_argument(
        "--tp", type=_INT, default=1, metavar="N", help="TP ranks the KV heads are split over (default 1)"
    )

    link = parser.add_argument_group("link")
    _float_option(link, "--bandwidth", 25.0, "GIBPS", "effective bandwidth per link, GiB/s")
    _float_option(link, "--latency-ms", 0.0, "X", "fixed latency, ms")
    link.add_argument(
        "--links",
        type=_INT,
        default=1,
        metavar="N",
        help="independent links the TP ranks send over; 1 = shared egress (default 1)",
    )

    timing = parser.add_argument_group("timing, ms")
    _float_option(timing, "--prefill-ms", 40.0, "X", "P prefill compute")
    _float_option(timing, "--decode-ms", 4.0, "X", "one D decode step")
    _float_option(timing, "--coord-ms", 2.0, "X", "handoff coordination")
    _float_option(timing, "--wait-ms", 30.0, "J", "colocated extra queueing wait before prefill")
    timing.add_argument(
        "--first-tokens", type=_INT, default=4, metavar="K", help="tokens to time (default 4, >= 2)"
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    out.add_argument("--plot", metavar="FILE", help="write a timeline picture (.svg; .png needs matplotlib)")
    parser.set_defaults(run=run)


def _float_option(group: Any, flag: str, default: float, metavar: str, what: str) -> None:
    """A float option whose help ends with its default: ``what (default 25)``."""
    group.add_argument(
        flag, type=float, default=default, metavar=metavar, help=f"{what} (default {default:g})"
    )


def _shape(args: argparse.Namespace) -> tuple[str, KVShape]:
    name = args.preset if args.preset is not None else DEFAULT_PRESET
    base = KVShape.from_preset(name)
    label = name.strip().lower()
    gqa_flags = args.kv_heads is not None or args.head_dim is not None
    if args.latent_dim is not None and gqa_flags:
        raise UsageError(
            "--latent-dim",
            args.latent_dim,
            "either --latent-dim (MLA) or --kv-heads/--head-dim (GQA), not both",
        )
    layers = base.layers if args.layers is None else args.layers
    bpe = base.bytes_per_element if args.dtype is None else base.with_dtype(args.dtype).bytes_per_element
    if args.latent_dim is not None:
        shape = KVShape(layers, latent_dim=args.latent_dim, bytes_per_element=bpe)
    elif base.is_mla and not gqa_flags:
        shape = KVShape(layers, latent_dim=base.latent_dim, bytes_per_element=bpe)
    else:
        if base.is_mla and (args.kv_heads is None or args.head_dim is None):
            missing = "--head-dim" if args.head_dim is None else "--kv-heads"
            raise UsageError(
                missing,
                None,
                f"a value: preset {label!r} is MLA, so a GQA shape needs both --kv-heads and --head-dim",
            )
        kv_heads = base.kv_heads if args.kv_heads is None else args.kv_heads
        head_dim = base.head_dim if args.head_dim is None else args.head_dim
        shape = KVShape(layers, kv_heads=kv_heads, head_dim=head_dim, bytes_per_element=bpe)
    if shape != base:
        label = f"{label} (modified)" if args.preset is not None else "custom"
    return label, shape


def _build(args: argparse.Namespace) -> tuple[str, CostReport]:
    try:
        label, shape = _shape(args)
        model = CostModel(
            shape,
            args.tokens,
            Link(args.bandwidth, latency_ms=args.latency_ms),
            Timing(args.prefill_ms, args.decode_ms, coord_ms=args.coord_ms, wait_ms=args.wait_ms),
            tp=args.tp,
            links=args.links,
        )
        return label, estimate(model, first_tokens=args.first_tokens)
    except UsageError as exc:
        flag = _FLAGS.get(exc.what)
        if flag is None:
            raise
        raise UsageError(flag, exc.value, exc.allowed) from None


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def _size(nbytes: int) -> str:
    return f"{format_bytes(nbytes)} ({nbytes:,} B)"


def _describe_shape(shape: KVShape) -> str:
    dtype = next((k for k, v in DTYPE_BYTES.items() if v == shape.bytes_per_element), None)
    elem = f"{shape.bytes_per_element} B" + (f" ({dtype})" if dtype else "")
    if shape.is_mla:
        return f"{shape.layers} layers × latent {shape.latent_dim} (MLA, one latent, no separate V) × {elem}"
    return f"{shape.layers} layers × 2 (K,V) × {shape.kv_heads} KV heads × {shape.head_dim} head dim × {elem}"


def _bars(report: CostReport, width: int = 64) -> list[Text]:
    """A text Gantt chart of both schemes on one time scale."""
    rows = (
        ("colocated", "worker", report.colocated, "worker"),
        ("disaggregated", "P", report.disaggregated, "P"),
        ("", "link", report.disaggregated, "link"),
        ("", "D", report.disaggregated, "D"),
    )
    t_max = max(report.colocated.token_ms[-1], report.disaggregated.token_ms[-1]) or 1.0
    scale = width / t_max

    def col(t: float) -> int:
        return min(width - 1, round(t * scale))

    lines: list[Text] = []
    for title, lane, tl, lane_key in rows:
        cells: list[tuple[str, str]] = [(" ", "")] * width
        step = 0
        for span in tl.spans:
            if span.lane != lane_key or span.duration_ms <= 0:
                continue
            a = col(span.start_ms)
            b = max(a + 1, min(width, round(span.end_ms * scale)))
            glyph = _GLYPHS[span.kind]
            if span.kind == "decode":  # alternate case so each step shows
                glyph = "D" if step % 2 == 0 else "d"
                step += 1
            for i in range(a, b):
                cells[i] = (glyph, _STYLES[span.kind])
        text = Text(f"{title:>13} {lane:>6} │")
        for glyph, style in cells:
            text.append(glyph, style=style)
        lines.append(text)
        # Token markers under the lane that emits them.
        marks = [" "] * (width + 1)
        for i, t in enumerate(tl.token_ms):
            emitting = "worker" if tl.scheme == "colocated" else ("P" if i == 0 else "D")
            if emitting == lane_key:
                c = min(width, round(t * scale))
                if marks[c] == " ":
                    marks[c] = str(i + 1) if i < 9 else "+"
        if any(m != " " for m in marks):
            lines.append(Text(f"{'':>13} {'tokens':>6}  " + "".join(marks).rstrip(), style="bold"))
    axis = f"{'':>13} {'ms':>6} └" + "─" * width
    lines.append(Text(axis))
    lines.append(Text(f"{'':>13} {'':>6}  0{_ms(t_max):>{width}}"))
    return lines


def _timeline_table(report: CostReport) -> Table:
    co, dis = report.colocated, report.disaggregated
    table = Table(title="One request, side by side (ms since arrival)", title_justify="left")
    table.add_column("event")
    table.add_column("colocated", justify="right")
    table.add_column("disaggregated", justify="right")
    t = report.model.timing
    table.add_row("extra wait J", f"0 → {_ms(t.wait_ms)}", "—")
    table.add_row("prefill", f"{_ms(t.wait_ms)} → {_ms(co.ttft_ms)}", f"0 → {_ms(dis.ttft_ms)}")
    table.add_row("token 1 (TTFT)", _ms(co.ttft_ms), _ms(dis.ttft_ms))
    table.add_row("handoff coordination", "—", f"{_ms(dis.handoff_start_ms)} → {_ms(dis.transfer_start_ms)}")
    table.add_row(
        "KV transfer start → finish", "—", f"{_ms(dis.transfer_start_ms)} → {_ms(dis.transfer_end_ms)}"
    )
    for i in range(1, len(co.token_ms)):
        table.add_row(f"token {i + 1}", _ms(co.token_ms[i]), _ms(dis.token_ms[i]))
    table.add_row("first generated gap", _ms(co.first_gap_ms), _ms(dis.first_gap_ms), style="bold")
    return table


def _report(console: Console, label: str, report: CostReport) -> None:
    m = report.model
    console.print(Text(f"KV handoff cost — {label}", style="bold"))
    console.print(f"  shape: {_describe_shape(m.shape)}")
    console.print(f"  tokens: {m.tokens:,}")

    sizes = Table(title="Size", title_justify="left", show_header=False)
    sizes.add_column()
    sizes.add_column(justify="right")
    sizes.add_row("per token", _size(m.shape.bytes_per_token))
    sizes.add_row("full KV (one copy)", _size(report.kv_bytes))
    if m.tp > 1:
        per_rank = m.shape.heads_per_rank(m.tp)
        replicas = m.shape.replicas(m.tp)
        what = "whole latent" if m.shape.is_mla else f"{per_rank} head(s)"
        note = f", {replicas}× replicated" if replicas > 1 else ""
        sizes.add_row(f"per rank (TP {m.tp}, {what}{note})", _size(m.rank_bytes))
        sizes.add_row(f"sent by all {m.tp} ranks", _size(m.rank_bytes * m.tp))
        sizes.add_row(f"on the busiest of {min(m.links, m.tp)} link(s)", _size(m.critical_bytes))
    console.print(sizes)

    bound = Table(title="Transfer lower bound", title_justify="left", show_header=False)
    bound.add_column()
    bound.add_column(justify="right")
    bound.add_row("bandwidth per link", f"{_ms(m.link.bandwidth_gibps)} GiB/s")
    bound.add_row("latency", f"{_ms(m.link.latency_ms)} ms")
    bound.add_row("transfer = latency + bytes / bandwidth", f"{_ms(report.transfer_ms)} ms")
    bound.add_row("+ coordination = handoff", f"{_ms(m.handoff_ms)} ms")
    console.print(bound)
    if m.tp > 1 and m.links < m.tp:
        console.print(
            f"  note: {m.tp} ranks share {m.links} link(s); splitting over ranks shortens\n"
            "  the critical path only with one independent link per rank (--links)."
        )

    console.print(_timeline_table(report))
    for line in _bars(report, width=max(24, min(72, console.width - 24))):
        console.print(line, soft_wrap=True)
    legend = Text("  ")
    for kind, glyph in _GLYPHS.items():
        legend.append(glyph if kind != "decode" else "D/d", style=_STYLES[kind])
        legend.append(f" {kind} ")
    legend.append(" 1-9 tokens")
    console.print(legend)

    saving = report.second_token_saving_ms
    j = m.timing.wait_ms
    if saving > 0:
        verdict = f"disaggregation's second token is {_ms(saving)} ms earlier"
    elif saving < 0:
        verdict = f"colocation's second token is {_ms(-saving)} ms earlier"
    else:
        verdict = "both second tokens come at the same time"
    console.print(Text("Break-even", style="bold"))
    console.print(
        f"  second tokens equal at colocated wait J = {_ms(report.break_even_wait_ms)} ms "
        "(coordination + transfer)"
    )
    console.print(f"  at J = {_ms(j)} ms {verdict}")
    bw = report.break_even_bandwidth_gibps
    if bw is None:
        console.print(
            f"  no bandwidth makes disaggregation break even at J = {_ms(j)} ms: "
            "coordination + latency alone exceed it"
        )
    else:
        console.print(f"  at J = {_ms(j)} ms disaggregation stops losing from {_ms(bw)} GiB/s/link")
    console.print(
        "  A lower bound: no compression, protocol overhead, queueing, layout\n"
        "  conversion or contention.  TTFT alone hides the first gap.",
        style="dim",
    )


def _to_json(label: str, report: CostReport, plot: str | None) -> str:
    data = {"preset": label, **report.to_dict()}
    if plot is not None:
        data["plot"] = plot
    return json.dumps(data, indent=2, ensure_ascii=False)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``pdproto cost``; 0 on success (bad values raise UsageError -> exit 2)."""
    label, report = _build(args)
    if args.plot is not None:
        from ..cost import write_plot

        try:
            write_plot(report, args.plot)
        except OSError as exc:
            raise UsageError("--plot", args.plot, f"a writable file path ({exc.strerror or exc})") from None
    if args.json:
        print(_to_json(label, report, args.plot), file=console.file)
        return 0
    _report(console, label, report)
    if args.plot is not None:
        console.print(f"wrote {esc(args.plot)}")
    return 0
