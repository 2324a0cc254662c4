"""The parallel explorer (issue 16): worker processes and Ray actors give the
serial search's answers; limits stop cleanly with a partial report."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pdproto.drivers import explore
from pdproto.drivers import load_model
from pdproto.spec import Monitor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import toy_model  # noqa: E402

#: (model, load_model keywords): the reference and three mutants of each family
CASES = [
    ("reference", {"policy": "push", "requests": 1}),
    ("reference", {"policy": "pull", "requests": 1}),
    ("abort-after-transfer-leaks-d", {}),  # push: a leak (a deadlock)
    ("duplicate-completion-double-commit", {}),  # push: a safety violation
    ("benign-retry-reserves-at-once", {}),  # push: clean
    ("abort-frees-shared-prefix", {}),  # pull: two invariants
    ("cancel-queued-at-d-strands-p", {}),  # pull: a leak
    ("dead-owner-reservation-freed-twice", {}),  # pull: bad-free
]


def signature(r, monitor_states: bool = True) -> dict:
    """What a parallel search must reproduce of a complete serial one."""
    out = {
        "states": r.states, "transitions": r.transitions, "depth": r.depth, "ok": r.ok,
        "complete": r.complete, "unmet": sorted(r.unmet_sometimes), "met": sorted(r.met_sometimes),
        "violations": sorted((c.invariant, len(c.trace)) for c in r.violations),
        "deadlocks": sorted((c.invariant, len(c.trace)) for c in r.deadlocks),
        "invariants": sorted((c.invariant, len(c.trace)) for c in r.invariant_failures),
        "symmetry": r.symmetry, "fingerprint": r.fingerprint,
    }
    if monitor_states:
        # under symmetry the concrete representative of a class (hence which
        # concrete monitor states are seen) depends on the discovery order
        out["monitor_states"] = r.monitor_states
    return out


def replays_to(model, cx) -> bool:
    """Whether the counterexample's trace, fed to a fresh monitor, breaks its
    invariant (a deadlock: at the end of the history)."""
    if cx.kind == "state-invariant":
        return True
    mon = Monitor.from_header(model.header, complete=True)
    found = [v.invariant for s in cx.trace for ev in s.events for v in mon.feed(ev)]
    if cx.kind == "deadlock":
        found += [v.invariant for v in mon.end_violations()]
    return cx.invariant in found


#: the larger spaces run in the slow tier
_SLOW = {("reference", "pull"), ("abort-frees-shared-prefix", "")}


@pytest.mark.parametrize("name,config", [
    pytest.param(n, c, id=f"{n}-{c.get('policy', '')}",
                 marks=[pytest.mark.slow] if (n, c.get("policy", "")) in _SLOW else [])
    for n, c in CASES])
def test_workers_give_the_serial_answers(name, config):
    model, _ = load_model(name, **config)
    serial = explore(model, stop_on_first=False)
    par = explore(model, stop_on_first=False, workers=2)
    assert signature(par, False) == signature(serial, False)
    for cx in par.failures:
        assert replays_to(model, cx), cx.invariant
    plain = explore(model, stop_on_first=False, symmetry=False)
    assert signature(explore(model, stop_on_first=False, symmetry=False, workers=3)) == signature(plain)


def test_workers_without_the_monitor():
    # --no-monitor --workers 2 failed: a batch looked up the monitor key of id 0, which there is none of
    model, _ = load_model(None, policy="push", requests=1)
    serial = explore(model, monitor=False, stop_on_first=False)
    par = explore(model, monitor=False, stop_on_first=False, workers=2)
    assert signature(par) == signature(serial) and par.states > 100


def test_symmetry_duplicates_keep_verdicts_and_depths():
    # the reference's canonical form ignores the blocks ended transfers used, which the monitor
    # remembers: two states of one class can stay apart, depending on the order of discovery
    model, _ = load_model(None, policy="pull", faults={"cancel": 1}, blocks=2)
    serial = explore(model, stop_on_first=False)
    par = explore(model, stop_on_first=False, workers=2)
    same = signature(serial, False)
    del same["states"], same["transitions"]
    got = signature(par, False)
    del got["states"], got["transitions"]
    assert got == same and par.states >= serial.states


def test_first_counterexample_has_the_serial_length():
    model, _ = load_model("abort-frees-shared-prefix")
    serial = explore(model)
    par = explore(model, workers=2)
    assert not serial.ok and not par.ok and not par.complete and par.stopped_by == "counterexample"
    assert len(par.failures) == 1
    assert min(len(c.trace) for c in par.failures) == min(len(c.trace) for c in serial.failures)
    assert replays_to(model, par.failures[0])


@pytest.mark.parametrize("fingerprint", [False, True])
@pytest.mark.parametrize("symmetry", [False, True])
def test_toy_model_modes(symmetry, fingerprint):
    model = toy_model.build((3, 7))
    serial = explore(model, symmetry=symmetry, fingerprint=fingerprint)
    par = explore(model, symmetry=symmetry, fingerprint=fingerprint, workers=2)
    assert signature(par) == signature(serial)
    assert par.states == (8 ** 3 if not symmetry else 120)
    assert par.memory["workers"] == 2 and par.bytes_per_state > 0
    if fingerprint:
        assert par.collision_probability is not None and "fingerprints" in par.memory


class _Fan:
    """One state with more actions than a 16-bit action number holds, and a
    chain after the last successor: the searches must widen their link arrays
    and still trace the deepest state back."""

    def __init__(self, fan: int) -> None:
        from pdproto.protocol import Action
        from pdproto.spec import HistoryHeader

        self.name, self.fan = "fan", fan
        self.header = HistoryHeader(policy="push", complete=True)
        self._go = [Action("go", f"b{i}", (i,)) for i in range(fan)]
        self._on = [Action("on", "", (0,))]
        self.invariants = {"short": lambda s: s[0] < fan + 2}

    def initial_states(self):
        return [(0,)]

    def actions(self, state):
        return self._go if state == (0,) else self._on if state[0] >= self.fan else []

    def step(self, state, action):
        return (state[0] + 1 if action.kind == "on" else action.args[0] + 1,), ()


@pytest.mark.parametrize("workers", [None, 2])
def test_links_widen_past_a_16_bit_action_number(workers):
    fan = 70_000  # > 65,535: the action number of the last successors outgrows the link array
    r = explore(_Fan(fan), symmetry=False, workers=workers)
    assert r.states == fan + 3 and r.depth == 3
    (cx,) = r.invariant_failures
    assert cx.invariant == "short" and [s.action.kind for s in cx.trace] == ["go", "on", "on"]
    assert cx.trace[0].action.args == (fan - 1,)


def test_continue_keeps_the_parents_of_later_states():
    # a violating state is not expanded; the states after it in the frontier
    # used to take its index, so later parents, depths and traces were wrong
    model, _ = load_model("abort-frees-source-under-read")
    r = explore(model, stop_on_first=False)
    assert r.depth == 8 and r.states == 20
    model, _ = load_model("abort-frees-shared-prefix")
    r = explore(model, stop_on_first=False)
    assert len(r.failures) == 2
    for cx in r.failures:
        assert replays_to(model, cx), cx.invariant


def test_max_seconds_and_max_states_stop_with_a_partial_report():
    model = toy_model.build((4, 30))
    r = explore(model, symmetry=False, max_seconds=0.2)
    assert r.truncated and not r.complete and r.stopped_by == "max_seconds" and 0 < r.states < 31 ** 4
    assert r.to_dict()["partial"] is True and r.to_dict()["stopped_by"] == "max_seconds"
    r = explore(model, symmetry=False, max_seconds=0.2, workers=2)
    assert r.truncated and r.stopped_by == "max_seconds" and r.states < 31 ** 4
    r = explore(model, symmetry=False, max_states=500, workers=2)
    assert r.truncated and r.stopped_by == "max_states" and r.states >= 500  # at the end of a level
    assert explore(model, symmetry=False, max_states=500).states == 500
    full = explore(toy_model.build((2, 3)), symmetry=False)
    assert full.stopped_by is None and full.to_dict()["partial"] is False


def test_bad_parallel_arguments():
    from pdproto import UsageError

    model = toy_model.build((2, 2))
    for kw in ({"workers": 0}, {"workers": "2"}, {"workers": 2, "keep_graph": True},
               {"workers": 2, "backend": lambda: None}, {"max_seconds": 0}, {"max_seconds": True}):
        with pytest.raises(UsageError):
            explore(model, **kw)


def test_progress_reports_levels_and_memory():
    seen: list[dict] = []
    explore(toy_model.build((3, 9)), symmetry=False, workers=2, progress=seen.append, progress_interval=0)
    assert seen[-1]["done"] and seen[-1]["states"] == 1000 and seen[-1]["workers"] == 2
    assert sum(seen[-1]["levels"]) == 1000 and seen[-1]["memory"] > 0
    seen.clear()
    explore(toy_model.build((3, 30)), symmetry=False, progress=seen.append, progress_interval=0)
    assert any("levels" in s and s["memory"] > 0 for s in seen if not s.get("done"))


def test_progress_line_and_eta():
    from pdproto._cli._check import _eta, progress_line

    assert _eta([10, 20, 30], 100.0) is None  # still growing
    assert _eta([40, 20, 10], 10.0) == pytest.approx(1.0)  # r = 1/2: 10 more states at 10/s
    info = {"states": 1000, "transitions": 4000, "depth": 7, "queue": 50, "seconds": 2.0, "violations": 0,
            "level": 7, "frontier": 50, "memory": 2**20 * 30, "levels": [400, 200, 100], "workers": 2}
    line = progress_line(info)
    assert "500/s" in line and "level 7" in line and "30 MiB" in line and "ETA" in line and "2 workers" in line


def _cli(argv, capsys):
    from pdproto._cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_workers_and_exit_codes(capsys):
    rc, out, err = _cli(["check", "cancel-queued-at-d-strands-p", "--workers", "2", "--continue", "--json"], capsys)
    obj = json.loads(out)
    assert rc == 1 and obj["workers"] == 2 and obj["ray"] is False and obj["deadlocks"]
    assert err == ""  # no progress display with --json (nor off a terminal)
    rc, out, _ = _cli(["check", "--max-states", "40", "--json"], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["partial"] and obj["stopped_by"] == "max_states" and obj["ok"]
    rc, out, _ = _cli(["check", "--max-seconds", "0.05", "--workers", "2", "--json"], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["partial"] and obj["stopped_by"] in ("max_seconds", None)
    rc, out, _ = _cli(["check", "benign-retry-reserves-at-once", "--workers", "2"], capsys)
    assert rc == 0 and "2 worker processes" in out
    # P:D sets the model's worker counts, as in pdproto fuzz; N the processes
    rc, out, _ = _cli(["check", "--workers", "2:1", "--workers", "2", "--max-states", "300", "--json"], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["workers"] == 2 and obj["config"]["prefill_workers"] == 2
    for argv in (["--workers", "0"], ["--max-seconds", "-1"], ["--max-seconds", "nan"],
                 ["--workers", "2", "--graph", "g.dot"], ["--workers", "2", "--workers", "3"],
                 ["--workers", "2:x"]):
        rc, _, err = _cli(["check", *argv], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1


def test_ray_missing_names_the_extra(monkeypatch):
    from pdproto import MissingExtraError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError, match=r"pdproto\[ray\]"):
        explore(toy_model.build((2, 2)), ray=True)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_gives_the_serial_answers(local_ray):
    for name, config in CASES:
        model, _ = load_model(name, **config)
        serial = explore(model, stop_on_first=False, symmetry=False)
        par = explore(model, stop_on_first=False, symmetry=False, ray=True, workers=2)
        assert signature(par) == signature(serial), name
        for cx in par.failures:
            assert replays_to(model, cx), (name, cx.invariant)
    model = toy_model.build((3, 6))
    assert signature(explore(model, fingerprint=True, ray=True)) == signature(explore(model, fingerprint=True))
    assert local_ray.is_initialized()  # a Ray instance the caller started stays up
