"""Fuzzing is exactly reproducible without the example database (issue 19):
the same seed, configuration and pdproto version give the same examples,
the same counts and the same shrunk history."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdproto._cli import main

#: the keys of `pdproto fuzz --json` that measure time, not the run
TIMING = {"seconds", "steps_per_second", "examples_per_second", "cpu_seconds", "phase_seconds"}


def _run(args, capsys, out=None):
    extra = ["--out", str(out)] if out is not None else []
    rc = main(["fuzz", *args, "--no-database", "--json", *extra])
    result = json.loads(capsys.readouterr().out)
    return rc, {k: v for k, v in result.items() if k not in TIMING}


@pytest.mark.parametrize("args", [
    ["stale-completion-commits-retry", "--examples", "300", "--steps", "100", "--seed", "1"],
    ["cancel-queued-at-d-strands-p", "--examples", "300", "--steps", "100", "--seed", "4"],
    ["--examples", "8", "--steps", "200", "--seed", "7"],
])
def test_same_seed_same_run(args, capsys, tmp_path, monkeypatch):
    """Two runs: the same counters (examples, steps, distinct states, action
    and fault kinds, the example that first failed), the same shrunk trace,
    byte for byte the same history file."""
    monkeypatch.chdir(tmp_path)
    first_out, second_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rc1, first = _run(args, capsys, first_out)
    rc2, second = _run(args, capsys, second_out)
    assert rc1 == rc2
    first.pop("out", None), second.pop("out", None)
    assert first == second
    assert first["steps"] > 0 and first["distinct_states"] > 1
    if rc1 == 1:
        assert first["violation"]["trace"] and first_out.read_bytes() == second_out.read_bytes()


def test_other_seed_other_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a = _run(["--examples", "4", "--steps", "200", "--seed", "1"], capsys)
    _, b = _run(["--examples", "4", "--steps", "200", "--seed", "2"], capsys)
    assert a["action_kinds"] != b["action_kinds"]


def test_same_run_in_another_process(capsys, tmp_path, monkeypatch):
    """String hashing differs between processes (PYTHONHASHSEED); the run does not."""
    monkeypatch.chdir(tmp_path)
    args = ["fuzz", "restart-without-fencing", "--examples", "300", "--steps", "100", "--seed", "2",
            "--no-database", "--json"]
    _, here = _run(args[1:-2], capsys)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    proc = subprocess.run([sys.executable, "-m", "pdproto", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    there = {k: v for k, v in json.loads(proc.stdout).items() if k not in TIMING}
    assert here == there
