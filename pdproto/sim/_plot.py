"""Pictures of simulated runs (matplotlib, the ``plot`` extra, imported lazily).

* :func:`plot_cdfs`: TTFT and ITL CDFs, one line per arm (optionally the
  SLO bounds as dashed lines);
* :func:`plot_goodput_vs_rate`: goodput (per device by default) against the
  arrival rate, one line per arm, with the attainment target's rate marked;
* :func:`plot_goodput_vs_ratio`: per-device goodput of each P:D split, with
  the colocated and chunked arms as reference lines;
* :func:`plot_occupancy`: queue length, KV occupancy and busy share of each
  pool over simulated time, from the engine's samples;
* :func:`plot_timeline`: the seed's two-request timeline: each request on a
  lane, its wait for the first token, every token marked, TTFT and the first
  generated gap labelled.

Each writes one file; the suffix (``.png``, ``.svg``, ``.pdf``) picks the
format, and the path written is returned.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import MissingExtraError, UsageError
from ._metrics import SLO, Metrics, RequestRecord

__all__ = [
    "plot_cdfs",
    "plot_goodput_vs_rate",
    "plot_goodput_vs_ratio",
    "plot_occupancy",
    "plot_timeline",
]

SUFFIXES = (".png", ".svg", ".pdf")
#: One colour per arm, in order of appearance (matplotlib's tab10 subset).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")


def _begin(path: str | pathlib.Path, items: object, what: str, allowed: str) -> tuple[pathlib.Path, Any]:
    """The target path and pyplot, after checking that ``items`` (the ``what`` to draw) is not empty."""
    if not items:
        raise UsageError(what, items, allowed)
    target = pathlib.Path(path)
    return target, _pyplot(target)


def _pyplot(path: pathlib.Path) -> Any:
    if path.suffix.lower() not in SUFFIXES:
        raise UsageError("--plot", str(path), f"a file name ending in {', '.join(SUFFIXES)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("plotting a simulation", "matplotlib", "plot") from None
    return plt


def _save(plt: Any, fig: Any, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def plot_cdfs(
    arms: Mapping[str, Metrics],
    path: str | pathlib.Path,
    *,
    metrics: Sequence[str] = ("ttft", "itl"),
    slo: SLO | None = None,
) -> pathlib.Path:
    """CDFs of ``metrics`` (``ttft``, ``itl``, ``tpot``, ``e2e``, ``first_gap``), one panel each.

    TTFT, TPOT, E2E and the first gap are per completed request; ITL pools
    every gap of every request, as vLLM does.  ``slo`` draws its bounds.

    Raises:
        UsageError: no arm, an unknown metric, a bad suffix.
        MissingExtraError: matplotlib is not installed.
    """
    allowed = ("ttft", "itl", "tpot", "e2e", "first_gap")
    for name in metrics:
        if name not in allowed:
            raise UsageError("metric", name, f"one of {', '.join(allowed)}")
    target, plt = _begin(path, arms, "arms", "at least one arm's Metrics")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4.0), dpi=110, squeeze=False)
    for ax, name in zip(axes[0], metrics):
        for i, (arm, m) in enumerate(arms.items()):
            if name == "itl":
                xs, ys = m.itl_cdf()
            else:
                xs = m.values(name)
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
            if xs:
                ax.step([x * 1000 for x in xs], ys, where="post", color=_colour(i), label=arm)
        bound = getattr(slo, name) if slo is not None else None
        if bound is not None:
            ax.axvline(
                bound * 1000, color="#666", linestyle="--", linewidth=1, label=f"SLO {bound * 1000:g} ms"
            )
        lows = [ln.get_xdata()[0] for ln in ax.get_lines() if len(ln.get_xdata()) and ln.get_xdata()[0] > 0]
        highs = [ln.get_xdata()[-1] for ln in ax.get_lines() if len(ln.get_xdata())]
        wide = bool(lows and highs and max(highs) > 20 * min(lows))
        if wide:
            ax.set_xscale("log")
        ax.set_xlabel(
            f"{name.upper() if name != 'first_gap' else 'first gap'} (ms{', log scale' if wide else ''})"
        )
        ax.set_ylabel("share of " + ("gaps" if name == "itl" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(color="#eeeeee")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Latency CDFs per arm", fontsize=11)
    return _save(plt, fig, target)


def plot_goodput_vs_rate(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | pathlib.Path,
    *,
    ylabel: str = "goodput per device (req/s)",
    best: Mapping[str, float] | None = None,
) -> pathlib.Path:
    """One line per arm through its (rate, goodput) points; ``best`` marks
    each arm's highest rate meeting the attainment target.

    Raises:
        UsageError: no curve, a bad suffix.
        MissingExtraError: matplotlib is not installed.
    """
    target, plt = _begin(path, curves, "curves", "at least one arm's (rate, goodput) points")
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for i, (arm, points) in enumerate(curves.items()):
        pts = sorted(points)
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=_colour(i), label=arm
        )
        if best and arm in best:
            ax.axvline(best[arm], color=_colour(i), linestyle=":", linewidth=1)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(color="#eeeeee")
    ax.legend(fontsize=8)
    ax.set_title("Goodput against rate", fontsize=11)
    return _save(plt, fig, target)


def plot_goodput_vs_ratio(
    points: Sequence[tuple[str, float]],
    path: str | pathlib.Path,
    *,
    ylabel: str = "max rate per device at the target (req/s)",
    baseline: tuple[str, float] | None = None,
    baselines: Sequence[tuple[str, float]] = (),
) -> pathlib.Path:
    """A bar per P:D split (label such as ``"2P1D"``, per-device goodput);
    each of ``baselines`` (label, value), and ``baseline``, draws a dashed
    reference line: the colocated and chunked prefill arms on the same budget.

    Raises:
        UsageError: no point, a bad suffix.
        MissingExtraError: matplotlib is not installed.
    """
    target, plt = _begin(path, points, "points", "at least one (label, goodput) pair")
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(points) + 2), 4.0), dpi=110)
    labels = [p[0] for p in points]
    values = [p[1] for p in points]
    top = max(values)
    bars = ax.bar(range(len(points)), values, color=[_colour(2) if v == top else _colour(0) for v in values])
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels(labels)
    refs = ([baseline] if baseline is not None else []) + list(baselines)
    for i, (label, value) in enumerate(refs):
        ax.axhline(value, color=_colour(1 + 2 * i), linestyle="--", linewidth=1, label=label)
    if refs:
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("P:D split")
    ax.grid(axis="y", color="#eeeeee")
    ax.set_title("Goodput against the P:D ratio", fontsize=11)
    return _save(plt, fig, target)


def plot_occupancy(
    samples: Sequence[tuple[float, str, float, float, float]],
    path: str | pathlib.Path,
) -> pathlib.Path:
    """Queue length, KV occupancy (share of blocks) and busy share of each
    pool over time, from samples ``(t, pool, queue, kv_share, busy_share)``
    (what the engine records with ``sample_dt``).

    Raises:
        UsageError: no sample, a bad suffix.
        MissingExtraError: matplotlib is not installed.
    """
    target, plt = _begin(path, samples, "samples", "pool samples (run the simulation with sample_dt)")
    pools: dict[str, list[tuple[float, float, float, float]]] = {}
    for t, pool, q, kv, busy in samples:
        pools.setdefault(pool, []).append((t, q, kv, busy))
    fig, axes = plt.subplots(3, 1, figsize=(8.0, 6.4), dpi=110, sharex=True)
    titles = ("queue (requests)", "KV occupancy (share)", "busy (share of instances)")
    for i, (pool, rows) in enumerate(pools.items()):
        ts = [r[0] for r in rows]
        for k, ax in enumerate(axes):
            ax.step(ts, [r[k + 1] for r in rows], where="post", color=_colour(i), label=pool)
    for ax, title in zip(axes, titles):
        ax.set_ylabel(title, fontsize=9)
        ax.grid(color="#eeeeee")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8, loc="upper left")
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle("Pool occupancy over time", fontsize=11)
    return _save(plt, fig, target)


def plot_timeline(
    records: Sequence[RequestRecord],
    path: str | pathlib.Path,
    *,
    title: str | None = None,
    first_tokens: int = 8,
) -> pathlib.Path:
    """The seed's two-request timeline: one lane per record (any number, two
    in the seed), time in ms from the first arrival, up to each request's
    ``first_tokens``-th token (the handoff and its first gaps; the rest of a
    long decode would only crowd the picture).  Each lane shows the wait from
    arrival to the first token (its prefill darker, where the record has
    ``prefill_start``), a numbered marker per token, the KV transfer of a PD
    record (``transfer_start`` to ``transfer_end``, hatched above the lane),
    and labels TTFT, the transfer's time and the first generated gap.

    Raises:
        UsageError: no record, ``first_tokens`` < 2, a bad suffix.
        MissingExtraError: matplotlib is not installed.
    """
    if type(first_tokens) is not int or first_tokens < 2:
        raise UsageError("first_tokens", first_tokens, "an integer >= 2")
    target, plt = _begin(path, records, "records", "at least one RequestRecord")
    t0 = min(r.arrival for r in records)
    fig, ax = plt.subplots(figsize=(9.0, 1.3 + 1.2 * len(records)), dpi=110)
    ms = lambda t: (t - t0) * 1000  # noqa: E731
    right = 0.0
    for lane, r in enumerate(records):
        y = len(records) - lane
        colour = _colour(lane)
        tokens = r.token_times[:first_tokens]
        end = tokens[-1] if tokens else (r.finish or r.arrival)
        right = max(right, ms(end))
        first = r.first_token
        if first is not None:
            ax.barh(
                y,
                ms(first) - ms(r.arrival),
                left=ms(r.arrival),
                height=0.3,
                color="#bdbdbd",
                edgecolor="white",
            )
            ax.text(
                ms(first),
                y + 0.2,
                f" TTFT {ms(first) - ms(r.arrival):.1f} ms",
                ha="right",
                va="bottom",
                fontsize=8,
            )
            ax.barh(y, ms(end) - ms(first), left=ms(first), height=0.1, color=colour)
        if r.prefill_start is not None and first is not None:  # the prefill inside the wait
            ax.barh(
                y,
                ms(first) - ms(r.prefill_start),
                left=ms(r.prefill_start),
                height=0.3,
                color="#737373",
                edgecolor="white",
            )
            ax.text(
                (ms(r.prefill_start) + ms(first)) / 2,
                y,
                "prefill",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
        if r.transfer_start is not None and r.transfer_end is not None:  # PD: the KV handoff
            ax.barh(
                y + 0.22,
                ms(r.transfer_end) - ms(r.transfer_start),
                left=ms(r.transfer_start),
                height=0.12,
                color="#fdb863",
                edgecolor="#e66101",
                hatch="///",
            )
            ax.text(
                ms(r.transfer_end),
                y + 0.22,
                f" KV transfer {ms(r.transfer_end) - ms(r.transfer_start):.1f} ms",
                ha="left",
                va="center",
                fontsize=7,
                color="#e66101",
            )
            right = max(right, ms(r.transfer_end))
        for k, t in enumerate(tokens):
            ax.plot([ms(t)], [y], marker="o", color="black", markersize=4)
            ax.text(ms(t), y - 0.16, str(k + 1), ha="center", va="top", fontsize=7)
        if len(tokens) >= 2:
            a, b = tokens[0], tokens[1]
            ax.annotate(
                "",
                xy=(ms(a), y - 0.34),
                xytext=(ms(b), y - 0.34),
                arrowprops={"arrowstyle": "<->", "color": "#7b3294"},
            )
            ax.text(
                (ms(a) + ms(b)) / 2,
                y - 0.38,
                f"first gap {(b - a) * 1000:.1f} ms",
                ha="center",
                va="top",
                fontsize=8,
                color="#7b3294",
            )
        ax.plot([ms(r.arrival)], [y], marker="|", color="black", markersize=14)
        status = "rejected" if r.rejected else "cancelled" if r.cancelled else "failed" if r.failed else ""
        more = len(r.token_times) - len(tokens)
        label = (
            f"{r.arm} {r.id}" + (f" ({status})" if status else "") + (f", {more} more tokens" if more else "")
        )
        ax.text(ms(r.arrival), y + 0.42, label, fontsize=8, ha="left")
    ax.set_yticks([])
    ax.set_ylim(0.4, len(records) + 0.75)
    ax.set_xlim(-0.02 * max(right, 1e-9), 1.05 * max(right, 1e-9))
    ax.set_xlabel("time since the first arrival (ms); dots: tokens, | : arrival")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_title(title or "Requests on a shared timeline", fontsize=11)
    return _save(plt, fig, target)
