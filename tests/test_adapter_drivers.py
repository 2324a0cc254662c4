"""The drivers over an adapter (docs/adapters.md): loading adapters, fuzzing a
system one real action at a time with shrinking and several failures per run,
and re-enacting a history on a system.  Tested on models driven as adapters
and on small hand-written systems with known behaviours."""

from __future__ import annotations

import json

import pytest

from pdproto import (
    Action,
    ActionNotEnabled,
    Alloc,
    Cancel,
    Free,
    HistoryHeader,
    PrefillDone,
    PrefillStart,
    Submit,
    UsageError,
    WorkerSpec,
)
from pdproto._cli import main
from pdproto.drivers import audit
from pdproto.drivers import ModelAdapter, load_adapter
from pdproto.drivers import fuzz_adapter, run_actions
from pdproto.drivers import replay_on_adapter


class LeakyEngine:
    """A tiny system under test with two real behaviours: a cancel after
    prefill forgets P's blocks (``leak`` at quiescence), and ``crash``
    raises inside the engine."""

    name = "leaky"
    header = HistoryHeader(policy="pull", workers={"P0": WorkerSpec("prefill", 4), "D0": WorkerSpec("decode", 4)})
    known = {"leak": "the cancel path forgets P's blocks"}

    def __init__(self, crash: bool = True, spin: bool = False) -> None:
        self.crash, self.spin = crash, spin
        self.resets = 0
        self.reset()

    def reset(self) -> None:
        self.resets += 1
        self.phase = "idle"

    def actions(self):
        out = []
        if self.phase == "idle":
            out.append(Action("submit", "client", ("r0",)))
        if self.phase == "submitted":
            out.append(Action("prefill", "P0", ("r0",)))
        if self.phase == "prefilled":
            out.append(Action("finish", "P0", ("r0",)))
            out.append(Action("cancel", "client", ("r0",), fault=True))
        if self.spin and self.phase == "done":
            out.append(Action("poll", "D0"))
        if self.crash and self.phase == "submitted":
            out.append(Action("crash", "D0", fault=True))
        return out

    def apply(self, action):
        if action not in self.actions():
            raise ActionNotEnabled(action, self.actions())
        if action.kind == "submit":
            self.phase = "submitted"
            return (Submit("r0", 0, prompt_len=3),)
        if action.kind == "prefill":
            self.phase = "prefilled"
            return (PrefillStart("r0", 0, "P0", (1,)), PrefillDone("r0", 0, "P0", first_token=9, processed_len=3))
        if action.kind == "finish":
            self.phase = "done"
            return (Cancel("r0", 0, reason="client"), Free("P0", (1,), request="r0", gen=0))
        if action.kind == "cancel":
            self.phase = "done"
            return (Cancel("r0", 0, reason="client"),)  # the bug: P's block is never freed
        if action.kind == "poll":
            return ()
        raise RuntimeError("engine assertion failed")

    def signature(self):
        return self.phase

    def close(self) -> None:
        pass


def test_load_adapter_names_and_errors():
    adapter = load_adapter("model:reference", policy="pull")
    assert isinstance(adapter, ModelAdapter) and adapter.header.policy == "pull"
    assert load_adapter(f"{__name__}:LeakyEngine").name == "leaky"
    for name, part in [("nope", "model:NAME"), ("no_such_module_xyz:Thing", "no module named"),
                       (f"{__name__}:Missing", "has no 'Missing'"), ("json:dumps", None)]:
        with pytest.raises(UsageError, match=part or "lacks") as err:
            load_adapter(name, **({"obj": 1} if name == "json:dumps" else {}))
        assert err.value.value == name


def test_model_adapter_refuses_an_action_it_does_not_offer_and_changes_nothing():
    adapter = load_adapter("model:reference")
    before = adapter.state
    with pytest.raises(ActionNotEnabled):
        adapter.apply(Action("decode", "D0", ("r0",)))
    assert adapter.state == before
    (submit,) = adapter.actions()[:1]
    assert adapter.apply(submit)[0].EV == "submit"
    adapter.reset()
    assert adapter.state == before


@pytest.mark.parametrize("mutant, invariant", [
    ("p-frees-source-on-timer", "early-source-free"),
    ("duplicate-completion-double-commit", "double-commit"),
])
def test_fuzz_finds_a_mutants_bug_and_its_history_audits_the_same(tmp_path, mutant, invariant):
    out = tmp_path / "f.jsonl"
    result = fuzz_adapter(load_adapter(f"model:{mutant}"), examples=300, steps=40, seed=3, out=out)
    assert [f.violation.invariant for f in result.failures] == [invariant]
    failure = result.failures[0]
    assert failure.history == str(out) and failure.known is None
    verdict = audit(str(out))
    assert (invariant, failure.violation.line) in {(v.invariant, v.line) for v in verdict.violations}
    # shrunk: the last step is the one that broke it, and the history ends there
    assert failure.violation.line == len(failure.events) + 1


def test_fuzz_of_the_reference_is_clean_and_repeatable():
    a = fuzz_adapter(load_adapter("model:reference"), examples=60, steps=30, seed=11)
    b = fuzz_adapter(load_adapter("model:reference"), examples=60, steps=30, seed=11)
    assert a.ok and a.examples >= 60 and a.steps > 60 and a.signatures > 20
    assert (a.examples, a.runs, a.steps, a.signatures, a.action_kinds) == (
        b.examples, b.runs, b.steps, b.signatures, b.action_kinds)


def test_fuzz_reports_each_behaviour_once_with_triage_and_an_engine_crash(tmp_path):
    engine = LeakyEngine()
    out = tmp_path / "f.jsonl"
    result = fuzz_adapter(engine, examples=100, steps=10, seed=1, out=out)
    found = {f.violation.invariant: f for f in result.failures}
    assert set(found) == {"leak", "adapter-error"}
    leak = found["leak"]
    assert leak.known == "the cancel path forgets P's blocks" and leak.header.complete
    assert [a.kind for a, _ in leak.steps] == ["submit", "prefill", "cancel"]  # shrunk to the 3 steps
    assert "RuntimeError" in found["adapter-error"].violation.message
    assert [f.violation.invariant for f in result.unexplained] == ["adapter-error"]
    # each failure's history, written beside --out, audits the same
    for f in result.failures:
        if f.violation.invariant == "leak":
            assert {v.invariant for v in audit(f.history).violations} == {"leak"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["f.jsonl", f"f.{result.failures[1].violation.invariant}.jsonl"])
    assert engine.resets == result.runs + 1  # one reset per run, and the constructor's


def test_a_system_that_never_goes_quiet_is_no_quiescence():
    drawn = iter(range(3))  # submit, prefill, finish; then the drain polls forever
    run = run_actions(LeakyEngine(crash=False, spin=True),
                      lambda offered: offered[0] if next(drawn, None) is not None else None)
    assert [a.kind for a, _ in run.steps][:3] == ["submit", "prefill", "finish"]
    assert run.violation is not None and run.violation.invariant == "no-quiescence"
    assert len(run.steps) == 3 + 500


def test_replay_on_an_adapter_matches_divergences_and_violations(tmp_path):
    out = tmp_path / "cx.jsonl"
    assert main(["check", "p-frees-source-on-timer", "--out", str(out)]) == 1
    same = replay_on_adapter(out, load_adapter("model:p-frees-source-on-timer"))
    assert same.matched == same.events and not same.divergences
    assert [(v.invariant, v.line) for v in same.violations] == [("early-source-free", 7)]
    # the reference cannot free the source under a reading transfer: it fails the transfer first
    ref = replay_on_adapter(out, load_adapter("model:reference", policy="pull", requests=1, blocks=1))
    assert not ref.violations and ref.divergences
    assert {d.kind for d in ref.divergences} == {"extra"} and ref.divergences[0].line == 7
    assert "transfer_failed" in ref.divergences[0].message


def test_replay_of_a_complete_history_applies_the_end_checks(tmp_path):
    out = tmp_path / "leak.jsonl"
    result = fuzz_adapter(LeakyEngine(crash=False), examples=50, steps=10, seed=1, out=out)
    assert [f.violation.invariant for f in result.failures] == ["leak"]

    class Deciding(LeakyEngine):
        def decision(self, event):
            kinds = {"submit": "submit", "prefill_start": "prefill", "cancel": "cancel"}
            return next((a for a in self.actions() if a.kind == kinds.get(event.EV)), None)

    replayed = replay_on_adapter(out, Deciding(crash=False))
    assert not replayed.divergences
    assert [(v.invariant, v.line) for v in replayed.violations] == [("leak", result.failures[0].violation.line)]


def test_replay_reports_a_refused_decision(tmp_path):
    path = tmp_path / "h.jsonl"
    lines = [LeakyEngine.header.to_dict(), Submit("r0", 0, prompt_len=3).to_dict(),
             Alloc("r0", 0, "D0", (0,)).to_dict()]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    class Deciding(LeakyEngine):
        def decision(self, event):
            return {"submit": Action("submit", "client", ("r0",)), "alloc": Action("finish", "P0", ("r0",))}.get(event.EV)

    result = replay_on_adapter(path, Deciding())
    assert [(d.kind, d.line) for d in result.divergences] == [("refused", 3)]
    assert "finish('r0')" in result.divergences[0].message and "prefill('r0')" in result.divergences[0].message


def test_cli_fuzz_and_replay_with_an_adapter(tmp_path, capsys):
    out = tmp_path / "f.jsonl"
    assert main(["fuzz", "--adapter", "model:p-frees-source-on-timer", "--examples", "200", "--seed", "3",
                 "--out", str(out), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert [v["invariant"] for v in d["violations"]] == ["early-source-free"]
    assert d["unexplained"] == ["early-source-free"] and d["steps_per_second"] > 0
    assert main(["replay", str(out), "--adapter", "model:p-frees-source-on-timer", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["matched"] == r["events"] and [v["invariant"] for v in r["violations"]] == ["early-source-free"]
    assert main(["fuzz", "--adapter", "model:reference", "--examples", "20", "--seed", "1"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv, flag", [
    (["fuzz", "--adapter", "model:reference", "--requests", "2"], "--requests"),
    (["fuzz", "reference", "--adapter", "model:reference"], "MODEL"),
    (["fuzz", "--adapter", "nope"], "--adapter"),
    (["replay", "x.jsonl", "--adapter", "model:reference", "--tp", "1:2"], "--tp"),
    (["replay", "-", "--adapter", "model:reference"], "FILE"),
])
def test_cli_adapter_flag_errors_are_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
