"""``pdproto simulate``: the report, --json, --history, --sweep, exit codes and one-line errors."""

from __future__ import annotations

import json
import pathlib

import pytest

from pdproto._cli import main
from pdproto.sim._engine import _Sim
from pdproto.spec import TransferWriteDone

SMALL = ["--requests", "120", "--rate", "4", "--prompt", "lognormal:600,0.5", "--output", "lognormal:60,0.5"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["simulate", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_the_report_shows_every_arm_pools_and_the_monitor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL]) == 0
    out = capsys.readouterr().out
    for text in ("colocated 2x tp1", "chunked 2x tp1", "pd 1P1D tp1/1", "TTFT p99", "first gap p50",
                 "goodput per device", "SLO attainment", "pd: decode", "KV peak", "PD transfers: 120",
                 "no violation", "Section 06 signals", "Every arm serves this load"):
        assert text in out, text


def test_json_has_the_three_arms_at_the_same_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(capsys, *SMALL, "--pd", "2:1", "--slo", "ttft:300,tpot:40")
    assert code == 0 and data["violation"] is None
    runs = {r["arm"]: r for r in data["runs"]}
    assert set(runs) == {"colocated", "chunked", "pd"}
    assert {r["metrics"]["devices"] for r in runs.values()} == {3}
    assert runs["pd"]["result"]["weight_copies"] == 3
    m = runs["pd"]["metrics"]
    assert m["requests"] == 120 and m["slo"] == {"ttft": 300.0, "tpot": 40.0}
    assert 0 <= m["attainment"] <= 1 and m["goodput_per_device"] == pytest.approx(m["goodput"] / 3)
    assert [s["signal"] for s in runs["pd"]["signals"]] == [
        "p-queue-growing-d-idle", "d-kv-full-p-accepting", "transfer-queueing-growing", "pools-take-turns-idling"]
    assert data["verdict"]["best"] in {r["label"] for r in runs.values()}


def test_history_is_written_and_audits_clean(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sim.jsonl"
    code, data = run_json(capsys, *SMALL, "--arm", "pd", "--history", str(path), "--transfer-fail-rate", "0.2",
                          "--cancel-rate", "0.2")
    assert code == 0
    pd = data["runs"][0]
    assert pd["result"]["faults"]["transfer_failures"] > 0
    lost = pd["goodput_lost_to_faults"]
    assert lost["goodput_without_faults"] >= lost["goodput_with_faults"]
    assert main(["audit", str(path)]) == 0
    lines = path.read_text().splitlines()
    assert len(lines) == pd["result"]["events"] + 1  # the header, then every event judged


def test_a_violation_exits_1_naming_the_request_and_time(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    emit = _Sim.emit

    def lose_landing(self: _Sim, ev: object, r: object = None) -> None:
        if not (isinstance(ev, TransferWriteDone) and ev.transfer == "x-r3-0"):
            emit(self, ev, r)

    monkeypatch.setattr(_Sim, "emit", lose_landing)
    assert main(["simulate", *SMALL, "--arm", "pd"]) == 1
    out = capsys.readouterr().out
    assert "commit-before-ready: request r3 at t =" in out
    code, data = run_json(capsys, *SMALL)
    assert code == 1 and data["violation"]["request"] == "r3"
    assert len(data["runs"]) == 3 and data["runs"][2]["result"]["finished"] < 120


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pd", "0:1"], "--pd"),
        (["--prompt", "normal:5,1"], "--prompt"),
        (["--output", "fixed:0"], "--output"),
        (["--slo", "ttft"], "--slo"),
        (["--model", "gpt-9"], "model"),
        (["--rate", "-2"], "rate"),
        (["--arrival", "gamma"], "--cv"),
        (["--latency-table", "/nonexistent.csv"], "--latency-table"),
        (["--arm", "colocated", "--history", "h.jsonl"], "--history"),
        (["--trace", "/nonexistent.csv"], "nonexistent"),
        (["--tp-p", "1", "--model", "llama-3-70b"], "weights"),
        (["--target", "1.5"], "--target"),
        (["--sweep", "--tps", "1,x"], "--tps"),
        (["--pd", "\u00b2:1"], "--pd"),  # isdigit() accepts '²', int() refuses it
        (["--sweep", "--tps", "1,\u00b2"], "--tps"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                          tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", *([] if "--sweep" in argv else ["--requests", "5"]), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_sweep_bisects_the_rate_per_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(capsys, "--sweep", "--budget", "2", "--sweep-requests", "60", "--sweep-span", "4", "--rate", "2",
                          "--prompt", "fixed:500", "--output", "fixed:40")
    assert code == 0 and data["mode"] == "budget"
    rows = data["rows"]
    assert {r["label"] for r in rows} == {"colocated 2x tp1", "chunked 2x tp1", "pd 1P1D tp1/1"}
    for r in rows:
        assert r["devices"] == 2 and r["max_rate"] > 0
        assert r["goodput_per_device"] == pytest.approx(r["max_rate"] / 2)
        passing = [p["rate"] for p in r["probes"] if p["attainment"] >= 0.9]
        failing = [p["rate"] for p in r["probes"] if p["attainment"] < 0.9]
        assert max(passing) == r["max_rate"] and min(failing) > r["max_rate"]
    per = [r["goodput_per_device"] for r in rows]
    assert per == sorted(per, reverse=True)


def test_sweep_at_a_rate_finds_the_cheapest_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(capsys, "--sweep", "--at-rate", "3", "--max-devices", "3", "--sweep-requests", "60", "--sweep-span", "4",
                          "--prompt", "fixed:500", "--output", "fixed:40", "--arm", "pd")
    assert code == 0 and data["mode"] == "cheapest"
    assert data["budget"] == 2  # PD needs one P and one D
    assert all(c["devices"] == 2 for c in data["configs"])


@pytest.mark.slow  # matplotlib's import and seven pictures: several seconds
def test_plot_writes_the_pictures(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, data = run_json(capsys, *SMALL, "--plot", str(tmp_path))
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["cdf.png", "occupancy-colocated.png", "occupancy-chunked.png", "occupancy-pd.png",
                            "timeline-colocated.png", "timeline-chunked.png", "timeline-pd.png"])
    assert sorted(pathlib.Path(p).name for p in data["plots"]) == names
    code, data = run_json(capsys, *SMALL, "--arm", "pd", "--plot", str(tmp_path / "new" / "dir"))
    assert code == 0 and len(data["plots"]) == 3 and all(pathlib.Path(p).is_file() for p in data["plots"])


def test_a_trace_replays_its_own_requests_and_rescales_to_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(pathlib.Path(__file__).resolve().parent.parent / "pdproto" / "sim" / "traces" / "sample.jsonl")
    code, data = run_json(capsys, "--trace", trace, "--arm", "pd")
    assert code == 0 and data["workload"]["requests"] == 300 == data["runs"][0]["metrics"]["requests"]
    code, faster = run_json(capsys, "--trace", trace, "--arm", "pd", "--rate", str(2 * data["workload"]["rate"]))
    assert faster["workload"]["rate"] == pytest.approx(2 * data["workload"]["rate"])
    assert faster["runs"][0]["result"]["duration_s"] < data["runs"][0]["result"]["duration_s"]


SLOW_LINK_SWEEP = ["--sweep", "--budget", "2", "--arm", "pd", "--rate", "1", "--sweep-requests", "40",
                   "--sweep-span", "3", "--prompt", "fixed:2000", "--output", "fixed:20", "--bandwidth", "1"]


def test_sweep_prints_the_section_06_signals_at_each_max_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(capsys, *SLOW_LINK_SWEEP)
    assert code == 0
    (row,) = data["rows"]
    assert [s["signal"] for s in row["signals"] if s["fired"]] == ["transfer-queueing-growing"]
    assert main(["simulate", *SLOW_LINK_SWEEP]) == 0
    out = capsys.readouterr().out
    assert "Section 06 signals (PD) at each configuration's max rate" in out
    assert f"pd 1P1D tp1/1 at {row['max_rate']:.2f} rps" in out
    assert "YES transfer-queueing-growing" in out and "-> transfer queueing grows" in out
    assert "no  p-queue-growing-d-idle" not in out  # only the fired ones, or "none fired"
    assert main(["simulate", *SLOW_LINK_SWEEP[:-1], "0.5"]) == 0  # so slow that transfers never overlap
    assert "none fired" in capsys.readouterr().out


def test_sweep_takes_a_latency_table_for_one_tp_size(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "steps.csv"
    table.write_text("phase,tokens,ms\nprefill,1000,100\ndecode,1,20\ndecode,64,40\n")  # slower than the roofline
    sweep = ["--sweep", "--budget", "2", "--sweep-requests", "40", "--sweep-span", "3", "--rate", "2",
             "--prompt", "fixed:500", "--output", "fixed:20"]
    code, roof = run_json(capsys, *sweep)
    code2, fitted = run_json(capsys, *sweep, "--latency-table", str(table))
    assert code == code2 == 0
    rates = {r["label"]: r["max_rate"] for r in roof["rows"]}
    assert {r["label"] for r in fitted["rows"]} == set(rates)
    for r in fitted["rows"]:
        assert 0 < r["max_rate"] < rates[r["label"]]
    at_rate = ["--sweep", "--at-rate", "20", "--max-devices", "3", "--arm", "pd", "--sweep-requests", "40",
               "--sweep-span", "3", "--prompt", "fixed:500", "--output", "fixed:20"]
    assert run_json(capsys, *at_rate)[1]["budget"] == 2
    assert run_json(capsys, *at_rate, "--latency-table", str(table))[1]["budget"] == 3  # 50 ms a prefill: 2 P
    assert main(["simulate", "--sweep", "--tps", "1,2", "--latency-table", str(table)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--latency-table" in err and "one TP size" in err and "--tps N" in err


def test_goodput_lost_to_faults_is_never_a_negative_zero(capsys: pytest.CaptureFixture[str]) -> None:
    faults = ["--arm", "pd", "--transfer-fail-rate", "0.05", "--cancel-rate", "0.1", "--requests", "100"]
    code, data = run_json(capsys, *faults)
    lost = data["runs"][0]["goodput_lost_to_faults"]
    assert code == 0 and -1e-3 < lost["lost"] < 0  # the retries shift the timing: a hair more goodput
    assert main(["simulate", *faults]) == 0
    out = capsys.readouterr().out
    assert "goodput lost to faults: 0 rps (" in out and "-0.0" not in out and "-0%" not in out


def test_numbers_never_print_as_negative_zero() -> None:
    from pdproto._cli._simulate import _f, _lost

    assert [_f(-2e-5, 3), _f(-0.0), _f(-0.04), _f(-1.26), _f(1234.5)] == ["0.000", "0.0", "0.0", "-1.3", "1,234.5"]
    assert _lost({"lost": -0.2, "lost_share": -0.05, "goodput_without_faults": 3.6}).startswith("0 rps (0.200 more")
    assert _lost({"lost": 0.2, "lost_share": 0.05, "goodput_without_faults": 3.6}) == (
        "0.200 rps (5.0%; 3.600 without faults)")


def test_plot_makes_its_directory_or_says_why_not(tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    import pdproto._cli._simulate as cli

    drawn = []
    monkeypatch.setattr(cli, "_plots", lambda directory, runs, slo: drawn.append(directory) or [])
    monkeypatch.setattr(cli, "_sweep_plots", lambda directory, rows: drawn.append(directory) or [])
    target = tmp_path / "a" / "b"
    assert main(["simulate", *SMALL, "--arm", "pd", "--plot", str(target)]) == 0
    assert target.is_dir() and drawn == [str(target)]
    capsys.readouterr()
    afile = tmp_path / "file"
    afile.write_text("")
    for path, needle in ((afile, "this path is a file"), (afile / "sub", "a directory that can be made")):
        assert main(["simulate", *SMALL, "--plot", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--plot" in err and str(path) in err and needle in err
    bad = tmp_path / "not-made"
    assert main(["simulate", *SMALL, "--plot", str(bad), "--pd", "0:1"]) == 2  # bad input: nothing made
    assert not bad.exists()
    assert main(["simulate", "--sweep", "--at-rate", "2", "--plot", str(target)]) == 2
    assert "no --plot with --sweep --at-rate" in capsys.readouterr().err


def test_the_report_says_why_requests_were_rejected_or_failed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--kv-blocks", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    for label in ("colocated 2x tp1", "chunked 2x tp1", "pd 1P1D tp1/1"):
        assert f"{label}: 120 rejected at admission (120 prompt larger than an instance's KV)" in out
    assert "TTFT p50 — — —" in out.replace("│", "").replace("  ", " ")  # no sample, no number
    argv = ["simulate", *SMALL, "--arm", "pd", "--transfer-fail-rate", "0.6", "--max-retries", "1"]
    code, data = run_json(capsys, *argv[1:])
    failed = data["runs"][0]["result"]["faults"]["failed"]
    assert code == 0 and failed > 0
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{failed} failed ({failed} transfer failed, retries exhausted)" in out
    assert data["runs"][0]["result"]["failures"] == {"transfer failed, retries exhausted": failed}
    assert main(["simulate", *SMALL, "--arm", "pd"]) == 0
    assert "rejected at admission" not in capsys.readouterr().out


SAMPLE_TRACE = str(pathlib.Path(__file__).resolve().parent.parent / "pdproto" / "sim" / "traces" / "sample.jsonl")


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["--trace", SAMPLE_TRACE, "--time-scale", "0"], "--time-scale: 0.0 is not allowed"),
        (["--trace", SAMPLE_TRACE, "--trace-format", "foo"], "--trace-format: 'foo' is not allowed; expected one of"),
        (["--latency-table", "/nonexistent.csv"], "--latency-table: '/nonexistent.csv' is not allowed"),
        (["--prompt", "trace"], "--prompt: 'trace' is not allowed; expected a trace file given with --trace"),
        (["--output", "trace"], "--output: 'trace' is not allowed; expected a trace file given with --trace"),
        (["--model", "llama-3-70b"], "--tp: 1 is not allowed; expected a TP large enough"),
        (["--model", "llama-3-70b", "--tp", "2"], "--tp-p/--tp-d: '1/1' is not allowed; expected a TP large enough"),
    ],
)
def test_bad_input_names_the_flag_typed(argv: list[str], starts: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pdproto simulate: error: {starts}"), err


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["--cv", "2"], "--cv: 2.0 is not allowed; expected no --cv unless --arrival gamma (the arrival here is "
                        "poisson)"),
        (["--arrival", "fixed", "--burstiness", "2"], "--burstiness: 2.0 is not allowed; expected no --burstiness"),
        (["--cancel-phase", "decode"], "--cancel-phase: 'decode' is not allowed; expected no --cancel-phase without"),
        (["--cancel-rate", "0", "--cancel-phase", "queued"], "--cancel-phase: 'queued'"),
        (["--cancel-delay", "1"], "--cancel-delay: 1.0 is not allowed; expected no --cancel-delay without"),
        (["--time-scale", "2"], "--time-scale: 2.0 is not allowed; expected no --time-scale unless a trace"),
        (["--trace-format", "azure"], "--trace-format: 'azure' is not allowed; expected no --trace-format without"),
        (["--tps", "1,2"], "--tps: '1,2' is not allowed; expected --tps only with --sweep"),
        (["--budget", "4"], "--budget: 4 is not allowed; expected --budget only with --sweep"),
        (["--sweep", "--requests", "9"], "--requests: 9 is not allowed; expected no --requests with --sweep"),
        (["--sweep", "--history", "h.jsonl"], "--history: 'h.jsonl' is not allowed; expected no --history with"),
        (["--sweep", "--max-devices", "3"], "--max-devices: 3 is not allowed; expected --max-devices only with --sweep "
                                            "--at-rate"),
        (["--sweep", "--at-rate", "2", "--budget", "3"], "--budget: 3 is not allowed"),
        (["--sweep", "--pd", "2:1"], "--pd: '2:1' is not allowed; expected no --pd with --sweep"),
        (["--sweep", "--tp-d", "2"], "--tp-d: 2 is not allowed; expected no --tp-d with --sweep"),
        (["--arm", "pd", "--tp", "2"], "--tp: 2 is not allowed; expected no --tp with --arm pd"),
        (["--arm", "pd", "--devices", "4"], "--devices: 4 is not allowed; expected no --devices with --arm pd"),
        # a colocated instance takes --tp devices: a budget it does not divide would leave devices idle
        (["--devices", "3", "--tp", "2"], "--devices: 3 is not allowed; expected a multiple of --tp 2"),
        (["--pd", "1:2", "--tp", "2"], "--tp: 2 is not allowed; expected a divisor of the 3 devices PD uses"),
        # a sweep with nothing to try says so instead of printing an empty table
        (["--sweep", "--budget", "1", "--arm", "pd"], "--budget: 1 is not allowed; expected a budget with a "
                                                      "configuration of --arm pd at --tps 1"),
        (["--sweep", "--budget", "2", "--model", "llama-3-70b"], "--budget: 2 is not allowed; expected a budget "
                                                                 "with a configuration whose instances fit"),
    ],
)
def test_a_setting_nothing_reads_is_an_error(argv: list[str], starts: str, capsys: pytest.CaptureFixture[str],
                                             tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pdproto simulate: error: {starts}"), err
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_the_settings_that_are_read_still_run(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--arrival", "gamma", "--cv", "2"], ["--arrival", "gamma", "--burstiness", "0.5"],
                 ["--cancel-rate", "0.2", "--cancel-phase", "decode", "--cancel-delay", "0.1"],
                 ["--trace", SAMPLE_TRACE, "--time-scale", "2", "--trace-format", "jsonl"]):
        assert main(["simulate", "--requests", "40", "--arm", "pd", *argv]) == 0, argv
    capsys.readouterr()


def test_the_timeline_shows_the_two_earliest_arrivals_that_completed(monkeypatch, tmp_path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import pdproto.sim as _plot  # the CLI draws through the face

    kept, drawn = {}, {}
    monkeypatch.setattr(_plot, "plot_cdfs", lambda metrics, path, slo=None: kept.update(metrics) or path)
    monkeypatch.setattr(_plot, "plot_occupancy", lambda samples, path: path)
    monkeypatch.setattr(_plot, "plot_timeline", lambda recs, path, title=None: drawn.update({title: recs}) or path)
    # r0 is cancelled in the queue; of the rest, long and short outputs finish out of arrival order
    argv = ["simulate", "--requests", "60", "--rate", "8", "--prompt", "uniform:100,2000", "--output",
            "uniform:2,400", "--cancel-rate", "0.3", "--plot", str(tmp_path), "--json"]
    assert main(argv) == 0
    capsys.readouterr()
    assert len(drawn) == 3
    out_of_order = 0
    for label, metrics in kept.items():
        done = [r for r in metrics.records if r.completed]
        assert len(metrics.records) == 60  # every record kept: the expected pair is known
        earliest = sorted(done, key=lambda r: r.arrival)[:2]
        assert [r.id for r in drawn[f"first two requests, {label}"]] == [r.id for r in earliest]
        out_of_order += [r.id for r in done[:2]] != [r.id for r in earliest]
    assert out_of_order  # the old pick (the first two to complete) differs on at least one arm


def test_the_sweep_ratio_plot_has_colocated_and_chunked_lines(monkeypatch, tmp_path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import pdproto.sim as _plot  # the CLI draws through the face

    seen = {}
    monkeypatch.setattr(_plot, "plot_goodput_vs_ratio", lambda pts, path, **kw: seen.update(kw, pts=pts) or path)
    monkeypatch.setattr(_plot, "plot_goodput_vs_rate", lambda curves, path, **kw: path)
    code, data = run_json(capsys, "--sweep", "--budget", "3", "--sweep-requests", "40", "--sweep-span", "3", "--rate",
                          "2", "--prompt", "fixed:500", "--output", "fixed:40", "--plot", str(tmp_path))
    assert code == 0
    per = {r["label"]: r["goodput_per_device"] for r in data["rows"]}
    assert seen["baselines"] == [(label, per[label]) for label in ("colocated 3x tp1", "chunked 3x tp1")]
    assert sorted(label for label, _v in seen["pts"]) == ["pd 1P2D tp1/1", "pd 2P1D tp1/1"]


def test_sweep_tries_tp_per_role(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(capsys, "--sweep", "--budget", "3", "--tps", "1,2", "--arm", "pd", "--sweep-requests", "30",
                          "--sweep-span", "2", "--rate", "2", "--prompt", "fixed:500", "--output", "fixed:20")
    assert code == 0
    rows = {(r["n_p"], r["n_d"], r["tp_p"], r["tp_d"]): r for r in data["rows"]}
    assert set(rows) == {(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)}
    for r in rows.values():
        assert r["devices"] == 3 and r["weight_copies"] == 2 + (r["tp_p"] == r["tp_d"]) and r["max_rate"] > 0
    assert main(["simulate", "--sweep", "--budget", "3", "--tps", "1,2", "--arm", "pd", "--sweep-requests", "30",
                 "--sweep-span", "2", "--rate", "2", "--prompt", "fixed:500", "--output", "fixed:20"]) == 0
    out = capsys.readouterr().out
    assert "pd 1P1D tp2/1" in out and "pd 1P1D tp1/2" in out


def test_the_pools_table_says_what_its_mean_queue_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "mean queue *" in out
    assert ("* mean queue: requests waiting to be scheduled, summed over the pool's instances; for a prefill pool, "
            "plus the requests waiting for a D reservation (the 'waiting for D' row)") in out
    assert "waiting for D" in out
    assert main(["simulate", *SMALL, "--arm", "colocated"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "summed over the pool's instances" in out and "prefill pool" not in out
