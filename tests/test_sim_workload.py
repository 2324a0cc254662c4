"""Workloads of the simulator: arrival processes, trace formats, lengths, cancels, bad input."""

from __future__ import annotations

import math
import pathlib
import statistics

import pytest

from pdproto._errors import PdprotoError, UsageError
from pdproto.sim import (
    Arrival,
    Cancellation,
    Lengths,
    SimRequest,
    TraceFormatError,
    WorkloadSpec,
    load_trace,
    make_workload,
    write_jsonl,
)

TRACES = pathlib.Path(__file__).resolve().parent.parent / "pdproto" / "sim" / "traces"


def gaps(requests: list[SimRequest]) -> list[float]:
    return [b.arrival - a.arrival for a, b in zip(requests, requests[1:])]


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


# -- arrivals -------------------------------------------------------------------------


def test_poisson_gaps_have_the_rate_and_cv_one() -> None:
    reqs = list(make_workload(WorkloadSpec.poisson(4.0, 10, 10), 20_000, seed=1))
    assert len(reqs) == 20_000
    assert reqs[0].arrival == 0.0
    g = gaps(reqs)
    assert statistics.fmean(g) == pytest.approx(0.25, rel=0.03)
    assert cv(g) == pytest.approx(1.0, rel=0.04)
    assert all(x >= 0 for x in g)


@pytest.mark.parametrize("target_cv", [0.5, 2.0])
def test_gamma_gaps_have_the_rate_and_the_cv(target_cv: float) -> None:
    spec = WorkloadSpec(Arrival.gamma(2.0, target_cv), Lengths.fixed(5), Lengths.fixed(5))
    g = gaps(list(make_workload(spec, 20_000, seed=3)))
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.05)
    assert cv(g) == pytest.approx(target_cv, rel=0.08)


def test_burstiness_is_vllms_gamma_shape_one_over_cv_squared() -> None:
    assert Arrival.gamma(3.0, burstiness=4.0) == Arrival.gamma(3.0, cv=0.5)
    assert Arrival.gamma(3.0, cv=2.0).burstiness == pytest.approx(0.25)
    assert Arrival.poisson(3.0).burstiness == 1.0
    # burstiness 1 is Poisson: the same cv
    g = gaps(list(make_workload(WorkloadSpec(Arrival.gamma(1.0, burstiness=1.0), Lengths.fixed(1),
                                             Lengths.fixed(1)), 20_000, 5)))
    assert cv(g) == pytest.approx(1.0, rel=0.05)
    with pytest.raises(UsageError, match="exactly one of cv and burstiness"):
        Arrival.gamma(1.0, cv=1.0, burstiness=1.0)
    with pytest.raises(UsageError):
        Arrival.gamma(1.0)


def test_fixed_arrivals_are_evenly_spaced() -> None:
    reqs = list(make_workload(WorkloadSpec(Arrival.fixed(8.0), Lengths.fixed(3), Lengths.fixed(2)), 5))
    assert [r.arrival for r in reqs] == [0.0, 0.125, 0.25, 0.375, 0.5]
    assert [r.id for r in reqs] == ["r0", "r1", "r2", "r3", "r4"]
    assert all((r.prompt_len, r.output_len) == (3, 2) for r in reqs)


def test_same_seed_same_requests_and_lengths_do_not_move_arrivals() -> None:
    a = WorkloadSpec.poisson(2.0, Lengths.uniform(1, 100), 7)
    b = WorkloadSpec.poisson(2.0, Lengths.lognormal(500, 1.0), Lengths.uniform(1, 9))
    ra, ra2, rb = (list(make_workload(s, 200, seed=9)) for s in (a, a, b))
    assert ra == ra2
    assert [r.arrival for r in ra] == [r.arrival for r in rb]
    assert ra != list(make_workload(a, 200, seed=10))


def test_arrival_validation() -> None:
    for bad in (0, -1.0, math.inf, math.nan, "2", None):
        with pytest.raises(UsageError):
            Arrival.poisson(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="arrival"):
        Arrival("uniform", 1.0)
    with pytest.raises(UsageError, match="time_scale"):
        Arrival("poisson", 1.0, time_scale=2.0)
    with pytest.raises(UsageError, match="cv"):
        Arrival("poisson", 1.0, cv=1.0)
    with pytest.raises(UsageError, match="time_scale"):
        Arrival.trace(0.0)


# -- lengths --------------------------------------------------------------------------


def test_length_distributions() -> None:
    spec = WorkloadSpec(Arrival.fixed(1.0), Lengths.uniform(5, 8), Lengths.lognormal(100, 0.5, high=400))
    reqs = list(make_workload(spec, 5000, seed=2))
    prompts = [r.prompt_len for r in reqs]
    outputs = [r.output_len for r in reqs]
    assert set(prompts) == {5, 6, 7, 8}
    assert statistics.median(outputs) == pytest.approx(100, rel=0.05)
    assert max(outputs) <= 400 and min(outputs) >= 1
    assert spec.output.mean == pytest.approx(100 * math.exp(0.125))
    emp = Lengths.empirical([3, 3, 10])
    got = [r.prompt_len for r in make_workload(WorkloadSpec(Arrival.fixed(1.0), emp, Lengths.fixed(1)), 3000)]
    assert set(got) == {3, 10}
    assert got.count(3) / len(got) == pytest.approx(2 / 3, abs=0.04)


def test_length_validation() -> None:
    with pytest.raises(UsageError, match="length"):
        Lengths.fixed(0)
    with pytest.raises(UsageError, match="high"):
        Lengths.uniform(10, 5)
    with pytest.raises(UsageError, match="values"):
        Lengths.empirical([])
    with pytest.raises(UsageError, match="values"):
        Lengths.empirical([1, 0])
    with pytest.raises(UsageError, match="sigma"):
        Lengths.lognormal(10, -1.0)
    with pytest.raises(UsageError, match="trace"):
        WorkloadSpec(Arrival.fixed(1.0), Lengths.trace(), Lengths.fixed(1))


# -- cancellations -----------------------------------------------------------------------


def test_cancellations_at_a_rate_and_phase() -> None:
    spec = WorkloadSpec.poisson(10.0, 50, 50, cancel=Cancellation(0.2, "decode", delay=0.5))
    reqs = list(make_workload(spec, 5000, seed=4))
    cancelled = [r for r in reqs if r.cancel_at is not None]
    assert len(cancelled) / len(reqs) == pytest.approx(0.2, abs=0.02)
    assert all(r.cancel_phase == "decode" and r.cancel_at == pytest.approx(r.arrival + 0.5) for r in cancelled)
    assert all(r.cancel_phase is None for r in reqs if r.cancel_at is None)
    # the cancel draws do not move arrivals or lengths
    plain = list(make_workload(WorkloadSpec.poisson(10.0, 50, 50), 5000, seed=4))
    assert [(r.arrival, r.prompt_len) for r in plain] == [(r.arrival, r.prompt_len) for r in reqs]
    with pytest.raises(UsageError, match="cancel phase"):
        Cancellation(0.1, "commit")
    with pytest.raises(UsageError, match="cancel rate"):
        Cancellation(1.5)


# -- traces --------------------------------------------------------------------------


ROWS = [(0.0, 10, 5), (0.5, 20, 1), (2.25, 30, 7)]


def write_formats(tmp: pathlib.Path) -> dict[str, pathlib.Path]:
    files = {
        "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,10,5\n2023-11-16 18:15:47.1805900,20,1\n2023-11-16 18:15:48.9305900,30,7\n",
        "splitwise": "request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size\n"
        "0,2,0,1.0,1,10,5\n1,2,0,1.5,1,20,1\n2,2,0,3.25,1,30,7\n",
        "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,20,1\n2.25,30,7\n",
        "mooncake": '{"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 1500, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 3250, "input_length": 30, "output_length": 7, "hash_ids": []}\n',
        "jsonl": '{"arrival": 0, "prompt_len": 10, "output_len": 5}\n'
        '{"arrival": 0.5, "prompt_len": 20, "output_len": 1, "id": "x"}\n'
        '{"arrival": 2.25, "prompt_len": 30, "output_len": 7}\n',
    }
    out = {}
    for name, text in files.items():
        path = tmp / f"{name}.{'jsonl' if name in ('mooncake', 'jsonl') else 'csv'}"
        path.write_text(text)
        out[name] = path
    return out


def test_every_format_reads_the_same_rows(tmp_path: pathlib.Path) -> None:
    for name, path in write_formats(tmp_path).items():
        for fmt in (None, name):
            trace = load_trace(path, fmt)
            assert trace.format == name
            got = list(zip(trace.arrivals, trace.prompts, trace.outputs))
            assert [(pytest.approx(t, abs=1e-6), p, o) for t, p, o in got] == ROWS, name


def test_replay_keeps_the_times_scaled_and_the_lengths(tmp_path: pathlib.Path) -> None:
    path = write_formats(tmp_path)["mooncake"]
    reqs = list(make_workload(WorkloadSpec.from_trace(path, time_scale=2.0), 10))
    assert len(reqs) == 3  # a replay stops at the end of the trace
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 1.0, 4.5])  # ms kept, then x2
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(10, 5), (20, 1), (30, 7)]
    spec = WorkloadSpec.from_trace(path)
    assert spec.rate == pytest.approx(2 / 2.25)
    faster = spec.with_rate(4.0)
    assert faster.rate == pytest.approx(4.0)
    assert [r.arrival for r in make_workload(faster, 3)][-1] == pytest.approx(0.5)


def test_trace_rows_are_sorted_and_zero_lengths_read_as_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "v.csv"
    path.write_text("# synthetic\narrived_at,num_prefill_tokens,num_decode_tokens,extra\n"
                    "5.0,3,0,x\n\n1.0,4,2,y\n")
    trace = load_trace(path)
    assert trace.arrivals == (0.0, 4.0)
    assert trace.prompts == (4, 3) and trace.outputs == (2, 1)


def test_empirical_lengths_from_a_trace_keep_rows_together(tmp_path: pathlib.Path) -> None:
    path = write_formats(tmp_path)["vidur"]
    spec = WorkloadSpec(Arrival.poisson(5.0), Lengths.trace(), Lengths.trace(), trace=str(path))
    pairs = {(r.prompt_len, r.output_len) for r in make_workload(spec, 500, seed=1)}
    assert pairs == {(10, 5), (20, 1), (30, 7)}
    assert len(list(make_workload(spec, 500))) == 500  # generated arrivals: n requests


def test_sample_traces_load_and_say_they_are_synthetic() -> None:
    readme = (TRACES / "README.md").read_text()
    assert "synthetic" in readme.lower()
    files = sorted(p for p in TRACES.iterdir() if p.suffix in (".csv", ".jsonl"))
    assert len(files) >= 5
    formats = set()
    for path in files:
        assert "synthetic" in path.name or path.name == "sample.jsonl"
        assert path.name in readme
        trace = load_trace(path)
        formats.add(trace.format)
        assert len(trace) >= 100 and trace.rate is not None
    assert formats == {"azure", "splitwise", "vidur", "mooncake", "jsonl"}
    code = load_trace(TRACES / "azure_code_synthetic.csv")
    assert statistics.median(code.outputs) < 30 < statistics.median(code.prompts)


def test_write_jsonl_round_trips(tmp_path: pathlib.Path) -> None:
    reqs = list(make_workload(WorkloadSpec.poisson(3.0, Lengths.uniform(1, 50), 9), 50, seed=8))
    path = tmp_path / "w.jsonl"
    assert write_jsonl(reqs, path) == 50
    back = list(make_workload(WorkloadSpec.from_trace(path), 100))
    assert [(r.prompt_len, r.output_len) for r in back] == [(r.prompt_len, r.output_len) for r in reqs]
    assert [r.arrival for r in back] == pytest.approx([r.arrival for r in reqs], abs=1e-6)


@pytest.mark.parametrize(
    "text, line, field",
    [
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n1.0,ten,5\n", 3, "num_prefill_tokens"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\nsoon,1,1\n", 3, "arrived_at"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,-5\n", 2, "num_decode_tokens"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10\n", 2, None),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-01 00:00:00.5,1,1\n", 2, "TIMESTAMP"),
        ("when,prompt,output\n0,1,1\n", 1, None),
        ('{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{"arrival": 1, "prompt_len": 1}\n', 2, "output_len"),
        ('{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{"arrival": -1, "prompt_len": 1, "output_len": 1}\n',
         2, "arrival"),
        ('{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{"arrival": 1, "prompt_len": 2.5, "output_len": 1}\n',
         2, "prompt_len"),
        ('{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{broken\n', 2, None),
        # json.loads rejects an integer of more than 4300 digits with a plain ValueError
        ('{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{"arrival": ' + "9" * 5000 + '}\n', 2, None),
        ('[1, 2]\n', 0, None),
        ('{"start": 0}\n', 1, None),
    ],
)
def test_bad_trace_is_one_error_naming_file_line_and_field(
    tmp_path: pathlib.Path, text: str, line: int, field: str | None
) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert isinstance(err, PdprotoError) and isinstance(err, ValueError)
    assert err.source == str(path)
    if line:
        assert err.line == line
        assert str(err).startswith(f"{path}:{line}:")
    assert err.field == field
    if field:
        assert repr(field) in str(err)
    if err.value is not None:
        assert f"(got {err.value!r})" in str(err) or "...')" in str(err)
    assert "\n" not in str(err)


def test_missing_empty_and_binary_traces(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("\n# only a comment\n")
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(tmp_path / "empty.csv")
    (tmp_path / "head.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(tmp_path / "head.csv")
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(TraceFormatError, match="UTF-8"):
        load_trace(tmp_path / "bin.csv")
    with pytest.raises(UsageError, match="trace format"):
        load_trace(tmp_path / "head.csv", "sharegpt")
    (tmp_path / "v.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n")
    with pytest.raises(TraceFormatError, match="JSON lines"):
        load_trace(tmp_path / "v.csv", "mooncake")


def test_reprs_are_valid_python() -> None:
    ns = {"WorkloadSpec": WorkloadSpec, "Arrival": Arrival, "Lengths": Lengths, "Cancellation": Cancellation,
          "SimRequest": SimRequest}
    for value in (
        WorkloadSpec(Arrival.gamma(2.0, 0.5), Lengths.lognormal(100, 1.0, 2, 900), Lengths.empirical([1, 2]),
                     Cancellation(0.1, "prefill", 0.25)),
        WorkloadSpec.from_trace(str(TRACES / "sample.jsonl"), time_scale=0.5),
        next(iter(make_workload(WorkloadSpec.poisson(1.0, 3, 4), 1))),
    ):
        assert eval(repr(value), ns) == value


def test_make_workload_argument_errors() -> None:
    spec = WorkloadSpec.poisson(1.0, 1, 1)
    with pytest.raises(UsageError, match="n"):
        make_workload(spec, -1, 0)
    with pytest.raises(UsageError, match="seed"):
        make_workload(spec, 1, -3)
    assert list(make_workload(spec, 0)) == []


def test_workload_is_streamed() -> None:
    import itertools

    stream = make_workload(WorkloadSpec.poisson(100.0, Lengths.uniform(1, 9), 3), 10**12, seed=1)
    first = list(itertools.islice(stream, 5))
    assert [r.id for r in first] == ["r0", "r1", "r2", "r3", "r4"]
    assert all(a.arrival <= b.arrival for a, b in zip(first, first[1:]))
