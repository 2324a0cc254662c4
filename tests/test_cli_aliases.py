"""A flag that meant two things has an unambiguous name beside it (issue 28):
each new name gives exactly what its old spelling gives, and the old one keeps
working."""

import json
import os
import subprocess
import sys

import pytest

from pdproto._cli import main

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "examples")

#: keys that measure the run, not its answer
_TIMING = ("seconds", "cpu_seconds", "states_per_second", "steps_per_second", "examples_per_second",
           "phase_seconds", "eta_seconds", "wall_s", "sim_requests_per_wall_s")


def _json(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    obj = json.loads(out.out)
    return rc, _answer(obj)


def _answer(obj):
    """``obj`` without what measures the run (times, rates, memory)."""
    if isinstance(obj, dict):
        return {k: _answer(v) for k, v in obj.items() if k not in _TIMING and not k.endswith("_rss")}
    if isinstance(obj, list):
        return [_answer(v) for v in obj]
    return obj


@pytest.mark.parametrize(
    "new, old",
    [
        (["--processes", "2"], ["--workers", "2"]),
        (["--pd-workers", "2:1"], ["--workers", "2:1"]),
        (["--pd-workers", "2:1", "--processes", "2"], ["--workers", "2:1", "--workers", "2"]),
    ],
)
def test_check_processes_and_pd_workers_are_the_two_meanings_of_workers(new, old, capsys):
    base = ["check", "--requests", "1", "--json"]
    assert _json(base + new, capsys) == _json(base + old, capsys)


def test_check_pd_workers_is_not_a_process_count(capsys):
    two_p = _json(["check", "--requests", "1", "--json", "--pd-workers", "2:1"], capsys)[1]
    procs = _json(["check", "--requests", "1", "--json", "--processes", "2"], capsys)[1]
    assert two_p["transitions"] != procs["transitions"]  # a 2 P / 1 D model, not 2 processes
    assert procs["workers"] == 2 and "workers" not in two_p


@pytest.mark.parametrize(
    "new, old",
    [
        (["--processes", "2"], ["--workers", "2"]),
        (["--pd-workers", "2:2"], ["--workers", "2:2"]),
    ],
)
def test_fuzz_processes_and_pd_workers_are_the_two_meanings_of_workers(new, old, capsys):
    base = ["fuzz", "--examples", "20", "--seed", "3", "--no-database", "--json"]
    assert _json(base + new, capsys) == _json(base + old, capsys)


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["check", "--processes", "0"], "--processes", "0"),
        (["check", "--pd-workers", "2"], "--pd-workers", "2"),
        (["fuzz", "--processes", "2:2"], "--processes", "2:2"),
        (["fuzz", "--pd-workers", "x:1"], "--pd-workers", "x:1"),
    ],
)
def test_a_bad_value_names_the_flag_it_came_with(argv, flag, value, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    line = err.strip()
    assert "\n" not in line and f"argument {flag}: " in line and value in line.split(": ", 2)[2]
    assert "Traceback" not in err


def test_simulate_llm_is_model(capsys):
    base = ["simulate", "--requests", "20", "--seed", "1", "--json"]
    rc_new, new = _json(base + ["--llm", "llama-3-8b"], capsys)
    rc_old, old = _json(base + ["--model", "llama-3-8b"], capsys)
    assert rc_new == rc_old == 0 and new == old
    assert main(["simulate", "--requests", "5", "--llm", "no-such-llm"]) == 2
    assert "no-such-llm" in capsys.readouterr().err


def test_replay_transformer_is_model():
    pytest.importorskip("transformers")
    path = os.path.join(EXAMPLES, "clean-push.jsonl")

    def replay(flag):  # a fresh process each: the colocated reference run is cached per process
        done = subprocess.run([sys.executable, "-m", "pdproto", "replay", path, flag, "tiny-llama", "--json"],
                              capture_output=True, text=True, timeout=300)
        return done.returncode, _answer(json.loads(done.stdout))

    rc_new, new = replay("--transformer")
    rc_old, old = replay("--model")
    assert rc_new == rc_old == 0
    assert new["backend"]["model"] == old["backend"]["model"]
    assert new["backend"]["model"]["name"] == "tiny-llama"
