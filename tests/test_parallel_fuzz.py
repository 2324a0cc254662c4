"""The parallel fuzzer (issue 16, item 3): `pdproto fuzz --workers N` and
`--ray`, and the pytest plugin under pytest-xdist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from pdproto import fuzz, load_model
from pdproto._cli import main
from pdproto.drivers import max_local_workers, merge, plan, split_examples, worker_seed

pytest_plugins = ["pytester"]

#: three mutants of each family (push, pull)
MUTANTS = [
    "d-frees-target-on-abort", "stale-completion-commits-retry", "restart-without-fencing",
    "p-frees-source-on-timer", "lost-handoff-strands-source", "decode-waits-on-first-attempt-id",
]
#: the keys of a fuzz result that measure time, not the run
TIMING = {"seconds", "steps_per_second", "examples_per_second", "cpu_seconds", "phase_seconds"}


def _untimed(result):
    d = result.to_dict()
    runs = [{k: v for k, v in r.items() if k != "seconds"} for r in d.pop("worker_runs", [])]
    return {k: v for k, v in d.items() if k not in TIMING}, runs


def test_families_of_the_mutants():
    assert {load_model(m)[1].config.policy for m in MUTANTS[:3]} == {"push"}
    assert {load_model(m)[1].config.policy for m in MUTANTS[3:]} == {"pull"}


@pytest.mark.parametrize("name", MUTANTS)
def test_two_workers_find_what_serial_finds(name):
    model, info = load_model(name)
    serial = fuzz(model, examples=300, steps=100, seed=0, database=None)
    parallel = fuzz(model, examples=300, steps=100, seed=0, database=None, workers=2)
    assert serial.violation is not None and parallel.violation is not None
    assert parallel.violation.invariant == serial.violation.invariant
    assert parallel.counters["workers"] == 2 and serial.counters["workers"] == 1
    found = parallel.counters["invariants_found"]
    assert parallel.violation.invariant in found
    # the reported failure is the shortest any worker found: each share run alone
    alone = [fuzz(model, examples=s.examples, steps=100, seed=s.seed, database=None) for s in plan(300, 2, 0)]
    lengths = [(len(a.failure.trace), i) for i, a in enumerate(alone) if a.failure is not None]
    assert lengths and len(parallel.failure.trace) == min(lengths)[0]
    assert parallel.counters["found_by_worker"] == min(lengths)[1]
    assert parallel.counters["found_at_example"] == alone[min(lengths)[1]].counters["found_at_example"]


def test_counts_add_up_to_the_budget_and_merge_exactly():
    """A clean run: 7 examples over 2 workers are 4 + 3, and the merged
    counters are the sums (distinct states: the union) of running each
    worker's share alone with its seed."""
    model, _ = load_model("reference")
    result = fuzz(model, examples=7, steps=80, seed=5, database=None, workers=2)
    assert result.ok
    c = result.counters
    runs = c["worker_runs"]
    assert [r["examples"] for r in runs] == [4, 3] and c["examples"] == 7
    assert c["steps"] == sum(r["steps"] for r in runs) == sum(c["action_kinds"].values())
    shares = plan(7, 2, 5)
    alone = [fuzz(model, examples=s.examples, steps=80, seed=s.seed, database=None) for s in shares]
    assert [a.counters["steps"] for a in alone] == [r["steps"] for r in runs]
    union = set().union(*(a.stats.states for a in alone))
    assert result.stats.states == union and c["distinct_states"] == len(union)
    again = merge(alone, shares, workers=2, seed=5, seconds=1.0, name=result.model, expected=None)
    assert _untimed(again) == _untimed(result)


def test_same_seed_same_merged_result_other_seed_other():
    model, _ = load_model("reference")
    a, b, c = (fuzz(model, examples=4, steps=100, seed=s, database=None, workers=2) for s in (3, 3, 4))
    assert _untimed(a) == _untimed(b)

    def walked(r):  # what the runs did, not the seed they report
        return ([w["steps"] for w in r.counters["worker_runs"]], r.counters["distinct_states"],
                r.counters["action_kinds"])

    assert walked(a) == walked(b)
    assert [w["steps"] for w in a.counters["worker_runs"]] != [w["steps"] for w in c.counters["worker_runs"]]
    assert walked(a) != walked(c)


def test_distinct_seeds_per_worker():
    seeds = [worker_seed(7, i) for i in range(16)]
    assert len(set(seeds)) == 16 and seeds == [worker_seed(7, i) for i in range(16)]
    assert worker_seed(7, 0) != worker_seed(8, 0)
    model, _ = load_model("reference")
    result = fuzz(model, examples=4, steps=30, seed=7, database=None, workers=2)
    assert [r["seed"] for r in result.counters["worker_runs"]] == seeds[:2]
    assert result.seed == 7


def test_split_examples():
    assert split_examples(10, 3) == [4, 3, 3]
    assert split_examples(1, 3) == [1]  # no entry for an idle worker
    assert split_examples(0, 3) == [0]
    assert [s.examples for s in plan(1, 3, 0)] == [1]  # idle workers are not started
    for n, w in [(0, 1), (5, 5), (200, 7)]:
        assert sum(split_examples(n, w)) == n
    # a huge worker count is split over the examples only, at once
    assert split_examples(2, 10**20) == [1, 1]
    assert [(s.worker, s.examples) for s in plan(2, 10**7, 0)] == [(0, 1), (1, 1)]


def test_workers_far_above_the_cpus_refused(tmp_path, capsys, monkeypatch):
    from pdproto import UsageError
    from pdproto.drivers import max_local_workers

    limit = max_local_workers()
    model, _ = load_model("reference")
    with pytest.raises(UsageError) as exc:
        fuzz(model, examples=2, steps=10, seed=0, database=None, workers=limit + 1)
    assert exc.value.value == limit + 1
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--workers", "99999999999999999999", "--examples", "2", "--no-database", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workers: 99999999999999999999" in err[0] and str(limit) in err[0]


def test_workers_reports_the_shares_that_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = min(8, max_local_workers())
    assert main(["fuzz", "--workers", str(asked), "--examples", "3", "--steps", "20", "--seed", "1",
                 "--no-database", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["worker_runs"]) == 3 and r["workers"] == 3 and r["workers_requested"] == asked
    assert r["found_by_worker"] is None


def _capture_ray(monkeypatch):
    """Replace run_ray: record the workers it is asked for, run nothing."""
    import pdproto.drivers._ray_fuzz as ray_fuzz

    asked = []

    class Stop(Exception):
        pass

    def fake(model, examples, workers, seed, options, *, address=None):
        asked.append(workers)
        raise Stop

    monkeypatch.setattr(ray_fuzz, "run_ray", fake)
    return asked, Stop


def test_workers_one_with_ray_is_one_task(tmp_path, monkeypatch, capsys):
    """--workers 1 --ray asks for one task; only --ray without --workers asks
    for the cluster's CPUs (None)."""
    asked, Stop = _capture_ray(monkeypatch)
    model, _ = load_model("reference")
    for workers in (1, None, 3):
        with pytest.raises(Stop):
            fuzz(model, examples=4, steps=10, seed=0, database=None, workers=workers, ray=True)
    assert asked == [1, None, 3]
    monkeypatch.chdir(tmp_path)
    asked.clear()
    for flags in (["--workers", "1"], []):
        with pytest.raises(Stop):
            main(["fuzz", "--ray", *flags, "--examples", "4", "--steps", "10", "--no-database", "--json"])
    assert asked == [1, None]


def _fake_ray(monkeypatch, message):
    """A ray module whose init fails as Ray's does on a bad address."""
    import types

    def init(address=None, **kw):
        raise ValueError(message)

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init, shutdown=lambda: None)
    monkeypatch.setitem(sys.modules, "ray", fake)


def test_ray_bad_address_names_the_address(tmp_path, monkeypatch, capsys):
    _fake_ray(monkeypatch, "Invalid address format: ")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--ray=", "--examples", "2", "--no-database", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ray: '' is not allowed" in err[0] and "a local instance" not in err[0]
    monkeypatch.setenv("RAY_ADDRESS", "nowhere:1")
    assert main(["fuzz", "--ray", "--examples", "2", "--no-database", "--json"]) == 2
    assert "RAY_ADDRESS: 'nowhere:1'" in capsys.readouterr().err


def test_no_seed_draws_one_that_repeats_the_run():
    model, _ = load_model("reference")
    first = fuzz(model, examples=2, steps=40, database=None, workers=2)
    assert isinstance(first.seed, int)
    again = fuzz(model, examples=2, steps=40, seed=first.seed, database=None, workers=2)
    assert _untimed(first) == _untimed(again)


def test_one_database_replays_a_workers_failure_first(tmp_path, monkeypatch):
    """A failure a worker saved is fetched from the shared database, and
    replayed, by the workers of the next parallel run (any seed) and by a
    serial unseeded one, before anything is generated; a serial seeded run
    and a run on another directory fetch nothing."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    log = tmp_path / "fetched"
    fetch = DirectoryBasedExampleDatabase.fetch

    def logged(self, key):
        values = list(fetch(self, key))
        with open(log, "a") as f:  # the workers are forked: they inherit this, and append
            f.write(f"{os.getpid()} {len(values)} {os.path.basename(self.path)}\n")
        yield from values

    monkeypatch.setattr(DirectoryBasedExampleDatabase, "fetch", logged)

    def fetched(directory="db"):
        """The values each process fetched (sorted), all from ``directory``."""
        rows = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        assert {row[2] for row in rows} <= {directory}
        per_pid = {}
        for pid, n, _ in rows:
            per_pid[pid] = per_pid.get(pid, 0) + int(n)
        return sorted(per_pid.values())

    db = str(tmp_path / "db")
    model, _ = load_model("restart-without-fencing")
    assert not os.path.exists(db)
    first = fuzz(model, examples=50, steps=100, seed=0, database=db, workers=2)
    assert first.violation is not None and os.listdir(db)
    # the first run started on an empty database; a worker that starts late (a loaded
    # machine) may already fetch the failure another worker saved, so at most one each
    assert len(fetched()) == 2
    for workers, seed in ((1, None), (2, 99)):
        later = fuzz(model, examples=50, steps=100, seed=seed, database=db, workers=workers)
        assert later.violation.invariant == first.violation.invariant
        counts = fetched()
        # every worker asks the shared database; one may find it empty for a moment while
        # another rewrites the failure it replayed (Hypothesis re-saves what it shrinks)
        assert len(counts) == workers and max(counts) >= 1
    fuzz(model, examples=50, steps=100, seed=0, database=db)  # serial and seeded: no database
    assert fetched() == []
    # another directory: each worker asks it, and nothing of "db" is fetched; both workers find
    # the bug within 5 examples, so one that starts late (a loaded machine, a large process to
    # fork) may fetch what the other just saved there
    fuzz(model, examples=5, steps=100, seed=99, database=str(tmp_path / "other"), workers=2)
    counts = fetched("other")
    assert len(counts) == 2 and min(counts) == 0


def test_serial_seeded_runs_repeat_with_a_database(tmp_path, monkeypatch, capsys):
    """As at 0aac5b2: a serial --seed run is the same run every time, with
    the example database on (the default) - the first run's failure is not
    replayed by the second."""
    db = str(tmp_path / "db")
    model, _ = load_model("restart-without-fencing")
    runs = [fuzz(model, examples=200, steps=100, seed=0, database=db) for _ in range(2)]
    assert runs[0].violation is not None
    assert _untimed(runs[0]) == _untimed(runs[1])
    assert runs[0].counters["found_at_example"] == runs[1].counters["found_at_example"] > 1
    assert not os.path.exists(db) or not os.listdir(db)  # nothing saved either
    monkeypatch.chdir(tmp_path)
    got = []
    for _ in range(2):
        assert main(["fuzz", "restart-without-fencing", "--seed", "0", "--examples", "200", "--steps", "100",
                     "--json"]) == 1
        r = json.loads(capsys.readouterr().out)
        got.append((r["found_at_example"], r["examples"], r["steps"]))
    assert got[0] == got[1] == (runs[0].counters["found_at_example"], runs[0].counters["examples"],
                                runs[0].counters["steps"])


def test_cli_workers_json_and_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "f.jsonl"
    rc = main(["fuzz", "d-frees-target-on-abort", "--workers", "2", "--examples", "40", "--steps", "50",
               "--seed", "3", "--out", str(out), "--json", "--no-database"])
    assert rc == 1
    r = json.loads(capsys.readouterr().out)
    assert r["workers"] == 2 and r["violation"]["invariant"] == "early-target-reuse" and r["out"] == str(out)
    assert r["examples"] == sum(w["examples"] for w in r["worker_runs"])
    assert main(["audit", "--json", str(out)]) == 1
    assert "early-target-reuse" in capsys.readouterr().out


def test_cli_both_forms_of_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--workers", "2", "--workers", "2:1", "--requests", "2", "--examples", "3",
                 "--steps", "30", "--seed", "1", "--json", "--no-database"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workers"] == 2 and r["examples"] == 3


def test_cli_report_names_the_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--workers", "2", "--examples", "3", "--steps", "30", "--seed", "1",
                 "--no-database"]) == 0
    text = capsys.readouterr().out
    assert "workers" in text and "2 (examples 2, 1" in text


@pytest.mark.parametrize("args", [
    ["--workers", "0"], ["--workers", "2", "--workers", "3"], ["--workers", "1:1", "--workers", "2:2"],
    ["--workers", "two"], ["--adapter", "model:reference", "--ray"],
    ["--workers", "2", "--backend", "torch", "--device", "cuda"],
])
def test_cli_bad_parallel_input_one_line_exit_2(args, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", *args, "--examples", "2", "--json"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_ray_missing_names_the_extra(monkeypatch):
    from pdproto import MissingExtraError
    from pdproto.drivers import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError) as exc:
        import_ray()
    assert "pip install 'pdproto[ray]'" in str(exc.value)


RAY_SCRIPT = textwrap.dedent("""
    import json, ray
    from pdproto import fuzz, load_model
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    TIMING = {"seconds", "steps_per_second", "examples_per_second", "cpu_seconds", "phase_seconds"}
    def untimed(r):
        d = {k: v for k, v in r.to_dict().items() if k not in TIMING}
        d["worker_runs"] = [{k: v for k, v in w.items() if k != "seconds"} for w in d["worker_runs"]]
        return d
    model, _ = load_model("reference")
    out = {"ray": untimed(fuzz(model, examples=5, steps=60, seed=4, database=None, ray=True, workers=2)),
           "processes": untimed(fuzz(model, examples=5, steps=60, seed=4, database=None, workers=2))}
    for name in ("d-frees-target-on-abort", "p-frees-source-on-timer"):
        found = fuzz(load_model(name)[0], examples=50, steps=100, seed=0, database=None, ray=True)
        out[name] = [found.violation.invariant, load_model(name)[1].expected, found.counters["workers"]]
    ray.shutdown()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_ray_two_cpus_same_result_as_processes(tmp_path):
    """On a local Ray instance of 2 CPUs: the same merged result as worker
    processes, and the mutants found with one task per CPU.  In a fresh
    interpreter: Hypothesis draws some values from the constants of the
    local modules loaded (this test file's, under pytest), and a forked
    worker inherits the modules its parent loaded while a Ray task does not."""
    pytest.importorskip("ray")
    proc = subprocess.run([sys.executable, "-c", RAY_SCRIPT], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ray"] == out["processes"]
    assert out["ray"]["workers"] == 2 and out["ray"]["examples"] == 5
    for name in ("d-frees-target-on-abort", "p-frees-source-on-timer"):
        invariant, expected, workers = out[name]
        assert invariant == expected and workers == 2  # one task per CPU of the instance


XDIST_TESTS = textwrap.dedent("""
    import pytest
    from pdproto import load_model
    from pdproto.testing import HandoffFailure

    @pytest.mark.parametrize("name", ["reference", "reference"])
    def test_clean(pdproto_fuzz, name):
        stats = pdproto_fuzz(load_model(name)[0], examples=3, steps=40)
        assert stats.steps > 0

    @pytest.mark.parametrize("name", ["d-frees-target-on-abort", "p-frees-source-on-timer"])
    def test_mutant(pdproto_fuzz, name, tmp_path):
        with pytest.raises(HandoffFailure) as exc:
            pdproto_fuzz(load_model(name)[0], examples=50, steps=60, out=tmp_path / "f.jsonl")
        assert (tmp_path / "f.jsonl").exists()
        assert exc.value.violation.invariant == load_model(name)[1].expected
""")


@pytest.mark.slow
def test_plugin_under_xdist(pytester):
    """The pdproto_fuzz fixture in two xdist workers: each test fuzzes in its
    own process, failures and histories included."""
    pytester.makepyfile(test_handoff=XDIST_TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "--pdproto-profile", "quick",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*2 workers*"])


def test_a_worker_that_crashes_is_named(capsys, tmp_path, monkeypatch):
    """A model that raises (not a violation) in a worker: FuzzWorkerError
    naming the worker and the error, one line from the CLI (exit 2)."""
    from pdproto.drivers import FuzzWorkerError

    model, _ = load_model("reference")

    class Broken(type(model)):
        def step(self, state, action):
            raise RuntimeError("boom in step")

    with pytest.raises(FuzzWorkerError) as exc:
        fuzz(Broken(model.config), examples=2, steps=20, seed=0, database=None, workers=2)
    # both workers crash; the first to report is named (they run at once)
    assert exc.value.worker in (0, 1) and "boom in step" in str(exc.value)
    assert "Traceback" in exc.value.detail
    monkeypatch.chdir(tmp_path)
    broken = tmp_path / "broken_model.py"
    broken.write_text("from pdproto import HandoffModel\n\nclass Broken(HandoffModel):\n"
                      "    def step(self, state, action):\n        raise RuntimeError('boom in step')\n\n"
                      "model = Broken()\n")
    assert main(["fuzz", str(broken), "--workers", "2", "--examples", "2", "--steps", "20", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"fuzz worker [01] failed", err[0]) and "RuntimeError: boom in step" in err[0]


def test_coverage_of_the_merged_states(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "p-frees-source-on-timer", "--mode", "pull", "--faults", "none", "--examples", "6",
                 "--steps", "50", "--seed", "1", "--coverage-exhaustive", "--json", "--no-database",
                 "--workers", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workers"] == 2 and r["reachable_states"]
    assert r["coverage"] == round(r["distinct_states"] / r["reachable_states"], 5)
    assert r["distinct_states"] >= max(w["distinct_states"] for w in r["worker_runs"])


def test_a_crash_is_reported_while_other_workers_still_run(monkeypatch):
    """Worker 1 crashes at once while worker 0 would run for a minute: the
    crash is reported within seconds (replies are read as they come), and
    worker 0's process is terminated."""
    import time

    import pdproto.drivers._parallel_fuzz as pf

    started = []

    def share_run(model, share, options):  # forked: the children run this
        if share.worker == 0:
            time.sleep(60)
        raise RuntimeError(f"boom in worker {share.worker}")

    monkeypatch.setattr(pf, "run_share", share_run)
    process = pf.multiprocessing.get_context("fork").Process
    real_start = process.start

    def start(self):
        real_start(self)
        started.append(self)

    monkeypatch.setattr(process, "start", start)
    model, _ = load_model("reference")
    t0 = time.perf_counter()
    with pytest.raises(pf.FuzzWorkerError) as exc:
        pf.run_processes(model, plan(2, 2, 0), {})
    assert exc.value.worker == 1 and "boom in worker 1" in str(exc.value)
    assert time.perf_counter() - t0 < 20
    assert len(started) == 2 and not any(p.is_alive() for p in started)
