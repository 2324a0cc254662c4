"""The simulator's engine and latency models: timings by hand, the handoff as
monitored events (faults included), KV capacity, contention, conservation."""

from __future__ import annotations

import math
import random

import attrs
import pytest

from pdproto._errors import UsageError
from pdproto.cost import GIB
from pdproto.sim import PiecewiseLinear, Roofline, SimConfig, simulate
from pdproto.sim import SimulationCheckError
from pdproto.sim._engine import _Sim
from pdproto.sim import DEVICES, MODELS
from pdproto.sim import Metrics, RequestRecord
from pdproto.sim import SimRequest
from pdproto.spec import Monitor, TransferWriteDone, open_history

#: The seed's section 05 timing as a table: a prefill of any size 40 ms, a decode step 4 ms.
SEED = PiecewiseLinear([(1, 40.0), (10_000, 40.0)], [(1, 4.0), (10_000, 4.0)])
TEACHING_KV = MODELS["teaching-gqa"].shape.bytes_per_token  # 128 KiB per token


def seed_config(arm: str, **kw: object) -> SimConfig:
    base = dict(arm=arm, model="teaching-gqa", devices=1 if arm != "pd" else 2, latency_ms=0.0, coord_ms=2.0,
                bandwidth_gibps=25.0, kv_blocks=4096, block_size=16)
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def run(reqs: list[SimRequest], cfg: SimConfig, **kw: object) -> tuple[list[RequestRecord], object]:
    out: list[RequestRecord] = []
    res = simulate(reqs, cfg, sink=out.append, table=kw.pop("table", SEED), **kw)  # type: ignore[arg-type]
    return sorted(out, key=lambda r: r.id), res


def poisson(n: int, rate: float, prompt: int = 600, output: int = 60, seed: int = 3, **extra: object) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        p = max(1, int(rng.lognormvariate(math.log(prompt), 0.5)))
        o = max(1, int(rng.lognormvariate(math.log(output), 0.5)))
        out.append(SimRequest(f"r{i}", t, p, o))
    return out


# -- one request alone: the seed's section 05 by hand ---------------------------------


def test_one_request_alone_pd_pays_coordination_transfer_and_one_step() -> None:
    (rec,), res = run([SimRequest("a", 0.0, 4096, 4)], seed_config("pd"))
    assert res.ok and res.events > 0
    transfer = 4096 * TEACHING_KV / (25 * GIB)  # 512 MiB at 25 GiB/s = 20 ms
    assert transfer == pytest.approx(0.020)
    assert rec.first_token == pytest.approx(0.040)
    assert rec.token_times == pytest.approx((0.040, 0.066, 0.070, 0.074))
    assert res.transfers["count"] == 1 and res.transfers["bytes"] == 512 * 2**20
    # the seed's timeline, recorded: prefill 0-40 ms, coordination 2 ms, transfer 42-62 ms, one step
    assert (rec.prefill_start, rec.transfer_start, rec.transfer_end) == pytest.approx((0.0, 0.042, 0.062))


def test_one_request_alone_colocated_and_chunked_decode_on_the_spot() -> None:
    (rec,), _ = run([SimRequest("a", 0.0, 4096, 4)], seed_config("colocated"))
    assert rec.token_times == pytest.approx((0.040, 0.044, 0.048, 0.052))
    assert rec.prefill_start == 0.0 and rec.transfer_start is None and rec.transfer_end is None
    # chunked: 4096 tokens in chunks of 512 = 8 steps of 40 ms before the first token
    (rec,), _ = run([SimRequest("a", 0.0, 4096, 2)], seed_config("chunked", chunk_tokens=512))
    assert rec.token_times == pytest.approx((0.320, 0.324))


def test_layerwise_overlap_hides_the_transfer_behind_the_prefill() -> None:
    (rec,), _ = run([SimRequest("a", 0.0, 4096, 2)], seed_config("pd", layerwise=True))
    # 20 ms of bytes, 40 ms of prefill: only one layer's share (20/32 ms) is left
    assert rec.token_times[1] == pytest.approx(0.040 + 0.002 + 0.020 / 32 + 0.004)


def test_transfers_on_one_egress_share_it_fairly_and_more_links_help() -> None:
    # w keeps P busy (one token: no handoff) while a and b arrive, so they prefill in one batch
    # and both transfers start at once: each gets half the link
    three = [SimRequest("w", 0.0, 16, 1), SimRequest("a", 0.001, 4096, 2), SimRequest("b", 0.001, 4096, 2)]
    together = [SimRequest("a", 0.0, 4096, 2), SimRequest("b", 0.0, 4096, 2)]  # arriving together: one batch too
    recs, _ = run(together, seed_config("pd"))
    assert [t for r in recs for t in r.token_times] == pytest.approx([0.040, 0.086, 0.040, 0.086])
    recs, res = run(three, seed_config("pd"))
    # both land at 80 + 2 + 40 ms and D's next step (it is idle) decodes both
    assert [r.first_token for r in recs[:2]] == pytest.approx([0.080, 0.080])
    assert [r.token_times[1] for r in recs[:2]] == pytest.approx([0.126, 0.126])
    assert res.transfers["peak_concurrent"] == 2 and res.transfers["count"] == 2
    assert res.transfers["mean_queueing_ms"] == pytest.approx(20.0)  # 20 ms more than alone, each
    recs, _ = run(three, seed_config("pd", links=2))
    assert [r.token_times[1] for r in recs[:2]] == pytest.approx([0.106, 0.106])


# -- the handoff as protocol events --------------------------------------------------


def faulty(n: int = 400, seed: int = 5) -> list[SimRequest]:
    rng = random.Random(seed)
    out = []
    for r in poisson(n, 40.0, seed=seed):
        x = rng.random()
        if x < 0.12:
            out.append(attrs.evolve(r, cancel_at=r.arrival, cancel_phase=rng.choice(
                ["queued", "prefill", "transfer", "decode"])))
        elif x < 0.2:
            out.append(attrs.evolve(r, cancel_at=r.arrival + rng.random() * 0.5))
        else:
            out.append(r)
    return out


@pytest.mark.parametrize("decode_events, n", [("first", 400), ("all", 150)])
def test_faults_cancels_and_preemption_keep_every_handoff_correct(tmp_path, decode_events: str, n: int) -> None:
    cfg = seed_config("pd", kv_blocks=300, transfer_fail_rate=0.15, transfer_timeout_ms=45.0, bandwidth_gibps=8.0,
                      max_retries=2, queue_timeout_s=3.0, n_d=2)
    path = tmp_path / "h.jsonl"
    with open(path, "w") as fh:
        recs, res = run(faulty(n), cfg, history=fh, decode_events=decode_events)
    assert res.violation is None
    f = res.faults
    assert f["transfer_failures"] > 0 and f["timeouts"] > 0 and f["retries"] > 0
    assert f["preempted"] > 0 and f["cancelled"] > 0
    assert max(r.retries for r in recs) <= 2
    # every request that failed or was rejected is counted under a reason
    assert sum(res.failures.values()) == f["failed"] > 0 and sum(res.rejections.values()) == f["rejected"]
    assert set(res.failures) <= {"transfer failed, retries exhausted", "transfer timeout, retries exhausted",
                                 "recomputed prompt larger than a decode instance's KV"}
    # conservation: every request ends exactly once, in exactly one way
    assert len(recs) == n == len({r.id for r in recs}) == res.finished
    for r in recs:
        assert (r.finish is not None) + r.rejected + r.cancelled + r.failed == 1
        if r.finish is not None:
            assert len(r.token_times) == r.output_len and list(r.token_times) == sorted(r.token_times)
        if r.completed and r.output_len >= 2:  # the recorded handoff comes after the first token, and
            # before the second unless a retry's recomputing prefill produced the second token itself
            assert r.prefill_start <= r.first_token <= r.transfer_start < r.transfer_end
            assert r.transfer_end <= r.token_times[1] or r.retries > 0
    # the written history reads back and a fresh monitor finds it complete and clean
    with open_history(str(path)) as reader:
        mon = Monitor.from_header(reader.header)
        count = sum(1 for _line, ev in reader if not mon.feed(ev) or True)
    assert count == res.events and not mon.finish() and mon.ok


@pytest.mark.parametrize("arm", ["pd", "colocated", "chunked"])
def test_a_run_makes_no_reference_cycles(arm: str) -> None:
    """The engine raises the collector's young threshold while it runs (it
    makes no cycles, and the collector walked the monitor's state for
    nothing): a run with faults, cancels and preemption leaves nothing for
    the collector to find."""
    import gc

    kw = dict(kv_blocks=300, transfer_fail_rate=0.15, transfer_timeout_ms=45.0, bandwidth_gibps=8.0, max_retries=2,
              queue_timeout_s=3.0, n_d=2) if arm == "pd" else dict(kv_blocks=300, queue_timeout_s=3.0)
    cfg = seed_config(arm, **kw)
    reqs = faulty(150)
    gc.collect()
    before = gc.get_threshold()
    gc.disable()
    try:
        recs, res = run(reqs, cfg)
        assert res.violation is None and len(recs) == 150
        del recs, res
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert gc.get_threshold() == before  # the caller's setting is back


def test_a_violation_stops_the_run_naming_the_request_and_the_time(monkeypatch) -> None:
    emit = _Sim.emit

    def drop_write_done(self: _Sim, ev: object, r: object = None) -> None:
        if isinstance(ev, TransferWriteDone) and ev.transfer == "x-r7-0":
            return  # the data plane "forgets" to report the landing: D commits anyway
        emit(self, ev, r)

    monkeypatch.setattr(_Sim, "emit", drop_write_done)
    recs, res = run(poisson(50, 5.0), seed_config("pd"))
    v = res.violation
    assert v is not None and not res.ok
    assert v["invariant"] == "commit-before-ready" and v["request"] == "r7"
    assert v["event"]["ev"] == "commit"
    r7 = poisson(50, 5.0)[7]
    assert r7.arrival < v["time_s"] < r7.arrival + 1.0
    assert len(recs) < 50  # it stopped there


def test_no_monitor_and_no_history_emit_nothing() -> None:
    _, res = run(poisson(30, 5.0), seed_config("pd"), monitor=False)
    assert res.events == 0 and res.ok


# -- capacity, admission, determinism ---------------------------------------------------


@pytest.mark.parametrize("arm", ["colocated", "chunked", "pd"])
def test_kv_capacity_is_enforced_with_preemption(arm: str) -> None:
    cfg = seed_config(arm, kv_blocks=120, devices=2)
    recs, res = run(poisson(200, 30.0, prompt=300, output=200), cfg)
    assert res.ok
    pools = res.pools.values()
    assert all(p["peak_kv_occupancy"] <= 1.0 for p in pools)
    assert sum(p["preempted"] for p in pools) > 0 == res.faults["rejected"]
    assert all(r.finish is not None or r.failed for r in recs)


def test_prompts_that_never_fit_are_rejected_and_queue_timeouts_reject() -> None:
    recs, res = run([SimRequest("big", 0.0, 5000, 2), SimRequest("ok", 0.0, 100, 2)],
                    seed_config("pd", kv_blocks=100))
    assert [r.rejected for r in recs] == [True, False] and res.ok
    assert res.rejections == {"prompt larger than an instance's KV": 1} and res.failures == {}
    many = [SimRequest(f"r{i}", 0.0, 4000, 50) for i in range(20)]
    recs, res = run(many, seed_config("colocated", queue_timeout_s=0.5))
    assert 0 < res.faults["rejected"] < 20
    assert res.rejections == {"queue timeout": res.faults["rejected"]}
    assert res.to_dict()["rejections"] == res.rejections
    assert all(r.first_token is None for r in recs if r.rejected)


# -- the end-of-run self-check: conservation, KV returned, Little's law -------------------


@pytest.mark.parametrize("arm", ["pd", "colocated", "chunked"])
def test_every_run_checks_littles_law_on_its_own_counts(arm: str) -> None:
    """L = λW on the sample path: the engine's time-averaged number of
    requests in the system (integrated as requests arrive and end) times the
    run's duration equals the sojourns the records show.  Here every request
    completes (preemption and retries included), so each record has its end;
    with cancels, rejections and failures the engine checks the same identity
    itself at the end of every run (the faulty runs above pass it)."""
    kw = dict(kv_blocks=120, transfer_fail_rate=0.15, bandwidth_gibps=8.0, max_retries=50, n_d=2) if arm == "pd" \
        else dict(kv_blocks=120, devices=2)
    reqs = poisson(200, 30.0, prompt=300, output=200)
    recs, res = run(reqs, seed_config(arm, **kw))
    assert res.ok and len(recs) == 200 and all(r.completed for r in recs)
    assert res.faults["preempted"] + res.faults["retries"] > 0
    sojourn = math.fsum(r.finish - r.arrival for r in recs)  # type: ignore[operator]
    assert res.mean_in_system * res.duration == pytest.approx(sojourn, rel=1e-9)
    assert res.to_dict()["mean_in_system"] == res.mean_in_system


def test_the_prefill_pools_mean_queue_is_littles_law_over_every_wait_before_prefill() -> None:
    """PD with two P instances and D short of KV, so requests wait first for a
    D reservation and then for a P: the pool's mean queue (both waits, summed
    over the pool) times the duration equals the summed waits from arrival to
    the prefill's start that the records show."""
    reqs = [attrs.evolve(r, prompt_len=300, output_len=1) for r in poisson(300, 60.0)]  # 19 blocks each
    recs, res = run(reqs, seed_config("pd", kv_blocks=60, n_p=2, n_d=1))
    assert res.ok and all(r.completed and r.retries == 0 for r in recs)
    pool = res.pools["prefill"]
    assert pool["mean_reservation_queue"] > 1.0 and pool["mean_queue"] > pool["mean_reservation_queue"]
    waits = math.fsum(r.prefill_start - r.arrival for r in recs)  # type: ignore[operator]
    assert pool["mean_queue"] * res.duration == pytest.approx(waits, rel=1e-9)


def _leak_one_block(monkeypatch) -> None:
    release = _Sim.release

    def leaky(self: _Sim, inst: object, blocks: list, r: object) -> None:
        if blocks and getattr(r, "id", None) == "r3":
            blocks.pop()  # one block never goes back to the pool
        release(self, inst, blocks, r)

    monkeypatch.setattr(_Sim, "release", leaky)


def test_the_self_check_finds_a_block_the_engine_never_returned(monkeypatch) -> None:
    _leak_one_block(monkeypatch)
    with pytest.raises(SimulationCheckError) as info:
        run(poisson(20, 5.0), seed_config("pd"), monitor=False)  # (the monitor would call it a leak first)
    assert info.value.check == "kv-returned" and "4095 distinct free block(s)" in info.value.detail
    assert "a bug in pdproto" in str(info.value)


def test_the_self_check_finds_a_request_that_ended_twice_or_never(monkeypatch) -> None:
    done = _Sim.done

    def twice(self: _Sim, r: object) -> None:
        done(self, r)
        if getattr(r, "id", None) == "r5":
            done(self, r)

    monkeypatch.setattr(_Sim, "done", twice)
    with pytest.raises(SimulationCheckError) as info:
        run(poisson(20, 5.0), seed_config("colocated"))
    assert info.value.check == "conservation" and "1 ended twice" in info.value.detail
    monkeypatch.setattr(_Sim, "done", lambda self, r: done(self, r) if r.id != "r5" else None)
    with pytest.raises(SimulationCheckError) as info:
        run(poisson(20, 5.0), seed_config("colocated"))
    assert info.value.check == "conservation" and "20 request(s) arrived, 19 end(s)" in info.value.detail


def test_the_self_check_finds_a_sojourn_the_count_did_not_see(monkeypatch) -> None:
    in_system = _Sim.in_system
    monkeypatch.setattr(_Sim, "in_system", lambda self, k: in_system(self, k) if k > 0 or self.n < 10 else
                        (setattr(self, "in_sys", self.in_sys - 1)))  # ends after the 10th arrival skip the integral
    with pytest.raises(SimulationCheckError) as info:
        run(poisson(20, 5.0), seed_config("chunked"))
    assert info.value.check == "littles-law"


def test_same_seed_same_run() -> None:
    cfg = seed_config("pd", transfer_fail_rate=0.2, n_p=2)
    a, _ = run(poisson(100, 20.0), cfg)
    b, _ = run(poisson(100, 20.0), cfg)
    assert a == b


def test_metrics_receive_records_and_pool_signals() -> None:
    m = Metrics("pd", devices=2, weight_copies=2)
    res = simulate(poisson(100, 10.0), seed_config("pd"), metrics=m, table=SEED)
    s = m.summary()
    assert s["requests"] == 100 == s["completed"]
    assert set(s["gauges"]) == {"prefill.queue", "prefill.kv_blocks", "decode.queue", "decode.kv_blocks"}
    assert s["transfers"]["count"] == 100 == res.transfers["count"]
    assert set(s["utilisation"]) == {"P0", "D0"}


# -- latency models and configuration --------------------------------------------------


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_long_prefill() -> None:
    roof = Roofline(MODELS["llama-3-8b"], DEVICES["h100-sxm"])
    decode = roof.step(0, 0, 1, 1000)
    weights_read = MODELS["llama-3-8b"].weight_bytes / (3350e9 * 0.7)
    assert decode == pytest.approx(weights_read + 0.0005, rel=0.01)
    long = roof.step(8192, 8192**2, 0, 0)
    assert long > 20 * decode
    assert Roofline(MODELS["llama-3-8b"], DEVICES["h100-sxm"], tp=2).step(8192, 8192**2, 0, 0) < long
    with pytest.raises(UsageError, match="weights to fit"):
        Roofline(MODELS["llama-3-70b"], DEVICES["h100-sxm"], tp=1)


def test_piecewise_linear_interpolates_extrapolates_and_reads_a_table(tmp_path) -> None:
    t = PiecewiseLinear([(100, 10.0), (200, 20.0)], [(1, 5.0), (9, 9.0)], decode_ctx_ms=0.001)
    assert t.step(150, 0, 0, 0) == pytest.approx(0.015)
    assert t.step(400, 0, 0, 0) == pytest.approx(0.040)
    assert t.step(0, 0, 5, 1000) == pytest.approx(0.008)
    assert t.step(0, 0, 0, 0) == 0.0
    path = tmp_path / "t.csv"
    path.write_text("phase,tokens,ms\nprefill,100,10\nprefill,200,20\ndecode,1,5\ndecode,9,9\ndecode_ctx,1000,1\n")
    assert PiecewiseLinear.from_csv(path) == t
    # the decode_ctx row is ms per TOKENS context tokens, whatever TOKENS is
    path.write_text("phase,tokens,ms\nprefill,100,10\nprefill,200,20\ndecode,1,5\ndecode,9,9\ndecode_ctx,500,0.5\n")
    assert PiecewiseLinear.from_csv(path) == t
    path.write_text("phase,tokens,ms\ndecode,1,5\ndecode_ctx,1000,1\ndecode_ctx,1000,2\n")
    with pytest.raises(UsageError, match="decode_ctx"):
        PiecewiseLinear.from_csv(path)
    path.write_text("phase,tokens,ms\nprefill,100,10\nwarmup,1,1\n")
    with pytest.raises(UsageError, match=r"t.csv:3"):
        PiecewiseLinear.from_csv(path)
    with pytest.raises(UsageError, match="distinct"):
        PiecewiseLinear([(1, 1.0), (1, 2.0)], [(1, 1.0)])


def test_config_checks_and_device_counts() -> None:
    cfg = SimConfig(arm="pd", n_p=2, n_d=3, tp_p=2, tp_d=1)
    assert cfg.used_devices == 7 and cfg.weight_copies == 5
    assert SimConfig(arm="chunked", devices=8, tp=4).weight_copies == 2
    for bad in (dict(arm="disagg"), dict(model="gpt-5"), dict(transfer_fail_rate=1.0), dict(kv_blocks=0),
                dict(bandwidth_gibps=-1.0), dict(arm="colocated", devices=2, tp=4)):
        with pytest.raises((UsageError, ValueError)):
            SimConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="decode_events"):
        simulate([], SimConfig(), decode_events="some")


@pytest.mark.parametrize("arm", ["colocated", "chunked", "pd"])
def test_macro_steps_change_nothing_but_the_event_count(arm: str, monkeypatch) -> None:
    """Decode steps with nobody joining, leaving or growing run as one event
    (a macro-step); the records are exactly those of one event per step."""
    import pdproto.sim._engine as engine

    reqs = faulty(200, seed=9) if arm == "pd" else poisson(200, 25.0, seed=9)
    for kv in (None, 150):
        cfg = SimConfig(arm=arm, devices=2, kv_blocks=kv, block_size=16, transfer_fail_rate=0.1 if arm == "pd" else 0.0)
        fast, res = run(reqs, cfg, table=None)
        monkeypatch.setattr(engine, "_MACRO", 1)
        slow, res1 = run(reqs, cfg, table=None)
        monkeypatch.undo()
        assert fast == slow and res.ok and res1.ok
        if arm != "chunked":
            assert sum(p["steps"] for p in res.pools.values()) < sum(p["steps"] for p in res1.pools.values())


def fired(reqs: list[SimRequest], cfg: SimConfig) -> set[str]:
    from pdproto.sim import signals

    res = simulate(reqs, cfg, sink=lambda r: None, sample_dt=0.05, table=None)
    return {s["signal"] for s in signals(res) if s["fired"]}


def test_the_section_06_signals_fire_on_the_runs_they_describe() -> None:
    base = dict(arm="pd", model="llama-3-8b", devices=2)
    # long prompts, 2-token answers, arrivals faster than one P can prefill: P's queue grows, D idles
    flood = [SimRequest(f"r{i}", i * 0.05, 8000, 2) for i in range(300)]
    assert "p-queue-growing-d-idle" in fired(flood, SimConfig(**base))
    # a slow link: transfers queue behind each other on P's egress
    assert "transfer-queueing-growing" in fired(poisson(200, 10.0), SimConfig(**base, bandwidth_gibps=0.5))
    # a small D and long answers: D's KV fills (and preempts) while P keeps prefilling
    long = poisson(200, 20.0, prompt=400, output=400)
    assert "d-kv-full-p-accepting" in fired(long, SimConfig(**base, kv_blocks=60))
    # bursts: P prefills a whole burst while D idles, then D decodes it while P idles
    bursts = [SimRequest(f"r{b}-{i}", b * 3.0, 2000, 100) for b in range(20) for i in range(10)]
    assert "pools-take-turns-idling" in fired(bursts, SimConfig(**base, max_batch_tokens=32768))
    # a light, steady load fires nothing
    assert fired(poisson(100, 2.0), SimConfig(**base)) == set()


def test_thinned_samples_keep_every_pool_at_each_sample_time() -> None:
    # a sample step short enough that the sample list is thinned many times:
    # each kept sample time must still have one row per pool (halving the raw
    # row list kept only one pool of a PD run)
    import collections

    res = simulate(poisson(300, 30.0), SimConfig(arm="pd", model="llama-3-8b", devices=2),
                   sink=lambda r: None, sample_dt=0.0005, table=None)
    per_pool = collections.Counter(name for _, name, *_ in res.samples)
    per_time = collections.Counter(t for t, *_ in res.samples)
    assert len(res.samples) > 4000 and per_pool["prefill"] == per_pool["decode"]
    assert set(per_time.values()) == {2}
