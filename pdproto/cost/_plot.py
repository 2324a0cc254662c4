"""Draw a :class:`~pdproto._cost.CostReport` as a timeline picture.

Both schemes share one time axis: the colocated request on one worker lane
(wait J, prefill, decode steps) above the disaggregated one on three lanes
(P: prefill; link: coordination and transfer; D: decode steps), with every
emitted token marked and numbered.  ``.svg`` is written by hand and needs
nothing; ``.png`` needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import math
import pathlib
from xml.sax.saxutils import escape

from .._errors import UsageError
from ._model import CostReport, Timeline, format_bytes

__all__ = ["timeline_svg", "write_plot"]

#: Fill colour of each span kind.
COLOURS = {
    "wait": "#bdbdbd",
    "prefill": "#4c78a8",
    "coordination": "#f58518",
    "transfer": "#e45756",
    "decode": "#54a24b",
}
_LABELS = {
    "wait": "wait J",
    "prefill": "prefill",
    "coordination": "coord",
    "transfer": "KV transfer",
    "decode": "decode step",
}
# (scheme, lane) rows top to bottom, with their titles.
_ROWS = (
    ("colocated", "worker", "worker (P+D)"),
    ("disaggregated", "P", "P worker"),
    ("disaggregated", "link", "P→D link"),
    ("disaggregated", "D", "D worker"),
)


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if mult * mag >= raw:
            return mult * mag
    return 10 * mag  # pragma: no cover


def _fmt_ms(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _subtitle(report: CostReport) -> str:
    m = report.model
    t = m.timing
    parts = [
        f"KV {format_bytes(report.kv_bytes)} ({m.tokens} tokens)",
        f"{_fmt_ms(m.link.bandwidth_gibps)} GiB/s",
    ]
    if m.link.latency_ms:
        parts.append(f"latency {_fmt_ms(m.link.latency_ms)} ms")
    if m.tp > 1:
        parts.append(f"TP {m.tp} over {min(m.links, m.tp)} link(s)")
    parts += [
        f"P {_fmt_ms(t.prefill_ms)} ms",
        f"D {_fmt_ms(t.decode_ms)} ms/step",
        f"coord {_fmt_ms(t.coord_ms)} ms",
        f"J {_fmt_ms(t.wait_ms)} ms",
    ]
    return " · ".join(parts)


def _tokens_by_lane(tl: Timeline) -> list[tuple[str, int, float]]:
    """(lane, token number, time) for each emitted token of a timeline."""
    first_lane = "worker" if tl.scheme == "colocated" else "P"
    rest_lane = "worker" if tl.scheme == "colocated" else "D"
    return [(first_lane if i == 0 else rest_lane, i + 1, t) for i, t in enumerate(tl.token_ms)]


def timeline_svg(report: CostReport) -> str:
    """The timeline picture as an SVG document (a string)."""
    width, left, right = 1040, 150, 130
    lane_h, lane_gap, section_gap = 34, 42, 64
    top = 104
    timelines = {"colocated": report.colocated, "disaggregated": report.disaggregated}
    t_end = max(tl.token_ms[-1] for tl in timelines.values())
    step = _nice_step(t_end)
    t_max = math.ceil(t_end * 1.04 / step) * step
    plot_w = width - left - right

    def x(t: float) -> float:
        return left + plot_w * t / t_max

    out: list[str] = []
    add = out.append
    # Row geometry.
    y_of: dict[tuple[str, str], float] = {}
    y = top
    previous = None
    for scheme, lane, _title in _ROWS:
        if previous is not None:
            y += section_gap if scheme != previous else lane_gap
        y_of[(scheme, lane)] = y
        y += lane_h
        previous = scheme
    axis_y = y + 56
    height = int(axis_y + 100)

    add(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'
    )
    add(f'<rect width="{width}" height="{height}" fill="white"/>')
    add(
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#d9d9d9"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#9e9e9e" stroke-width="2"/></pattern></defs>'
    )
    add(
        f'<text x="{left}" y="28" font-size="18" font-weight="bold">'
        "One request, colocated vs disaggregated (byte lower bound)</text>"
    )
    add(f'<text x="{left}" y="50" font-size="12" fill="#444">{escape(_subtitle(report))}</text>')

    # Grid and axis.
    ticks = round(t_max / step)
    for i in range(ticks + 1):
        t = i * step
        add(f'<line x1="{x(t):.1f}" y1="{top - 22}" x2="{x(t):.1f}" y2="{axis_y}" stroke="#eeeeee"/>')
        add(f'<line x1="{x(t):.1f}" y1="{axis_y}" x2="{x(t):.1f}" y2="{axis_y + 5}" stroke="#333"/>')
        add(f'<text x="{x(t):.1f}" y="{axis_y + 18}" font-size="11" text-anchor="middle">{_fmt_ms(t)}</text>')
    add(f'<line x1="{left}" y1="{axis_y}" x2="{width - right}" y2="{axis_y}" stroke="#333"/>')
    add(
        f'<text x="{left + plot_w / 2}" y="{axis_y + 36}" font-size="12" text-anchor="middle">time '
        "since arrival (ms)</text>"
    )

    # Section titles and lane labels.
    for scheme, tl in timelines.items():
        first = min(y_of[(s, lane)] for s, lane, _ in _ROWS if s == scheme)
        label = (
            f"{scheme}: TTFT {_fmt_ms(tl.ttft_ms)} ms, 2nd token {_fmt_ms(tl.second_token_ms)} ms, "
            f"first gap {_fmt_ms(tl.first_gap_ms)} ms"
        )
        add(f'<text x="12" y="{first - 30}" font-size="13" font-weight="bold">{escape(label)}</text>')
    for scheme, lane, title in _ROWS:
        yy = y_of[(scheme, lane)]
        add(
            f'<text x="{left - 10}" y="{yy + lane_h / 2 + 4}" font-size="12" '
            f'text-anchor="end">{escape(title)}</text>'
        )
        add(
            f'<line x1="{left}" y1="{yy + lane_h}" x2="{width - right}" y2="{yy + lane_h}" stroke="#cccccc"/>'
        )

    # Spans.
    for scheme, tl in timelines.items():
        for span in tl.spans:
            if span.duration_ms <= 0:
                continue
            yy = y_of[(scheme, span.lane)]
            x0, x1 = x(span.start_ms), x(span.end_ms)
            fill = "url(#hatch)" if span.kind == "wait" else COLOURS[span.kind]
            add(
                f'<rect x="{x0:.1f}" y="{yy}" width="{x1 - x0:.1f}" height="{lane_h}" fill="{fill}" '
                f'stroke="white" stroke-width="1"><title>{span.kind} {_fmt_ms(span.start_ms)}–'
                f"{_fmt_ms(span.end_ms)} ms</title></rect>"
            )
            if span.kind == "decode":
                continue
            text = f"{_LABELS[span.kind]} {_fmt_ms(span.duration_ms)} ms"
            if span.kind == "transfer":
                text += f" ({_fmt_ms(span.start_ms)}–{_fmt_ms(span.end_ms)})"
            colour = "#222" if span.kind == "wait" else "white"
            if x1 - x0 >= 6.4 * len(text) + 6:
                add(
                    f'<text x="{(x0 + x1) / 2:.1f}" y="{yy + lane_h / 2 + 4}" font-size="12" '
                    f'text-anchor="middle" fill="{colour}">{escape(text)}</text>'
                )
            else:  # too narrow: label below the lane, reaching away from its neighbour
                below = yy + lane_h + (13 if span.lane == "link" else 26)
                if span.kind in ("wait", "coordination"):
                    xt, anchor = x1 - 3, "end"
                else:
                    xt, anchor = x0 + 3, "start"
                add(
                    f'<text x="{xt:.1f}" y="{below}" font-size="11" '
                    f'text-anchor="{anchor}" fill="#222">{escape(text)}</text>'
                )
        # Decode steps: one label over the whole run.
        steps = [s for s in tl.spans if s.kind == "decode" and s.duration_ms > 0]
        if steps:
            lane = steps[0].lane
            yy = y_of[(scheme, lane)]
            x0, x1 = x(steps[0].start_ms), x(steps[-1].end_ms)
            add(
                f'<text x="{x1 + 4:.1f}" y="{yy + lane_h / 2 + 4}" font-size="11" fill="#2e6b2a">'
                f"decode {_fmt_ms(steps[0].duration_ms)} ms/step</text>"
            )
        # Tokens: numbered markers on the top edge, their times below the lane.
        last_label_x: dict[str, float] = {}
        for lane, number, t in _tokens_by_lane(tl):
            yy = y_of[(scheme, lane)]
            xt = x(t)
            add(
                f'<line x1="{xt:.1f}" y1="{yy - 4}" x2="{xt:.1f}" y2="{yy + lane_h}" stroke="#111" '
                'stroke-width="1.5"/>'
            )
            add(f'<circle cx="{xt:.1f}" cy="{yy - 11}" r="8" fill="#111"/>')
            add(
                f'<text x="{xt:.1f}" y="{yy - 7}" font-size="10" fill="white" '
                f'text-anchor="middle">{number}</text>'
            )
            if number == 1:
                add(
                    f'<text x="{xt - 12:.1f}" y="{yy - 7}" font-size="11" fill="#111" '
                    'text-anchor="end">token 1 (TTFT)</text>'
                )
            if xt - last_label_x.get(lane, -1e9) >= 26:
                last_label_x[lane] = xt
                add(
                    f'<text x="{xt:.1f}" y="{yy + lane_h + 13}" font-size="10" fill="#111" '
                    f'text-anchor="middle">{_fmt_ms(t)}</text>'
                )
    # First-gap bracket on the disaggregated scheme.
    dis = report.disaggregated
    yb = y_of[("disaggregated", "D")] + lane_h + 30
    xa, xb = x(dis.token_ms[0]), x(dis.token_ms[1])
    add(
        f'<path d="M{xa:.1f},{yb - 5} V{yb} H{xb:.1f} V{yb - 5}" fill="none" stroke="#7b3294" '
        'stroke-width="1.5"/>'
    )
    add(
        f'<text x="{(xa + xb) / 2:.1f}" y="{yb + 14}" font-size="11" fill="#7b3294" text-anchor="middle">'
        f"first gap {_fmt_ms(dis.first_gap_ms)} ms</text>"
    )

    # Legend.
    lx, ly = left, axis_y + 58
    for kind in ("wait", "prefill", "coordination", "transfer", "decode"):
        fill = "url(#hatch)" if kind == "wait" else COLOURS[kind]
        add(f'<rect x="{lx}" y="{ly}" width="14" height="14" fill="{fill}"/>')
        add(f'<text x="{lx + 20}" y="{ly + 11}" font-size="12">{escape(_LABELS[kind])}</text>')
        lx += 40 + 7 * len(_LABELS[kind])
    add(f'<circle cx="{lx + 7}" cy="{ly + 7}" r="7" fill="#111"/>')
    add(f'<text x="{lx + 20}" y="{ly + 11}" font-size="12">token emitted (number)</text>')
    be = report.break_even_wait_ms
    saving = report.second_token_saving_ms
    verdict = (
        f"saves {_fmt_ms(saving)} ms"
        if saving > 0
        else f"loses {_fmt_ms(-saving)} ms"
        if saving < 0
        else "breaks even"
    )
    add(
        f'<text x="{left}" y="{ly + 34}" font-size="12" fill="#444">break-even J = {_fmt_ms(be)} ms '
        f"(coordination + transfer); at J = {_fmt_ms(report.model.timing.wait_ms)} ms disaggregation "
        f"{verdict} on the second token</text>"
    )
    add("</svg>")
    return "\n".join(out) + "\n"


def _write_png(report: CostReport, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UsageError(
            "--plot", str(path), "a .svg file, or install matplotlib for .png: pip install 'pdproto[plot]'"
        ) from None
    rows = [(s, lane) for s, lane, _ in _ROWS]
    ypos = {row: len(rows) - i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(11, 5.2), dpi=120)
    timelines = {"colocated": report.colocated, "disaggregated": report.disaggregated}
    t_end = max(tl.token_ms[-1] for tl in timelines.values())
    for scheme, tl in timelines.items():
        for span in tl.spans:
            if span.duration_ms <= 0:
                continue
            yy = ypos[(scheme, span.lane)]
            ax.barh(
                yy,
                span.duration_ms,
                left=span.start_ms,
                height=0.6,
                color=COLOURS[span.kind],
                edgecolor="white",
                hatch="//" if span.kind == "wait" else None,
            )
            if span.kind != "decode":
                label = f"{_LABELS[span.kind]}\n{_fmt_ms(span.duration_ms)} ms"
                middle = span.start_ms + span.duration_ms / 2
                if span.duration_ms >= 0.08 * t_end:
                    ax.text(
                        middle,
                        yy,
                        label,
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="black" if span.kind == "wait" else "white",
                    )
                else:  # too narrow: label below the bar
                    ax.text(middle, yy - 0.36, label.replace("\n", " "), ha="center", va="top", fontsize=8)
        for lane, number, t in _tokens_by_lane(tl):
            yy = ypos[(scheme, lane)]
            ax.plot([t], [yy + 0.42], marker="v", color="black", markersize=7)
            ax.text(t, yy + 0.55, str(number), ha="center", fontsize=8, fontweight="bold")
            if number == 1:
                ax.text(t - 0.6, yy + 0.55, "token 1 (TTFT) ", ha="right", fontsize=8)
            ax.text(t, yy - 0.33, _fmt_ms(t), ha="center", va="top", fontsize=7)
    dis = report.disaggregated
    y_gap = ypos[("disaggregated", "D")] - 0.62
    ax.annotate(
        "",
        xy=(dis.token_ms[0], y_gap),
        xytext=(dis.token_ms[1], y_gap),
        arrowprops={"arrowstyle": "<->", "color": "#7b3294"},
    )
    ax.text(
        (dis.token_ms[0] + dis.token_ms[1]) / 2,
        y_gap - 0.05,
        f"first gap {_fmt_ms(dis.first_gap_ms)} ms",
        ha="center",
        va="top",
        fontsize=8,
        color="#7b3294",
    )
    ax.set_yticks([ypos[r] for r in rows])
    ax.set_yticklabels([f"{s}\n{title}" for s, _lane, title in _ROWS], fontsize=9)
    ax.set_xlabel("time since arrival (ms); numbered markers: tokens emitted")
    ax.set_ylim(0.1, len(rows) + 0.9)
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    ax.set_title(
        "One request, colocated vs disaggregated (byte lower bound)\n" + _subtitle(report), fontsize=10
    )
    handles = [Patch(color=COLOURS[k], label=_LABELS[k]) for k in COLOURS]
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=5, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def write_plot(report: CostReport, path: str | pathlib.Path) -> pathlib.Path:
    """Write the timeline picture to ``path``; the suffix picks the format.

    Args:
        report: what to draw.
        path: a ``.svg`` file (no dependency) or ``.png`` (needs matplotlib).

    Returns:
        The path written.

    Raises:
        UsageError: another suffix, or ``.png`` without matplotlib; nothing
            is written then.
    """
    target = pathlib.Path(path)
    suffix = target.suffix.lower()
    if suffix == ".svg":
        target.write_text(timeline_svg(report), encoding="utf-8")
    elif suffix == ".png":
        _write_png(report, target)
    else:
        raise UsageError("--plot", str(path), "a file name ending in .svg or .png")
    return target
