"""The explicit-state explorer and ``pdproto check``, on small models of our own."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

import pytest

from pdproto import Monitor
from pdproto.drivers import Counterexample, ExploreResult, explore, rename_monitor_key, rerun

sys.path.insert(0, os.path.dirname(__file__))
import _toy_handoff as toy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOY = os.path.join(HERE, "_toy_handoff.py")
ROOT = os.path.dirname(HERE)


def _cli(argv, capsys):
    from pdproto._cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _monitor(model):
    return Monitor(model.header.policy, complete=True, workers=model.header.workers)


def _first_violation_depth(model, max_len):
    """Brute force: the length of the shortest action sequence whose events
    the monitor rejects (None if none up to ``max_len``)."""
    start = model.initial_states()[0]
    frontier = [(start, _monitor(model))]
    for depth in range(1, max_len + 1):
        nxt = []
        for state, mon in frontier:
            for act in model.actions(state):
                ns, evs = model.step(state, act)
                m = mon.copy()
                if any(m.feed(e) for e in evs):
                    return depth
                nxt.append((ns, m))
        frontier = nxt
    return None


# -- the search ----------------------------------------------------------------


def test_clean_model_is_ok():
    r = explore(toy.ToyHandoff(), symmetry=False)
    assert isinstance(r, ExploreResult)
    assert r.ok and r.complete and not r.truncated
    assert r.violations == () and r.deadlocks == () and r.unmet_sometimes == ()
    assert set(r.met_sometimes) == {"all finished", "cancelled"}
    assert r.states == 295 and r.transitions == 512 and r.depth == 14
    assert r.states_per_second > 0


@pytest.mark.parametrize("bug,expected", [("early-source-free", "early-source-free"),
                                          ("double-commit", "double-commit")])
def test_counterexample_is_shortest(bug, expected):
    model = toy.ToyHandoff(bug=bug)
    r = explore(model, symmetry=False)
    assert not r.ok
    (cx,) = r.violations
    assert isinstance(cx, Counterexample)
    assert cx.invariant == expected and cx.kind == "violation"
    assert len(cx.trace) == _first_violation_depth(model, len(cx.trace))
    assert [s.index for s in cx.trace] == list(range(1, len(cx.trace) + 1))
    # the recorded violation is the monitor's verdict on the written file
    mon = _monitor(model)
    found = [v for i, e in enumerate(cx.events, 2) for v in mon.feed(e, i)]
    assert found[0].invariant == expected
    assert cx.violations[0].line == found[0].line == len(cx.events) + 1
    assert cx.violations[0].witness == found[0].witness


def test_rerun_reproduces_trace():
    model = toy.ToyHandoff(bug="early-source-free")
    cx = explore(model).violations[0]
    actions = [model.actions(s) for s in [model.initial_states()[0]]]
    state = model.initial_states()[0]
    idx = []
    for s in cx.trace:
        acts = list(model.actions(state))
        idx.append(acts.index(s.action))
        state, _ = model.step(state, s.action)
    steps, last = rerun(model, 0, idx)
    assert [st.events for st in steps] == [st.events for st in cx.trace]
    assert last == state and actions


def test_stop_on_first_false_keeps_one_trace_per_invariant():
    r = explore(toy.ToyHandoff(bug="leak"), symmetry=False, stop_on_first=False)
    found = {c.invariant: c for c in r.failures}
    assert set(found) == {"double-allocation", "leak"}
    assert found["leak"].kind == "deadlock"
    assert r.complete


def test_deadlock_is_found_and_is_a_leak_or_stuck():
    r = explore(toy.ToyHandoff(bug="stuck"), symmetry=False)
    assert not r.ok and r.violations == ()
    (cx,) = r.deadlocks
    assert cx.invariant == "stuck" and cx.kind == "deadlock"
    # the last state enables nothing
    assert toy.ToyHandoff(bug="stuck").actions(cx.final_state) == []
    mon = _monitor(toy.ToyHandoff())
    for i, e in enumerate(cx.events, 2):
        assert mon.feed(e, i) == []
    assert [v.invariant for v in mon.end_violations()] == ["stuck"]


def test_unmet_sometimes_fails_the_check():
    r = explore(toy.ToyHandoff(cancels=0))
    assert r.unmet_sometimes == ("cancelled",)
    assert r.complete and not r.ok
    assert r.violations == () and r.deadlocks == ()


def test_state_invariant_violation():
    model = toy.ToyHandoff()
    model.invariants = {"never two reserved": lambda s: sum(p[0] == 2 for p in s[0]) < 2}
    r = explore(model, symmetry=False)
    (cx,) = r.invariant_failures
    assert cx.invariant == "never two reserved" and cx.kind == "state-invariant"
    assert len(cx.trace) == 4  # submit, submit, reserve, reserve
    assert not r.ok


def test_max_states_truncates():
    r = explore(toy.ToyHandoff(), symmetry=False, max_states=50)
    assert r.states == 50 and r.truncated and not r.complete
    assert r.ok  # no failure found; unmet sometimes are not judged
    assert r.to_dict()["unmet_sometimes"] == []


def test_fingerprint_agrees_with_exact():
    for bug in (None, "early-source-free"):
        exact = explore(toy.ToyHandoff(bug=bug), symmetry=False, stop_on_first=False)
        fp = explore(toy.ToyHandoff(bug=bug), symmetry=False, stop_on_first=False, fingerprint=True)
        assert (fp.states, fp.transitions, fp.depth) == (exact.states, exact.transitions, exact.depth)
        assert [c.invariant for c in fp.failures] == [c.invariant for c in exact.failures]
        assert 0 < fp.collision_probability < 1e-12
        assert fp.bytes_per_state is not None and exact.bytes_per_state is not None
        assert fp.memory["fingerprints"] > 0 and exact.memory["keys"] > 0


def test_fingerprint_bytes_per_state_small():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import toy_model

    r = explore(toy_model.build((3, 40)), symmetry=False, fingerprint=True)
    assert r.states == 41 ** 3
    assert r.bytes_per_state <= 40


@pytest.mark.parametrize("bug", [None, "early-source-free", "double-commit", "leak"])
def test_symmetry_reduces_and_preserves_verdicts(bug):
    plain = explore(toy.ToyHandoff(bug=bug), symmetry=False, stop_on_first=False)
    sym = explore(toy.ToyHandoff(bug=bug), symmetry=True, stop_on_first=False)
    assert sym.symmetry == "renaming" and plain.symmetry == "off"
    assert sym.states < plain.states
    assert sym.ok == plain.ok
    assert sorted((c.invariant, len(c.trace)) for c in sym.failures) == \
        sorted((c.invariant, len(c.trace)) for c in plain.failures)
    assert sym.met_sometimes == plain.met_sometimes


def test_rename_monitor_key_is_equivariant():
    """Renaming the verdict state == feeding renamed events, along the toy's paths."""
    model = toy.ToyHandoff(requests=2, blocks=2)
    names = {"r0": "r1", "r1": "r0", "t-r0": "t-r1", "t-r1": "t-r0", "x-r0": "x-r1", "x-r1": "x-r0"}
    blocks = {("D0", 0): 1, ("D0", 1): 0, ("P0", 0): 1, ("P0", 1): 0}
    checked = 0
    for seq in itertools.product(range(4), repeat=9):
        state = model.initial_states()[0]
        a, b = _monitor(model), _monitor(model)
        for k in seq:
            acts = model.actions(state)
            if not acts:
                break
            state, evs = model.step(state, acts[k % len(acts)])
            for e in evs:
                a.feed(e)
                b.feed(toy.rename_event(e, names, blocks))
        assert rename_monitor_key(a.key(), names, blocks) == b.key()
        assert a.with_key(a.key()).key() == a.key()
        assert a.renamed(names, blocks).key() == b.key()
        checked += 1
        if checked > 300:
            break


class _Wide:
    """One state with 70,000 actions: an action index outgrows the link array's item type."""

    name = "wide"
    invariants = {"not the last": lambda s: s != 70_000}

    def initial_states(self):
        return [0]

    def actions(self, s):
        return list(range(1, 70_001)) if s == 0 else []

    def step(self, s, a):
        return a, ()


def test_action_indices_past_65535():
    r = explore(_Wide(), monitor=False)
    (cx,) = r.invariant_failures
    assert r.states == 70_001 and r.transitions == 70_000 and r.depth == 1
    assert [s.action for s in cx.trace] == [70_000] and cx.final_state == 70_000


def test_keep_graph():
    r = explore(toy.ToyHandoff(), symmetry=False, keep_graph=True)
    g = r.graph
    assert g.number_of_nodes() == r.states and g.number_of_edges() == r.transitions
    assert explore(toy.ToyHandoff(), symmetry=False, keep_graph=True, graph_limit=10).graph is None


def test_gc_restored():
    import gc

    assert gc.isenabled()
    explore(toy.ToyHandoff())
    assert gc.isenabled()
    gc.disable()
    try:
        explore(toy.ToyHandoff())
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_progress_called():
    seen = []
    explore(toy.ToyHandoff(), progress=seen.append)
    assert seen and seen[-1]["done"] and seen[-1]["states"] == 74


class _Line:
    """States 0..1000 in a line."""

    name = "line"

    def initial_states(self):
        return [0]

    def actions(self, s):
        return ["inc"] if s < 1000 else []

    def step(self, s, a):
        return s + 1, ()


def test_progress_is_reported_during_the_search():
    seen = []
    explore(_Line(), monitor=False, progress=seen.append, progress_interval=0.0)
    during = [p for p in seen if not p.get("done")]
    assert [(p["states"], p["transitions"], p["depth"]) for p in during] == [(257, 256, 255), (513, 512, 511),
                                                                             (769, 768, 767)]
    assert seen[-1]["done"] and seen[-1]["states"] == 1001 and seen[-1]["depth"] == 1000


# -- the command ---------------------------------------------------------------


JSON_KEYS = {"ok", "model", "states", "transitions", "depth", "seconds", "states_per_second",
             "violations", "deadlocks", "unmet_sometimes"}


def test_cli_json_clean(capsys):
    rc, out, err = _cli(["check", TOY + ":model", "--json"], capsys)
    assert rc == 0
    obj = json.loads(out)
    assert JSON_KEYS <= set(obj)
    assert obj["ok"] is True and obj["violations"] == [] and obj["deadlocks"] == []
    assert obj["states"] == 74 and obj["symmetry"] == "renaming"
    rc, out, _ = _cli(["check", TOY + ":model", "--json", "--no-symmetry"], capsys)
    assert json.loads(out)["states"] == 295


def test_cli_json_violation_and_out(capsys, tmp_path):
    trace = tmp_path / "cx.jsonl"
    rc, out, err = _cli(["check", TOY + ":buggy", "--json", "--out", str(trace)], capsys)
    assert rc == 1
    obj = json.loads(out)
    assert obj["ok"] is False
    (v,) = obj["violations"]
    assert v["invariant"] == "early-source-free" and v["message"]
    assert [s["step"] for s in v["trace"]] == [1, 2, 3, 4]
    step = v["trace"][-1]
    assert set(step) >= {"step", "actor", "action", "fault", "events"}
    assert step["actor"] == "P0" and step["action"] == "transfer(0)" and step["fault"] is False
    assert [e["ev"] for e in step["events"]] == ["transfer_start", "free"]
    assert obj["out"] == str(trace)
    # the written history audits to the same invariant, same line
    assert _audit(trace, capsys)[0] == ("early-source-free", v["line"])


def _audit(path, capsys):
    rc, out, _ = _cli(["audit", str(path), "--json"], capsys)
    assert rc == 1
    return [(v["invariant"], v["line"]) for v in json.loads(out)["violations"]]


def test_cli_deadlock_out_audits_to_stuck(capsys, tmp_path):
    trace = tmp_path / "stuck.jsonl"
    rc, out, _ = _cli(["check", TOY, "--json", "--out", str(trace), "--no-symmetry"], capsys)
    assert rc == 0  # the file's default model is clean
    stuck = tmp_path / "m.py"
    stuck.write_text("import sys\nsys.path.insert(0, %r)\nfrom _toy_handoff import ToyHandoff\n"
                     "model = ToyHandoff(bug='stuck')\n" % HERE)
    rc, out, _ = _cli(["check", str(stuck), "--json", "--out", str(trace)], capsys)
    assert rc == 1
    obj = json.loads(out)
    assert obj["violations"] == [] and obj["deadlocks"][0]["invariant"] == "stuck"
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["complete"] is True
    assert [inv for inv, _ in _audit(trace, capsys)] == ["stuck"]


def test_cli_table_output(capsys, tmp_path):
    rc, out, err = _cli(["check", TOY + ":buggy"], capsys)
    assert rc == 1
    assert "FAILED" in out and "early-source-free" in out and "transfer_start" in out
    assert re.search(r"violation: early-source-free.*4 steps", out)
    rc, out, err = _cli(["check", TOY + ":model", "--fingerprint"], capsys)
    assert rc == 0 and "OK" in out and "collision" in out


def test_cli_bad_input(capsys, tmp_path):
    assert _cli(["check", "no-such-model"], capsys)[0] == 2
    rc, _, err = _cli(["check", "no-such-model"], capsys)
    assert "reference" in err  # lists the available models
    assert _cli(["check", TOY + ":model", "--requests", "3"], capsys)[0] == 2  # instance: no flags
    assert _cli(["check", TOY + ":model", "--graph", str(tmp_path / "g.png")], capsys)[0] == 2
    assert _cli(["check", TOY + ":nothing"], capsys)[0] == 2
    assert _cli(["check", str(tmp_path / "missing.py")], capsys)[0] == 2
    assert _cli(["check", "--faults", "bogus=1"], capsys)[0] == 2


def test_cli_graph(capsys, tmp_path, monkeypatch):
    nx = pytest.importorskip("networkx")
    path = tmp_path / "g.graphml"
    rc, out, _ = _cli(["check", TOY + ":model", "--no-symmetry", "--graph", str(path), "--json"], capsys)
    assert rc == 0
    g = nx.read_graphml(path)
    assert g.number_of_nodes() == json.loads(out)["states"] == 295
    dot = tmp_path / "g.dot"
    assert _cli(["check", TOY + ":model", "--graph", str(dot)], capsys)[0] == 0
    assert dot.read_text().startswith("digraph")
    import pdproto._cli._check as check

    monkeypatch.setattr(check, "GRAPH_LIMIT", 20)
    rc, _, err = _cli(["check", TOY + ":model", "--graph", str(tmp_path / "big.graphml")], capsys)
    assert rc == 2 and "20" in err
    assert not (tmp_path / "big.graphml").exists()


def test_cli_list(capsys):
    rc, out, _ = _cli(["check", "--list", "--json"], capsys)
    assert rc == 0
    names = [m["model"] for m in json.loads(out)]
    assert names and names[0] == "reference"


def test_docs_example_model(capsys, tmp_path):
    text = open(os.path.join(ROOT, "docs", "modeling.md"), encoding="utf-8").read()
    code = re.search(r"```python\n(# my_connector\.py.*?)```", text, re.S).group(1)
    path = tmp_path / "my_connector.py"
    path.write_text(code)
    rc, out, _ = _cli(["check", str(path), "--json"], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["ok"] and obj["states"] > 10, obj
    # the docs' bug switch is caught
    path.write_text(code.replace("BUGGY = False", "BUGGY = True"))
    rc, out, _ = _cli(["check", str(path), "--json"], capsys)
    obj = json.loads(out)
    assert rc == 1 and obj["violations"][0]["invariant"] == "early-source-free"


# -- memory --------------------------------------------------------------------


def test_memory_accounting_and_fingerprint_is_far_smaller():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import toy_model

    model = toy_model.build((3, 40))  # 68,921 states
    exact = explore(model, symmetry=False)
    fp = explore(model, symmetry=False, fingerprint=True)
    assert exact.states == fp.states == 41 ** 3
    for r in (exact, fp):
        assert r.bytes_per_state is not None and r.bytes_per_state > 0
        assert r.memory["links"] == 6 * r.states  # int32 parent, uint16 action index
        assert r.to_dict()["memory"] == dict(r.memory)
    assert exact.memory["keys"] > 0 and exact.memory["visited_set"] > 0
    assert fp.bytes_per_state <= 40
    assert fp.bytes_per_state * 3 < exact.bytes_per_state
    assert exact.bytes_per_state <= 300


def test_interned_states_share_parts_and_keep_verdicts():
    from pdproto.drivers import load_model

    model, _ = load_model(None, faults={"cancel": 1, "transfer_fail": 1, "restart": 1})
    a = explore(model, symmetry=False, stop_on_first=False)
    b = explore(model, symmetry=False, stop_on_first=False, intern=False)
    assert (a.states, a.transitions, a.depth, a.ok) == (b.states, b.transitions, b.depth, b.ok)
    assert a.memory["interned_parts"] > 0 and b.memory["interned_parts"] == 0
    assert a.bytes_per_state < b.bytes_per_state


@pytest.mark.parametrize("mutant", ["p_frees_source_on_timer", "restart_without_fencing"])
def test_interning_keeps_mutant_counterexamples(mutant):
    from pdproto.drivers import load_model

    model, _ = load_model(mutant)
    a = explore(model)
    b = explore(model, intern=False)
    assert [(c.invariant, len(c.trace)) for c in a.failures] == [(c.invariant, len(c.trace)) for c in b.failures]
