"""``pdproto check --backend torch``: the explorer runs the torch replay backend
along its breadth-first tree and reports kv-corruption like a violation."""

from __future__ import annotations

import json
import sys

import pytest

MUTANTS = {
    "p_frees_source_on_timer": "early-source-free",
    "d_frees_target_on_abort": "early-target-reuse",
    "restart_without_fencing": "early-target-reuse",
    "commit_on_failed_transfer": "commit-before-ready",
    "decode_from_last_prompt_token": "first-token-boundary",
}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _cli(argv, capsys):
    from pdproto._cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _check(argv, capsys):
    rc, out, err = _cli(["check", *argv, "--json"], capsys)
    return rc, json.loads(out)


def test_reference_is_clean_with_the_backend(torch, capsys):
    rc, obj = _check(["--backend", "torch", "--faults", "cancel=1,transfer_fail=1"], capsys)
    assert rc == 0 and obj["ok"] and obj["complete"], obj["violations"]
    assert obj["states"] > 100
    assert obj["backend"]["name"] == "torch" and obj["backend"]["device"] == "cpu"
    assert obj["backend"]["block_size"] == 4  # from the model header's block_size


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_shows_kv_corruption_and_its_invariant(torch, mutant, capsys, tmp_path):
    out = tmp_path / "cx.jsonl"
    rc, obj = _check([mutant, "--backend", "torch", "--out", str(out)], capsys)
    assert rc == 1 and not obj["ok"]
    found = {v["invariant"]: v for v in obj["violations"]}
    assert MUTANTS[mutant] in found, obj["violations"]
    assert "kv-corruption" in found, obj["violations"]
    # both on the same shortest trace
    assert found["kv-corruption"]["length"] == found[MUTANTS[mutant]]["length"]
    # the written history reproduces both on replay
    rc, text, _ = _cli(["replay", str(out), "--json"], capsys)
    rep = json.loads(text)
    assert rc == 1
    invs = {v["invariant"] for v in rep["violations"]}
    assert {"kv-corruption", MUTANTS[mutant]} <= invs
    assert rep["data_violations"] >= 1
    lines = {v["line"] for v in rep["violations"] if v["invariant"] == "kv-corruption"}
    assert found["kv-corruption"]["line"] in lines


def test_backend_without_the_monitor_invariant_keeps_going(torch, capsys):
    # --continue: one shortest trace per invariant, the backend's among them
    rc, obj = _check(["p_frees_source_on_timer", "--backend", "torch", "--continue",
                      "--max-states", "3000"], capsys)
    assert rc == 1
    invs = [v["invariant"] for v in obj["violations"]]
    assert "kv-corruption" in invs and "early-source-free" in invs
    assert len(invs) == len(set(invs))


def test_backend_state_cap(torch, capsys):
    from pdproto._cli._check import BACKEND_MAX_STATES

    rc, out, err = _cli(["check", "--backend", "torch", "--max-states", str(BACKEND_MAX_STATES + 1)], capsys)
    assert rc == 2 and "--max-states" in err
    rc, obj = _check(["--backend", "torch", "--max-states", "500"], capsys)
    assert rc == 0 and obj["truncated"] and obj["partial"] and obj["states"] == 500


def test_device_needs_backend(capsys):
    rc, out, err = _cli(["check", "--device", "cpu"], capsys)
    assert rc == 2 and "--backend" in err


def test_missing_torch_is_one_clear_message(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "pdproto.backends._torch", raising=False)
    rc, out, err = _cli(["check", "--backend", "torch"], capsys)
    assert rc == 2
    assert "pip install 'pdproto[torch]'" in err
    assert "Traceback" not in err


def test_fast_copy_matches_deepcopy(torch):
    """TorchBackend.copy() (used per explored state) behaves like deepcopy:
    branch at every prefix of a corrupting history and finish both."""
    from pdproto.drivers import explore
    from pdproto.drivers import load_model
    from pdproto.backends import TorchBackend

    model, _ = load_model("restart_without_fencing")
    r = explore(model)
    events = r.violations[0].events
    base = TorchBackend(model.header, layers=1, kv_heads=2, head_dim=8)
    for line, ev in enumerate(events, 2):
        a, b = base.copy(), base.deepcopy()
        out = []
        for twin in (a, b):
            twin.apply(ev, line)
            twin.finish()
            out.append([(v.invariant, v.line, v.message) for v in twin.violations])
        assert out[0] == out[1]
        base.apply(ev, line)
    assert base.copy().finish() == base.deepcopy().finish()


# -- a model that is no handoff: its own invariants alone (--no-monitor) --------

COUNTER = __import__("os").path.join(__import__("os").path.dirname(__file__), "_counter_model.py")


def test_no_monitor_counter_model_passes(capsys):
    rc, obj = _check([COUNTER + ":model", "--no-monitor"], capsys)
    assert rc == 0 and obj["ok"] and obj["complete"]
    assert obj["states"] == 16 and obj["met_sometimes"] == ["both-at-limit"]
    assert obj["monitor"] is False
    rc, text, _ = _cli(["check", COUNTER + ":model", "--no-monitor"], capsys)
    assert rc == 0 and "OK" in text and "all 1 reached" in text


def test_no_monitor_counter_model_fails_with_shortest_trace(capsys, tmp_path):
    rc, obj = _check([COUNTER + ":broken", "--no-monitor"], capsys)
    assert rc == 1 and not obj["ok"]
    (v,) = obj["violations"]
    assert v["invariant"] == "within-bound" and v["kind"] == "state-invariant"
    assert v["length"] == 6
    assert {s["actor"] for s in v["trace"]} == {"?"} and all(not s["events"] for s in v["trace"])
    rc, text, _ = _cli(["check", COUNTER + ":broken", "--no-monitor"], capsys)
    assert rc == 1 and "within-bound" in text and "inc(1)" in text


def test_no_monitor_counter_model_unmet_sometimes_fails(capsys, tmp_path):
    path = tmp_path / "never.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {__import__('os').path.dirname(COUNTER)!r})\n"
        "from _counter_model import Counter\n"
        "model = Counter(99)\n"
        "model.sometimes = {'past-limit': lambda s: s[0] > 3}\n"
    )
    rc, obj = _check([f"{path}:model", "--no-monitor"], capsys)
    assert rc == 1 and obj["complete"] and obj["unmet_sometimes"] == ["past-limit"]


def test_policy_and_mode_are_one_flag(capsys):
    rc, by_policy = _check(["--policy", "pull", "--requests", "1", "--faults", "none"], capsys)
    rc2, by_mode = _check(["--mode", "pull", "--requests", "1", "--faults", "none"], capsys)
    assert rc == rc2
    assert by_policy["states"] == by_mode["states"] > 0
    assert by_policy["config"] == by_mode["config"]
    rc, _, err = _cli(["check", "--policy", "sideways"], capsys)
    assert rc == 2 and "sideways" in err


def test_check_table_shows_every_fault(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # issue 18 saw "trans…" on a narrow terminal
    rc, text, _ = _cli(["check", "--requests", "1", "--blocks", "1", "--faults", "all=1",
                        "--max-states", "50"], capsys)
    assert rc == 0  # partial (--max-states stopped it), nothing found: exit 0 as ever
    from pdproto import FAULT_KINDS

    # a long value wraps onto the next lines of its cell, never ends in "…"
    assert "…" not in text
    flat = "".join(c for c in text if not c.isspace() and c not in "│┃")
    for kind in FAULT_KINDS:
        assert f"{kind}=1" in flat, kind
