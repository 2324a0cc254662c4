"""The P:D picker (``pdproto simulate --sweep``) and the seed's section 06 signals.

:func:`max_rate` finds, DistServe's way, the highest arrival rate at which a
configuration still meets the SLO attainment target: simulate ``n`` requests
at a rate, read the attainment (good / (requests - client cancels), rejected
and failed requests never good), and bisect the rate.  Per-device goodput is
that rate divided by the devices the configuration occupies (DistServe's
per-GPU goodput), so adding devices never shows as a per-device speed-up.
A probe runs at least ``span`` simulated seconds of arrivals (more requests
at higher rates), so that a short burst is not mistaken for a sustainable
rate.

:func:`sweep` does it for every split of a fixed device budget: each N_P:N_D
with TP per role from ``tps``, plus the colocated and chunked arms on the
same devices.  :func:`cheapest` finds the smallest budget whose best
configuration meets the target at a given rate.

:func:`signals` reads one run's pools against the seed's section 06 table:
P queue growing while D idles, D KV full while P still accepts, transfer
queueing growing, the pools taking turns idling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from .._errors import UsageError
from ._engine import SimConfig, SimResult, simulate
from ._metrics import SLO, Metrics
from ._workload import WorkloadSpec, make_workload

__all__ = [
    "RatePoint",
    "SweepRow",
    "run_once",
    "max_rate",
    "splits",
    "sweep",
    "cheapest",
    "signals",
    "SIGNALS",
]


@attrs.frozen
class RatePoint:
    """One simulated rate: its attainment and goodput."""

    rate: float
    attainment: float
    goodput: float
    violation: dict | None = None


@attrs.frozen
class SweepRow:
    """One configuration of a sweep: the highest rate meeting the target."""

    config: SimConfig
    max_rate: float  # requests/s meeting the attainment target (0: not even the lowest rate)
    goodput: float  # good requests/s at that rate
    devices: int
    probes: tuple[RatePoint, ...] = ()
    #: the section 06 signals (:func:`signals`) of the probe at ``max_rate``
    #: (empty for the colocated arms, or when no rate met the target)
    signals: tuple[dict[str, Any], ...] = ()

    @property
    def per_device(self) -> float:
        """The highest rate meeting the target per device (DistServe's per-GPU goodput)."""
        return self.max_rate / self.devices if self.devices else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label(),
            "arm": self.config.arm,
            "n_p": self.config.n_p if self.config.arm == "pd" else None,
            "n_d": self.config.n_d if self.config.arm == "pd" else None,
            "tp_p": self.config.tp_p if self.config.arm == "pd" else None,
            "tp_d": self.config.tp_d if self.config.arm == "pd" else None,
            "tp": self.config.tp if self.config.arm != "pd" else None,
            "devices": self.devices,
            "weight_copies": self.config.weight_copies,
            "max_rate": self.max_rate,
            "goodput": self.goodput,
            "goodput_per_device": self.per_device,
            "probes": [attrs.asdict(p) for p in self.probes],
            "signals": list(self.signals),
        }


def run_once(
    spec: WorkloadSpec,
    config: SimConfig,
    rate: float | None,
    slo: SLO,
    *,
    n: int,
    seed: int = 0,
    monitor: bool = False,
    **kw: Any,
) -> tuple[RatePoint, Metrics, SimResult]:
    """Simulate ``n`` requests of ``spec`` (at ``rate`` when given) on ``config``."""
    if rate is not None:
        spec = spec.with_rate(rate)
    m = Metrics(config.label(), devices=config.used_devices, weight_copies=config.weight_copies)
    res = simulate(make_workload(spec, n, seed), config, metrics=m, monitor=monitor, **kw)
    s = m.summary(slo, duration=res.duration)
    point = RatePoint(
        rate if rate is not None else (spec.rate or 0.0), s["attainment"], s["goodput"], res.violation
    )
    return point, m, res


def max_rate(
    spec: WorkloadSpec,
    config: SimConfig,
    slo: SLO,
    *,
    target: float = 0.9,
    n: int = 400,
    seed: int = 0,
    start: float = 1.0,
    rel_tol: float = 0.05,
    max_probes: int = 14,
    monitor: bool = False,
    span: float = 20.0,
    table: Any = None,
) -> SweepRow:
    """The highest rate at which ``config`` meets ``target`` attainment, by
    doubling up (or halving down) from ``start`` and then bisecting to
    ``rel_tol``.  Each probe is a fresh run (same seed) of ``n`` requests, or
    of ``rate * span`` when that is more."""
    if not 0 < target <= 1:
        raise UsageError("target", target, "an attainment in (0, 1]")
    probes: list[RatePoint] = []
    diagnostics: dict[float, tuple[dict[str, Any], ...]] = {}

    def ok(rate: float) -> bool:
        p, _m, res = run_once(
            spec, config, rate, slo, n=max(n, int(rate * span)), seed=seed, monitor=monitor, table=table
        )
        probes.append(p)
        diagnostics[rate] = tuple(signals(res))
        return p.attainment >= target

    lo, hi = 0.0, start
    if ok(start):
        lo = start
        hi = start * 2
        while len(probes) < max_probes and ok(hi):
            lo, hi = hi, hi * 2
    else:
        while len(probes) < max_probes and hi > start / 1024:
            hi_new = hi / 2
            if ok(hi_new):
                lo = hi_new
                break
            hi = hi_new
    if lo > 0:
        while len(probes) < max_probes and (hi - lo) > rel_tol * lo:
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    good = max((p.goodput for p in probes if p.rate == lo), default=0.0)
    return SweepRow(config, lo, good, config.used_devices, tuple(probes), diagnostics.get(lo, ()))


def splits(
    budget: int,
    base: SimConfig,
    tps: Sequence[int] = (1,),
    *,
    arms: Iterable[str] = ("colocated", "chunked", "pd"),
) -> list[SimConfig]:
    """Every configuration on exactly ``budget`` devices: colocated and
    chunked with each tp dividing the budget, and PD with every N_P, N_D >= 1
    and tp per role from ``tps`` such that N_P*tp_P + N_D*tp_D == budget."""
    if type(budget) is not int or budget < 1:
        raise UsageError("budget", budget, "an integer >= 1")
    out: list[SimConfig] = []
    arms = tuple(arms)
    for arm in ("colocated", "chunked"):
        if arm in arms:
            for tp in tps:
                if budget % tp == 0:
                    out.append(attrs.evolve(base, arm=arm, devices=budget, tp=tp))
    if "pd" in arms:
        for tp_p in tps:
            for tp_d in tps:
                for n_p in range(1, budget // tp_p + 1):
                    rest = budget - n_p * tp_p
                    if rest >= tp_d and rest % tp_d == 0:
                        out.append(
                            attrs.evolve(
                                base,
                                arm="pd",
                                devices=budget,
                                n_p=n_p,
                                n_d=rest // tp_d,
                                tp_p=tp_p,
                                tp_d=tp_d,
                            )
                        )
    return out


def fit_error(config: SimConfig, table: Any = None) -> UsageError | None:
    """Why ``config``'s instances cannot be built (no room for KV beside the
    weights, say), or None when they can."""
    try:
        simulate((), config, monitor=False, table=table)
    except UsageError as exc:
        return exc
    return None


def sweep(
    spec: WorkloadSpec,
    base: SimConfig,
    budget: int,
    slo: SLO,
    *,
    tps: Sequence[int] = (1,),
    target: float = 0.9,
    n: int = 400,
    seed: int = 0,
    arms: Iterable[str] = ("colocated", "chunked", "pd"),
    progress: Callable[[SweepRow], None] | None = None,
    span: float = 20.0,
    table: Any = None,
) -> list[SweepRow]:
    """:func:`max_rate` of every configuration of :func:`splits`, best
    per-device goodput first.  Configurations whose weights do not fit are
    left out.  ``table`` (a :class:`~pdproto.sim._latency.PiecewiseLinear`)
    replaces the roofline for every instance, whatever its TP: give it with
    a single TP size in ``tps``."""
    rows = []
    start = spec.rate or 1.0
    for cfg in splits(budget, base, tps, arms=arms):
        if fit_error(cfg, table) is not None:
            continue
        row = max_rate(spec, cfg, slo, target=target, n=n, seed=seed, start=start, span=span, table=table)
        rows.append(row)
        if progress is not None:
            progress(row)
    rows.sort(key=lambda r: (-r.per_device, r.config.arm != "pd"))
    return rows


def cheapest(
    spec: WorkloadSpec,
    base: SimConfig,
    rate: float,
    slo: SLO,
    *,
    max_devices: int = 16,
    tps: Sequence[int] = (1,),
    target: float = 0.9,
    n: int = 400,
    seed: int = 0,
    arms: Iterable[str] = ("colocated", "chunked", "pd"),
    span: float = 20.0,
    table: Any = None,
) -> tuple[int, list[tuple[SimConfig, RatePoint]]]:
    """The smallest budget (1..``max_devices``) with a configuration meeting
    ``target`` at ``rate``; returns it (0 when none) and the configurations
    tried at that budget with their points.  ``table``: as in :func:`sweep`."""
    arms = tuple(arms)
    for budget in range(1, max_devices + 1):
        tried = []
        for cfg in splits(budget, base, tps, arms=arms):
            if fit_error(cfg, table) is not None:
                continue
            p, _m, _r = run_once(spec, cfg, rate, slo, n=max(n, int(rate * span)), seed=seed, table=table)
            tried.append((cfg, p))
        if any(p.attainment >= target for _c, p in tried):
            tried.sort(key=lambda cp: -cp[1].attainment)
            return budget, tried
    return 0, []


#: The seed's section 06 table: signal -> what to check.
SIGNALS = {
    "p-queue-growing-d-idle": "P queue grows for long while D idles: check P compute, chunking, replicas; "
    "don't just add D",
    "d-kv-full-p-accepting": "D's KV is full while P still accepts: tie admission to D capacity; check "
    "generation lengths and usable concurrency",
    "transfer-queueing-growing": "transfer queueing grows: check shared egress, concurrent migrations, "
    "source/target buffers, routing distance",
    "pools-take-turns-idling": "the two pools take turns idling: check the request-length distribution and "
    "the ratio; evaluate colocated or conditional disaggregation",
}


def _halves(values: list[float]) -> tuple[float, float]:
    h = len(values) // 2
    if h == 0:
        return 0.0, 0.0
    return sum(values[:h]) / h, sum(values[h:]) / (len(values) - h)


def signals(result: SimResult) -> list[dict[str, Any]]:
    """The section 06 signals of one PD run (empty for the colocated arms).

    Each entry: ``signal``, ``fired`` (bool), ``evidence`` (the numbers) and
    ``direction`` (the seed's advice).  Trends compare the first and second
    half of the run's pool samples (``simulate(..., sample_dt=...)``)."""
    if result.config.arm != "pd":
        return []
    pools = result.pools
    p, d = pools["prefill"], pools["decode"]
    samples = result.samples
    pq = [s[2] for s in samples if s[1] == "prefill"]
    pbusy = [s[4] for s in samples if s[1] == "prefill"]
    dkv = [s[3] for s in samples if s[1] == "decode"]
    dbusy = [s[4] for s in samples if s[1] == "decode"]
    q1, q2 = _halves(pq)
    out: list[dict[str, Any]] = []
    # P saturated with a standing queue (or a queue still growing at the end) while D idles
    grow = (p["utilisation"] >= 0.9 and p["mean_queue"] >= 2.0) or q2 > max(2.0, 1.5 * q1)
    out.append(
        {
            "signal": "p-queue-growing-d-idle",
            "fired": bool(grow and d["utilisation"] < 0.5),
            "evidence": {
                "p_utilisation": p["utilisation"],
                "p_mean_queue": p["mean_queue"],
                "p_queue_first_half": q1,
                "p_queue_second_half": q2,
                "d_utilisation": d["utilisation"],
            },
        }
    )
    full = [k >= 0.95 and b > 0 for k, b in zip(dkv, pbusy)]
    full_share = sum(full) / len(full) if full else (1.0 if d["peak_kv_occupancy"] >= 0.95 else 0.0)
    out.append(
        {
            "signal": "d-kv-full-p-accepting",
            "fired": bool(full_share >= 0.1 or d["preempted"] > 0),
            "evidence": {
                "share_of_time_d_kv_full_while_p_busy": full_share,
                "d_preempted": d["preempted"],
                "d_peak_kv": d["peak_kv_occupancy"],
            },
        }
    )
    t = result.transfers
    queueing = t["mean_queueing_ms"]
    out.append(
        {
            "signal": "transfer-queueing-growing",
            "fired": bool(t["count"] and queueing > 0.25 * max(t["mean_ms"] - queueing, 1e-9)),
            "evidence": {
                "mean_transfer_ms": t["mean_ms"],
                "mean_queueing_ms": queueing,
                "peak_concurrent": t["peak_concurrent"],
            },
        }
    )
    k = len(pbusy) or 1
    p_only = sum(1 for a, b in zip(pbusy, dbusy) if a > 0 and b == 0) / k  # P works, D idles
    d_only = sum(1 for a, b in zip(pbusy, dbusy) if a == 0 and b > 0) / k  # and the other way round
    out.append(
        {
            "signal": "pools-take-turns-idling",
            "fired": bool(min(p_only, d_only) >= 0.15 and p["utilisation"] < 0.7 and d["utilisation"] < 0.7),
            "evidence": {
                "share_of_time_only_p_busy": p_only,
                "share_of_time_only_d_busy": d_only,
                "p_utilisation": p["utilisation"],
                "d_utilisation": d["utilisation"],
            },
        }
    )
    for s in out:
        s["direction"] = SIGNALS[s["signal"]]
    return out


def expected_span(spec: WorkloadSpec, n: int) -> float:
    """Roughly how long ``n`` requests of ``spec`` take to arrive (s)."""
    rate = spec.rate
    return n / rate if rate and math.isfinite(rate) and rate > 0 else 1.0
