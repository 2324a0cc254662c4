"""pdproto.testing, `pdproto fuzz` and the pytest plugin (issue 4)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import get_state_machine_test

from pdproto._cli import main
from pdproto.protocol._config import ModelConfig
from pdproto.drivers._explore import explore
from pdproto.drivers._loader import list_models, load_model
from pdproto.protocol._reference import HandoffModel
from pdproto.testing import handoff_machine, pick_failure

pytest_plugins = ["pytester"]

#: every mutant must be found within this many examples (the issue's target)
MUTANT_BUDGET = 2000
MUTANTS = [name for name, expected, _ in list_models() if expected]


def fuzz(machine, examples, steps, s=0, database=None):
    test = get_state_machine_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=database,
        suppress_health_check=list(HealthCheck), print_blob=False))
    test = seed(s)(test)
    try:
        test()
    except Exception as exc:
        failure = pick_failure(exc)
        if failure is None:
            raise
        return failure
    return None


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_reference_larger_than_exhaustive_is_clean(mode):
    model = HandoffModel(ModelConfig.all_faults(1, mode=mode, requests=4, prefill_workers=2,
                                                decode_workers=2, blocks=2))
    machine = handoff_machine(model)
    assert fuzz(machine, examples=15, steps=200) is None
    st = machine.stats
    assert st.distinct_states > 1000
    assert set(st.faults) >= {"cancel", "timeout", "restart", "retry"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_reference_larger_deeper(mode):
    model = HandoffModel(ModelConfig.all_faults(2, mode=mode, requests=4, prefill_workers=2,
                                                decode_workers=2, blocks=3))
    assert fuzz(handoff_machine(model), examples=40, steps=300, s=1) is None


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_found_and_shrunk(name, tmp_path):
    model, info = load_model(name)
    shortest = explore(model).failures[0]
    out = tmp_path / "failure.jsonl"
    machine = handoff_machine(model, out=out)
    failure = fuzz(machine, examples=MUTANT_BUDGET, steps=100)
    assert failure is not None, f"{name} not found in {MUTANT_BUDGET} examples"
    assert failure.violation.invariant == info.expected
    assert machine.stats.found_at <= MUTANT_BUDGET
    assert len(failure.trace) <= 1.5 * len(shortest.trace), (len(failure.trace), len(shortest.trace))
    # the written history audits to the same invariant
    assert main(["audit", "--json", str(out)]) == 1


def test_cli_fuzz_out_audits_same_invariant(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "f.jsonl"
    rc = main(["fuzz", "d-frees-target-on-abort", "--examples", "500", "--steps", "50", "--seed", "3",
               "--out", str(out), "--json"])
    assert rc == 1
    result = json.loads(capsys.readouterr().out)
    assert result["violation"]["invariant"] == "early-target-reuse"
    for key in ("examples", "steps", "steps_per_second", "examples_per_second", "distinct_states",
                "action_kinds", "fault_kinds", "seed", "out"):
        assert key in result
    assert main(["audit", "--json", str(out)]) == 1
    audit = json.loads(capsys.readouterr().out)
    assert "early-target-reuse" in json.dumps(audit)


def test_seed_repeatable(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = []
    for _ in range(2):
        assert main(["fuzz", "--examples", "5", "--steps", "60", "--seed", "7", "--no-database", "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        runs.append((r["steps"], r["distinct_states"], r["action_kinds"], r["fault_kinds"]))
    assert runs[0] == runs[1]


def test_database_replays_failure_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fuzz", "stale-completion-commits-retry", "--examples", "2000", "--steps", "100", "--json"]
    assert main(args + ["--seed", "1"]) == 1
    first = json.loads(capsys.readouterr().out)
    assert main(args + ["--seed", "2"]) == 1
    second = json.loads(capsys.readouterr().out)
    assert second["found_at_example"] == 1
    assert second["violation"]["invariant"] == first["violation"]["invariant"]


def test_coverage_fraction(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "p-frees-source-on-timer", "--mode", "pull", "--faults", "none",
                 "--examples", "5", "--steps", "50", "--seed", "1", "--coverage-exhaustive",
                 "--json", "--no-database"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["reachable_states"] and 0 < r["coverage"] <= 1


@pytest.mark.parametrize("args", [["--workers", "2x2"], ["--workers", "0:1"], ["no-such-model"],
                                  ["--examples", "0"]])
def test_bad_input_exit_2(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        rc = main(["fuzz", *args, "--json"])
        raise SystemExit(rc)
    assert exc.value.code == 2


def test_backend_factory_gets_every_event():
    seen = []

    class Recorder:
        def __init__(self, header):
            pass

        def apply(self, event, line):
            seen.append(line)
            return []

        def finish(self):
            return []

    model = HandoffModel(ModelConfig(requests=1, blocks=1))
    assert fuzz(handoff_machine(model, backend=Recorder), examples=3, steps=20) is None
    assert seen


def test_import_pdproto_is_light():
    import subprocess
    import sys

    code = "import sys, pdproto; print(any(m in sys.modules for m in ('hypothesis', 'rich', 'torch')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


USER_TEST = '''
from pdproto import HandoffModel, ModelConfig

def test_my_model(pdproto_fuzz):
    stats = pdproto_fuzz(HandoffModel(ModelConfig(requests=2, blocks=1, faults={"cancel": 1})))
    assert stats.examples > 0 and stats.distinct_states > 1
'''


def _plugin_installed() -> bool:
    """Whether pdproto is installed with its pytest11 entry point (then
    pytest loads the plugin by itself; naming it again with -p is an error)."""
    from importlib.metadata import entry_points

    return any(ep.value == "pdproto._pytest_plugin" for ep in entry_points(group="pytest11"))


def test_pytest_plugin(pytester):
    pytester.makepyfile(test_user=USER_TEST)
    load = [] if _plugin_installed() else ["-p", "pdproto._pytest_plugin"]
    result = pytester.runpytest(*load, "--pdproto-profile", "quick", "-q")
    result.assert_outcomes(passed=1)


def test_backend_sees_each_history_exactly_once_in_order():
    """After the machine backs up, a fresh backend must replay the kept
    history: every backend's lines run 2, 3, 4, ... without gaps."""
    runs = []

    class Recorder:
        def __init__(self, header):
            self.lines = []
            runs.append(self.lines)

        def apply(self, event, line):
            self.lines.append(line)
            return []

        def finish(self):
            return []

    model = HandoffModel(ModelConfig.all_faults(1, requests=2, blocks=1))
    assert fuzz(handoff_machine(model, backend=Recorder), examples=10, steps=200) is None
    assert len(runs) > 10
    for lines in runs:
        assert lines == list(range(2, 2 + len(lines)))


def test_torch_backend_fuzz_clean_and_mutant(tmp_path):
    pytest.importorskip("torch")
    for s in (0, 1):
        assert main(["fuzz", "--backend", "torch", "--examples", "10", "--seed", str(s),
                     "--no-database", "--json"]) == 0
    out = tmp_path / "cx.jsonl"
    assert main(["fuzz", "d-frees-target-on-abort", "--backend", "torch", "--examples", "300",
                 "--seed", "0", "--no-database", "--json", "--out", str(out)]) == 1
    assert main(["replay", str(out), "--json"]) == 1
