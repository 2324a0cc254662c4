"""Simulator metrics: vLLM's TTFT, TPOT, ITL, E2E and goodput, the first gap, gauges, bounded memory."""

from __future__ import annotations

import json
import pathlib
import math
import random

import pytest

from pdproto._errors import UsageError
from pdproto.sim import SLO, Gauge, Metrics, RequestRecord, percentile, stats

np = pytest.importorskip("numpy")


def record(i: int, arrival: float, tokens: list[float], **kw: object) -> RequestRecord:
    return RequestRecord(
        f"r{i}", "test", arrival, 16, len(tokens), tokens[0] if tokens else None,
        tokens[-1] if tokens else None, tuple(tokens), **kw  # type: ignore[arg-type]
    )


def vllm_metrics(recs: list[RequestRecord], duration: float, goodput: dict[str, float]) -> dict[str, float]:
    """What vLLM's calculate_metrics computes from these records (re-derived, numpy percentiles)."""
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    completed = 0
    out_tokens = 0
    for r in recs:
        if not r.completed:
            continue
        n = len(r.token_times)
        out_tokens += n
        latency = r.token_times[-1] - r.arrival
        ttft = r.token_times[0] - r.arrival
        tpot = 0.0
        if n > 1:
            tpot = (latency - ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += [b - a for a, b in zip(r.token_times, r.token_times[1:])]
        ttfts.append(ttft)
        e2els.append(latency)
        completed += 1
    good = 0
    for ttft, tpot, e2el in zip(ttfts, all_tpots, e2els):
        vals = {"ttft": ttft, "tpot": tpot, "e2e": e2el}
        if all(vals[k] <= v / 1000 for k, v in goodput.items()):
            good += 1
    out: dict[str, float] = {
        "completed": completed,
        "request_throughput": completed / duration,
        "output_throughput": out_tokens / duration,
        "goodput": good / duration,
    }
    for name, data in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e", e2els)):
        arr = np.array(data or [0.0]) * 1000
        out[f"{name}.mean"] = float(np.mean(arr))
        out[f"{name}.median"] = float(np.median(arr))
        out[f"{name}.std"] = float(np.std(arr))
        for q in (90, 95, 99):
            out[f"{name}.p{q}"] = float(np.percentile(arr, q))
    return out


def random_records(n: int, seed: int) -> list[RequestRecord]:
    rng = random.Random(seed)
    recs = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(5.0)
        first = t + rng.uniform(0.01, 0.5)
        tokens = [first]
        for _ in range(rng.choice([0, 0, 1, 5, 40, 200]) if i % 7 else 0):
            tokens.append(tokens[-1] + rng.choice([0.02, 0.025, rng.uniform(0.01, 0.2)]))
        kind = rng.random()
        if kind < 0.05:
            recs.append(RequestRecord(f"r{i}", "a", t, 9, len(tokens), None, None, (), rejected=True))
        elif kind < 0.08:
            recs.append(RequestRecord(f"r{i}", "a", t, 9, 50, first, first + 0.1, (first,), cancelled=True))
        elif kind < 0.1:
            recs.append(RequestRecord(f"r{i}", "a", t, 9, 50, first, first + 0.1, (first,), failed=True,
                                      retries=2))
        else:
            recs.append(record(i, t, tokens))
    return recs


@pytest.mark.parametrize("seed", [1, 2])
def test_matches_vllm_calculate_metrics(seed: int) -> None:
    recs = random_records(800, seed)
    m = Metrics("a")
    for r in recs:
        m.add(r)
    duration = 200.0
    goodput = {"ttft": 300.0, "tpot": 60.0, "e2e": 4000.0}
    s = m.summary(SLO.ms(**goodput), duration)
    ref = vllm_metrics(recs, duration, goodput)
    assert s["completed"] == ref["completed"]
    for key in ("request_throughput", "output_throughput", "goodput"):
        assert s[key] == pytest.approx(ref[key], rel=1e-12), key
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            assert s[f"{name}_ms"][stat] == pytest.approx(ref[f"{name}.{stat}"], rel=1e-9, abs=1e-9), (name, stat)
    assert s["rejected"] + s["cancelled"] + s["failed"] + s["completed"] == s["requests"] == 800
    assert s["retries"] == 2 * s["failed"]


def test_tpot_excludes_the_first_token_and_one_token_requests() -> None:
    m = Metrics()
    # TTFT 100 ms, then 3 gaps of 10, 10, 40 ms: TPOT = 60/3 = 20 ms, not 160/4
    m.add(record(0, 0.0, [0.1, 0.11, 0.12, 0.16]))
    m.add(record(1, 1.0, [1.5]))  # one output token: no TPOT, no ITL, no first gap
    s = m.summary()
    assert s["tpot_ms"]["count"] == 1
    assert s["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert s["itl_ms"]["count"] == 3
    assert s["itl_ms"]["mean"] == pytest.approx(20.0)
    assert s["itl_ms"]["max"] == pytest.approx(40.0)
    assert s["first_gap_ms"]["count"] == 1 and s["first_gap_ms"]["mean"] == pytest.approx(10.0)
    assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["e2e_ms"]["mean"] == pytest.approx((160 + 500) / 2)
    # the one-token request has TPOT 0 for goodput, so it meets any tpot SLO
    assert m.good(SLO.ms(tpot=1)) == 1
    assert m.good(SLO.ms(tpot=20.001)) == 2
    assert m.good(SLO.ms(itl=39)) == 1 and m.good(SLO.ms(itl=40.001)) == 2


def test_the_seed_first_generated_gap() -> None:
    # the seed's section 05: disaggregated first token at 40 ms, second at 66 ms
    m = Metrics()
    m.add(record(0, 0.0, [0.040, 0.066, 0.070, 0.074]))
    s = m.summary()
    assert s["first_gap_ms"]["mean"] == pytest.approx(26.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(40.0)
    assert m.good(SLO.ms(first_gap=25)) == 0 and m.good(SLO.ms(first_gap=26.001)) == 1


def test_goodput_counts_rejected_and_failed_as_failing() -> None:
    m = Metrics(devices=2)
    m.add(record(0, 0.0, [0.1, 0.2]))
    m.add(RequestRecord("r1", "x", 0.5, 8, 4, None, None, (), rejected=True))
    m.add(RequestRecord("r2", "x", 0.6, 8, 4, 0.7, 0.9, (0.7,), failed=True))
    m.add(RequestRecord("r3", "x", 0.7, 8, 4, 0.8, 0.85, (0.8,), cancelled=True))
    s = m.summary(SLO.ms(ttft=10_000), duration=10.0)
    assert s["good"] == 1
    assert s["goodput"] == pytest.approx(0.1)
    assert s["goodput_per_device"] == pytest.approx(0.05)
    assert s["attainment"] == pytest.approx(1 / 3)  # the client's cancel is left out
    assert s["request_throughput"] == pytest.approx(0.1)
    assert s["generated_tokens"] == 4 and s["output_tokens"] == 2


def test_slo_inclusive_bound_like_vllm() -> None:
    m = Metrics()
    m.add(record(0, 0.0, [0.25, 0.5]))
    assert m.good(SLO(ttft=0.25)) == 1
    assert m.good(SLO(ttft=0.2499)) == 0


def test_duration_and_concurrency_littles_law() -> None:
    m = Metrics()
    m.add(record(0, 1.0, [1.5, 2.0]))
    m.add(record(1, 2.0, [2.5, 5.0]))
    s = m.summary()
    assert s["duration_s"] == pytest.approx(4.0)
    # ΣE2E / duration: 1 + 3 request-seconds over 4 s
    assert s["concurrency"] == pytest.approx(1.0)


def test_slo_parse_and_reprs() -> None:
    slo = SLO.parse("ttft:200, tpot:100 e2el:5000")
    assert slo == SLO(ttft=0.2, tpot=0.1, e2e=5.0)
    assert str(slo) == "ttft:200,tpot:100,e2e:5000"
    assert eval(repr(slo), {"SLO": SLO}) == slo
    assert slo.to_ms() == {"ttft": 200.0, "tpot": 100.0, "e2e": 5000.0}
    for bad in ("", "ttft", "ttft:0", "ttft:-3", "ttft:abc", "bogus:3", "ttft:1,ttft:2", "ttft:inf"):
        with pytest.raises(UsageError):
            SLO.parse(bad)
    with pytest.raises(UsageError, match="at least one"):
        SLO()
    with pytest.raises(UsageError):
        SLO(ttft=math.nan)
    rec = record(3, 0.5, [0.6, 0.7])
    assert eval(repr(rec), {"RequestRecord": RequestRecord}) == rec


def test_percentile_matches_numpy() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        data = sorted(rng.random() for _ in range(n))
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)), rel=1e-12)
    assert stats([])["count"] == 0 and stats([])["p99"] == 0.0


def test_itl_beyond_the_limit_is_a_uniform_sample() -> None:
    rng = random.Random(5)
    exact, sampled = Metrics(), Metrics(itl_exact_limit=3000)
    all_gaps = []
    for i in range(400):
        tokens = [float(i)]
        for _ in range(rng.choice([1, 10, 50, 120])):
            tokens.append(tokens[-1] + rng.lognormvariate(-3.5, 0.6))
        all_gaps += [b - a for a, b in zip(tokens, tokens[1:])]
        r = record(i, i - 0.1, tokens)
        exact.add(r)
        sampled.add(r)
    e, a = exact.summary()["itl_ms"], sampled.summary()["itl_ms"]
    assert "approx" not in e and a["approx"] is True
    assert 1500 <= len(sampled._itl.values) <= 3000 and a["count"] == e["count"] == len(all_gaps) > 15_000
    assert e["p99"] == pytest.approx(float(np.percentile(np.array(all_gaps) * 1000, 99)), rel=1e-9)
    for stat in ("median", "p90", "p95"):
        assert a[stat] == pytest.approx(e[stat], rel=0.05), stat
    assert a["p99"] == pytest.approx(e["p99"], rel=0.15)
    assert a["mean"] == pytest.approx(e["mean"], rel=1e-9)  # count, mean and max stay exact
    assert a["max"] == e["max"]
    # the sample is uniform: late requests are as present as early ones
    second_half = set(all_gaps[len(all_gaps) // 2:])
    late = sum(1 for v in sampled._itl.values if v in second_half)
    assert late / len(sampled._itl.values) == pytest.approx(0.5, abs=0.05)


def test_gauge_time_average_max_and_bounded_series() -> None:
    g = Gauge("P.queue", capacity=10, points=64)
    g.set(0.0, 2)
    g.set(1.0, 6)
    g.set(3.0, 0)
    assert g.mean() == pytest.approx((2 * 1 + 6 * 2) / 3)
    assert g.mean(until=7.0) == pytest.approx(14 / 7)
    s = g.summary(7.0)
    assert s["max"] == 6 and s["last"] == 0 and s["max_share"] == pytest.approx(0.6)
    for k in range(10_000):
        g.add(4.0 + k * 0.001, 1 if k % 2 == 0 else -1)
    assert len(g.times) < 64 and len(g.times) == len(g.values)
    assert list(g.times) == sorted(g.times)
    assert g.peak == 6


def test_summary_is_json_ready_with_pool_fields() -> None:
    m = Metrics("pd 2P1D", devices=3, weight_copies=3)
    m.add(record(0, 0.0, [0.1, 0.2, 0.3]))
    m.gauge("P.queue").set(0.0, 1)
    m.gauge("D.kv_blocks", capacity=100).set(0.1, 40)
    m.busy("P0", 0.1)
    m.busy("D0", 0.2)
    m.transfer(512 * 2**20, 0.004, 0.02)
    m.count("preemption")
    s = m.summary(SLO.ms(ttft=500), duration=1.0)
    json.dumps(s)
    assert s["utilisation"] == {"D0": pytest.approx(0.2), "P0": pytest.approx(0.1)}
    assert s["transfers"]["network_bytes"] == 512 * 2**20
    assert s["transfers"]["queue_ms"]["mean"] == pytest.approx(4.0)
    assert s["gauges"]["D.kv_blocks"]["mean_share"] == pytest.approx(0.4 * 0.9)
    assert s["counters"] == {"preemption": 1}
    assert s["weight_copies"] == 3 and s["request_throughput_per_device"] == pytest.approx(1 / 3)


def test_memory_is_bounded_per_request() -> None:
    m = Metrics()
    for i in range(2000):
        base = float(i)
        m.add(record(i, base, [base + 0.1 + 0.02 * k for k in range(100)]))
    assert m.records == []  # nothing kept whole by default
    assert len(m._ttft) == 2000
    assert m.summary()["itl_ms"]["count"] == 2000 * 99
    bounded = Metrics(itl_exact_limit=10_000)
    for i in range(2000):
        base = float(i)
        bounded.add(record(i, base, [base + 0.1 + 0.02 * k for k in range(100)]))
    assert 5_000 <= len(bounded._itl.values) <= 10_000  # not 2000 x 99 gaps
    kept = Metrics(keep_records=2)
    for i in range(5):
        kept.add(record(i, float(i), [i + 0.5]))
    assert [r.id for r in kept.records] == ["r0", "r1"]


# -- plots -------------------------------------------------------------------------------


def two_arms() -> dict[str, Metrics]:
    arms = {}
    for name, gap in (("colocated", 0.03), ("pd 2P1D", 0.02)):
        m = Metrics(name)
        for r in random_records(200, 4):
            if r.completed:
                tt = [r.token_times[0] + gap * k for k in range(len(r.token_times))]
                r = record(int(r.id[1:]), r.arrival, tt)
            m.add(r)
        arms[name] = m
    return arms


@pytest.mark.slow
def test_plots_write_files(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    from pdproto.sim import (
        plot_cdfs,
        plot_goodput_vs_rate,
        plot_goodput_vs_ratio,
        plot_occupancy,
        plot_timeline,
    )

    arms = two_arms()
    made = [
        plot_cdfs(arms, tmp_path / "cdf.png", slo=SLO.ms(ttft=300, itl=40)),
        plot_cdfs(arms, tmp_path / "cdf.svg", metrics=("tpot", "first_gap", "e2e")),
        plot_goodput_vs_rate({"colocated": [(1, 0.9), (2, 1.5), (3, 1.2)], "pd": [(1, 1.0), (4, 3.3)]},
                             tmp_path / "rate.png", best={"pd": 3.5}),
        plot_goodput_vs_ratio([("1P1D", 2.5), ("2P1D", 3.3), ("1P2D", 1.9)], tmp_path / "ratio.pdf",
                              baseline=("colocated", 1.6)),
        plot_occupancy([(0.1 * k, pool, k % 5, (k % 10) / 10, 1.0 if k % 2 else 0.5)
                        for k in range(50) for pool in ("prefill", "decode")], tmp_path / "occ.png"),
        plot_timeline([record(0, 0.0, [0.08, 0.084, 0.088]), record(1, 0.01, [0.08, 0.084])],
                      tmp_path / "timeline.png", title="the seed's two requests"),
    ]
    for path in made:
        assert path.exists() and path.stat().st_size > 1000, path
    assert (tmp_path / "cdf.svg").read_text().lstrip().startswith("<?xml")


def test_timeline_plot(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    from pdproto.sim import plot_timeline

    path = plot_timeline([record(0, 0.0, [0.07, 0.074]), record(1, 0.0, [0.04, 0.066])], tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_plot_draws_the_handoff_the_records_carry(tmp_path: pathlib.Path) -> None:
    """The seed's two requests as the engine records them: PD's lane shows its
    prefill (0-40 ms) and its KV transfer (42-62 ms); colocated's has no transfer."""
    matplotlib = pytest.importorskip("matplotlib")
    from pdproto.sim import PiecewiseLinear, SimConfig, SimRequest, simulate
    from pdproto.sim import plot_timeline

    table = PiecewiseLinear([(1, 40.0), (10_000, 40.0)], [(1, 4.0), (10_000, 4.0)])
    recs = []
    for arm, devices in (("pd", 2), ("colocated", 1)):
        simulate([SimRequest(arm, 0.0, 4096, 3)], SimConfig(arm=arm, model="teaching-gqa", devices=devices,
                 latency_ms=0.0, coord_ms=2.0, bandwidth_gibps=25.0, kv_blocks=4096, block_size=16),
                 sink=recs.append, table=table)
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # (text stays text)
        svg = plot_timeline(recs, tmp_path / "t.svg").read_text()
    assert svg.count("KV transfer 20.0 ms") == 1 and svg.count("prefill") == 2
    assert "TTFT 40.0 ms" in svg and "first gap 26.0 ms" in svg and "first gap 4.0 ms" in svg


def test_plot_bad_input(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pdproto._errors import MissingExtraError
    from pdproto.sim import plot_cdfs, plot_timeline

    with pytest.raises(UsageError, match="metric"):
        plot_cdfs(two_arms(), tmp_path / "x.png", metrics=("goodput",))
    with pytest.raises(UsageError, match="at least one"):
        plot_timeline([], tmp_path / "x.png")
    with pytest.raises(UsageError, match="first_tokens"):
        plot_timeline([record(0, 0.0, [0.1])], tmp_path / "x.png", first_tokens=1)
    with pytest.raises(UsageError, match=r"\.png"):
        plot_cdfs(two_arms(), tmp_path / "x.jpg")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pdproto\[plot\]"):
        plot_cdfs(two_arms(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_itl_sample_does_not_alias_with_request_length() -> None:
    # 64 gaps a request, the first one long: a stride of 64 from a fixed offset would keep only
    # first gaps or none; the sample keeps them at their share, 1/64.
    m = Metrics(itl_exact_limit=1000)
    for i in range(3000):
        base = float(i)
        m.add(record(i, base, [base + 0.1] + [base + 0.2 + 0.01 * k for k in range(64)]))
    values = m._itl.values
    assert m._itl.stride >= 64
    share = sum(1 for v in values if v > 0.05) / len(values)
    assert share == pytest.approx(1 / 64, abs=0.01)
