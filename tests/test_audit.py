"""``pdproto audit``: the documented result of every example, exit codes,
JSON output and clean errors."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import EXAMPLES, ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import Monitor
from pdproto._cli import main
from test_history import events as event_strategy

EXAMPLE_FILES = sorted(glob.glob(os.path.join(EXAMPLES, "*.jsonl")))


def test_examples_exist():
    names = {os.path.basename(p)[:-6] for p in EXAMPLE_FILES}
    assert {"clean-push", "clean-pull", "cancel-mid-transfer"} <= names
    from pdproto import INVARIANTS

    assert set(INVARIANTS) <= names  # one buggy history per invariant


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=os.path.basename)
def test_example_gives_its_documented_result(path, capsys):
    with open(path, encoding="utf-8") as fh:
        expect = json.loads(fh.readline())["expect"]
    code = main(["audit", "--json", path])
    out = json.loads(capsys.readouterr().out)
    got = [{k: v[k] for k in ("invariant", "line", "witness")} for v in out["violations"]]
    assert got == expect
    assert out["ok"] is (not expect)
    assert code == (1 if expect else 0)
    assert set(out) >= {"ok", "events", "violations"}


def test_examples_say_what_replay_adds():
    """Every header has replay_expect: kv-corruption lines inside the history,
    after the audit's first violation (the bug comes first, the damage later),
    and none for a clean example."""
    for path in EXAMPLE_FILES:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        header = json.loads(lines[0])
        replay = header["replay_expect"]
        assert all(set(r) == {"invariant", "line"} and r["invariant"] == "kv-corruption" for r in replay), path
        assert all(2 <= r["line"] <= len(lines) for r in replay), path
        if not header["expect"]:
            assert replay == [], path
        elif replay:
            assert min(r["line"] for r in replay) >= min(v["line"] for v in header["expect"]), path


def test_format_1_1_examples_cover_every_feature():
    """Clean and violating examples for the features of format 1.1; a version
    1 example declares none."""
    used: dict[str, set[bool]] = {}
    for path in EXAMPLE_FILES:
        with open(path, encoding="utf-8") as fh:
            header = json.loads(fh.readline())
        if header["version"] == 1:
            assert "features" not in header and "kv" not in header, path
            continue
        assert header["version"] == "1.1"
        for feature in header["features"]:
            used.setdefault(feature, set()).add(not header["expect"])
    assert used["share"] == {True, False} and used["ranges"] == {True, False}
    assert {"kv", "parallel"} <= set(used)


def test_examples_are_up_to_date(tmp_path, monkeypatch):
    import make_examples

    monkeypatch.setattr(make_examples, "HERE", str(tmp_path))
    make_examples.main()
    for path in EXAMPLE_FILES:
        if os.path.basename(path).startswith("vllm-"):
            continue  # recorded from the real vLLM engine (tests/test_vllm_adapter.py), not written by hand
        with open(path, encoding="utf-8") as a, open(tmp_path / os.path.basename(path), encoding="utf-8") as b:
            assert a.read() == b.read(), f"{path} is stale: run python docs/examples/make_examples.py"


def test_json_shape(capsys):
    code = main(["audit", "--json", os.path.join(EXAMPLES, "double-commit.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["ok"] is False and out["events"] == 10
    (v,) = out["violations"]
    assert set(v) == {"invariant", "line", "message", "witness", "request", "gen"}
    assert v["request"] == "r1" and v["gen"] == 0
    assert v["invariant"] == "double-commit" and "request 'r1' gen 0" in v["message"]


def test_rich_report_names_lines_and_witnesses(capsys):
    code = main(["audit", os.path.join(EXAMPLES, "early-target-reuse.jsonl")])
    out = capsys.readouterr().out
    assert code == 1
    assert "early-target-reuse" in out and "10" in out and "1 violation(s)" in out


def test_clean_report(capsys):
    assert main(["audit", os.path.join(EXAMPLES, "clean-push.jsonl")]) == 0
    assert "no invariant violated" in capsys.readouterr().out


def test_complete_flag_forces_end_checks(tmp_path, capsys):
    path = tmp_path / "h.jsonl"
    path.write_text('{"ev": "submit", "request": "r", "gen": 0, "prompt_len": 3}\n')
    assert main(["audit", str(path)]) == 0
    capsys.readouterr()
    assert main(["audit", "--json", "--complete", str(path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [v["invariant"] for v in out["violations"]] == ["stuck"]


def test_policy_flag_overrides_header(capsys):
    path = os.path.join(EXAMPLES, "reserve-before-prefill.jsonl")
    assert main(["audit", "--policy", "pull", path]) == 0


def test_skip(capsys):
    path = os.path.join(EXAMPLES, "ticket-mismatch.jsonl")
    assert main(["audit", "--skip", "ticket-mismatch", "--json", path]) == 0


def test_unknown_skip_is_bad_input(capsys):
    code = main(["audit", "--skip", "no-such", os.path.join(EXAMPLES, "clean-push.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "'no-such'" in err and "double-allocation" in err


def test_malformed_file_exit_2_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ev": "submit", "request": "r", "gen": 0, "prompt_len": 3}\n{"ev": "warp", "request": "r"}\n')
    code = main(["audit", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}:2:" in err and "'warp'" in err and "Traceback" not in err


def test_unreadable_file_exit_2(capsys):
    assert main(["audit", "/nonexistent/trace.jsonl"]) == 2
    assert "/nonexistent/trace.jsonl" in capsys.readouterr().err


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "pdproto", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_stdin_and_process_exit_codes():
    with open(os.path.join(EXAMPLES, "double-commit.jsonl"), encoding="utf-8") as fh:
        text = fh.read()
    proc = _cli("audit", "--json", "-", stdin=text)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["violations"][0]["invariant"] == "double-commit"
    proc = _cli("audit", "-", stdin='{"ev": 1}\n')
    assert proc.returncode == 2 and "<stdin>:1:" in proc.stderr and "Traceback" not in proc.stderr


def test_wrong_flag_exit_2():
    proc = _cli("audit", "--frobnicate", "x.jsonl")
    assert proc.returncode == 2 and "--frobnicate" in proc.stderr and "Traceback" not in proc.stderr


@given(st.lists(event_strategy(), max_size=40))
@settings(max_examples=300, deadline=None)
def test_monitor_never_crashes_on_any_valid_event_sequence(evs):
    for policy in ("push", "pull"):
        m = Monitor(policy, complete=True)
        for e in evs:
            m.feed(e)
        m.finish()
        for v in m.violations:
            assert 1 <= v.line <= len(evs) and all(w < v.line or v.invariant in ("leak", "stuck") for w in v.witness)


# -- the library drivers behind `pdproto audit` and `pdproto replay` -------------


@pytest.mark.parametrize("name", ["clean-push", "double-commit", "early-target-reuse"])
def test_library_audit_is_the_cli_json(name, capsys):
    from pdproto import AuditResult, audit

    path = os.path.join(EXAMPLES, f"{name}.jsonl")
    result = audit(path, complete=True)
    assert isinstance(result, AuditResult)
    code = main(["audit", "--json", "--complete", path])
    assert json.loads(capsys.readouterr().out) == result.to_dict()
    assert code == (0 if result.ok else 1)
    assert result.ok is (not result.violations)
    from pdproto import Violation

    assert eval(repr(result), {"AuditResult": AuditResult, "Violation": Violation}) == result


def test_library_audit_bad_input_raises():
    from pdproto import HistoryFormatError, UsageError, audit

    with pytest.raises(UsageError):
        audit(os.path.join(EXAMPLES, "clean-push.jsonl"), skip=["no-such"])
    with pytest.raises(HistoryFormatError):
        audit(os.path.join(ROOT, "README.md"))


def test_library_replay_is_the_cli_json(capsys):
    pytest.importorskip("torch")
    from pdproto import ReplayResult, replay

    path = os.path.join(EXAMPLES, "early-target-reuse.jsonl")
    result = replay(path, dtype="float32")
    assert isinstance(result, ReplayResult) and not result.ok
    assert result.data_violations >= 1
    assert main(["replay", path, "--dtype", "float32", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == result.to_dict()


def test_replay_without_torch_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "pdproto.backends._torch", raising=False)
    from pdproto import PdprotoError, replay

    with pytest.raises(PdprotoError) as exc:
        replay(os.path.join(EXAMPLES, "clean-push.jsonl"))
    assert "pip install 'pdproto[torch]'" in str(exc.value)
    assert main(["replay", os.path.join(EXAMPLES, "clean-push.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'pdproto[torch]'" in err and "Traceback" not in err
