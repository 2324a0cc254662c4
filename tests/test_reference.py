"""Tests of the reference handoff model and its mutants (pdproto/_reference.py,
models/)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from collections import deque

import attrs
import pytest

import models
from pdproto._config import FAULT_KINDS, ModelConfig
from pdproto._model import Action, ActionNotEnabled
from pdproto._monitor import Monitor
from pdproto._reference import Handoff, HandoffModel, transition_table, transition_table_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = sorted(
    m.name for m in pkgutil.iter_modules(models.__path__) if m.name != "reference"
)


def monitor_for(model: HandoffModel) -> Monitor:
    return Monitor(model.header.policy, complete=True, workers=model.header.workers)


def bfs(model, max_states=2_000_000):
    """Breadth-first search over (model state, monitor key).  Returns
    (states, first finding) where a finding is (invariant, path, kind)."""
    mon0 = monitor_for(model)
    found = None
    seen = set()
    frontier = deque()
    for s in model.initial_states():
        seen.add((s, mon0.key()))
        frontier.append((s, mon0, ()))
    while frontier:
        s, mon, path = frontier.popleft()
        acts = model.actions(s)
        if not acts:
            ends = mon.end_violations()
            if ends:
                return len(seen), (ends[0].invariant, path, "deadlock")
            continue
        for a in acts:
            ns, evs = model.step(s, a)
            child = mon.copy()
            bad = []
            for e in evs:
                bad.extend(child.feed(e))
            if bad:  # a violating transition counts even into a seen state
                return len(seen), (bad[0].invariant, path + (a,), "violation")
            key = (ns, child.key())
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > max_states:
                raise AssertionError("state space too big")
            frontier.append((ns, child, path + (a,)))
    return len(seen), found


@pytest.fixture(params=["push", "pull"])
def mode(request):
    return request.param


def test_header_and_interface(mode):
    m = HandoffModel(ModelConfig.all_faults(1, mode=mode, prefill_workers=2, decode_workers=1, blocks=3))
    assert m.header.policy == mode and m.header.complete
    assert {n: (w.role, w.blocks) for n, w in m.header.workers.items()} == {
        "P0": ("prefill", 3),
        "P1": ("prefill", 3),
        "D0": ("decode", 3),
    }
    (s0,) = m.initial_states()
    hash(s0)
    assert all(isinstance(a, Action) for a in m.actions(s0))


def test_actions_deterministic_and_hashable(mode):
    cfg = ModelConfig.all_faults(1, mode=mode)
    a, b = HandoffModel(cfg), HandoffModel(cfg)
    s, t = a.initial_states()[0], b.initial_states()[0]
    for _ in range(12):
        acts = a.actions(s)
        assert acts == b.actions(t) == a.actions(s)
        assert len(set(acts)) == len(acts)
        if not acts:
            break
        act = acts[len(acts) // 2]
        s2, ev = a.step(s, act)
        t2, ev2 = b.step(t, act)
        assert s2 == t2 and hash(s2) == hash(t2) and ev == ev2
        s, t = s2, t2
    eval(repr(Action("deliver", "net", (0, "notify", "r0", 0))))


def test_not_enabled_changes_nothing(mode):
    m = HandoffModel(ModelConfig(mode=mode))
    s = m.initial_states()[0]
    before = (s, m.actions(s))
    with pytest.raises(ActionNotEnabled) as info:
        m.step(s, Action("finish", "D0", ("r0",)))
    assert "not enabled" in str(info.value)
    assert (s, m.actions(s)) == before
    h = Handoff(ModelConfig(mode=mode))
    with pytest.raises(ActionNotEnabled):
        h.do("decode", "r0")
    assert h.events == [] and h.state == m.initial_states()[0]


@pytest.mark.parametrize("requests", [1, 2])
def test_clean_run_is_clean(mode, requests):
    h = Handoff(ModelConfig(mode=mode, requests=requests, blocks=2))
    events = h.run()
    assert not h.actions  # quiet
    mon = monitor_for(h.model)
    assert mon.feed_all(events) == []
    assert mon.finish() == []
    kinds = [e.EV for e in events]
    for ev in ("submit", "reserve", "prefill_start", "prefill_done", "transfer_start", "commit", "decode", "finish", "free"):
        assert ev in kinds
    assert kinds.count("finish") == requests
    first = next(e for e in events if e.EV == "decode")
    done = next(e for e in events if e.EV == "prefill_done")
    assert first.position == 3 and first.input_token == done.first_token
    if mode == "push":
        assert kinds.index("reserve") < kinds.index("prefill_start")
    else:
        assert kinds.index("prefill_done") < kinds.index("reserve")


@pytest.mark.parametrize(
    "faults",
    [
        {k: 1 for k in FAULT_KINDS},
        {"dup": 2, "loss": 1, "reorder": 2},
        {"restart": 2, "retry": 1, "cancel": 1},
    ],
)
def test_reference_exhaustive_small(mode, faults):
    m = HandoffModel(ModelConfig(mode=mode, requests=1, blocks=1, faults=faults))
    states, found = bfs(m)
    assert found is None, found
    assert states > 10


def test_reference_two_requests_some_faults(mode):
    m = HandoffModel(ModelConfig(mode=mode, requests=2, blocks=1, faults={"cancel": 1, "loss": 1, "transfer_fail": 1}))
    states, found = bfs(m)
    assert found is None, found


@pytest.mark.skipif(not os.environ.get("PDPROTO_SLOW"), reason="set PDPROTO_SLOW=1 (about 40 s)")
def test_reference_default_config_exhaustive(mode):
    ref = importlib.import_module("models.reference")
    m = ref.build(attrs.evolve(ref.DEFAULT_CONFIG, mode=mode))
    states, found = bfs(m, max_states=5_000_000)
    assert found is None, found


def test_sometimes_reachable_small(mode):
    from pdproto._explore import explore

    m = HandoffModel(ModelConfig(mode=mode, requests=2, blocks=1, faults={k: 1 for k in FAULT_KINDS if k not in ("restart", "retry")}))
    r = explore(m)
    assert r.ok and not r.violations and not r.deadlocks and not r.unmet_sometimes
    m = HandoffModel(ModelConfig(mode=mode, requests=1, blocks=1, faults={k: 1 for k in FAULT_KINDS}))
    r = explore(m)
    assert not r.violations and not r.deadlocks
    # one request never waits in D's queue
    assert set(r.unmet_sometimes) <= ({"phase-W"} if mode == "pull" else set())


def test_default_config_has_every_fault():
    ref = importlib.import_module("models.reference")
    assert ref.EXPECTED is None
    assert ref.DEFAULT_CONFIG.requests >= 2
    assert all(ref.DEFAULT_CONFIG.faults[k] >= 1 for k in FAULT_KINDS)


def test_catalogue_has_twelve_mutants():
    assert len(MUTANTS) >= 12


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_caught_by_intended_invariant(name):
    mod = importlib.import_module(f"models.{name}")
    assert mod.__doc__ and re.search(r"[\w.-]+/[\w.-]+#\d+|seed", mod.__doc__)
    model = mod.build(mod.DEFAULT_CONFIG)
    states, found = bfs(model)
    assert found is not None, name
    inv, path, kind = found
    assert inv == mod.EXPECTED, (name, inv, [str(a) for a in path])
    if inv in ("leak", "stuck"):
        assert kind == "deadlock"


def test_doc_table_matches_code():
    doc = open(os.path.join(ROOT, "docs", "protocol.md")).read()
    for mode in ("push", "pull"):
        m = re.search(
            rf"<!-- BEGIN GENERATED TABLE {mode} -->\n(.*?)<!-- END GENERATED TABLE {mode} -->", doc, re.S
        )
        assert m, mode
        assert m.group(1) == transition_table_markdown(mode), f"regenerate with benchmarks/gen_protocol_table.py ({mode})"


def test_table_lists_every_emitted_event(mode):
    rows = {r["action"]: r for r in transition_table(mode)}
    m = HandoffModel(ModelConfig(mode=mode, requests=2, blocks=1, faults={k: 1 for k in FAULT_KINDS}))
    seen = set()
    frontier = deque(m.initial_states())
    emitted: dict[str, set] = {}
    while frontier and len(seen) < 20000:
        s = frontier.popleft()
        for a in m.actions(s):
            ns, evs = m.step(s, a)
            emitted.setdefault(a.kind, set()).update(e.EV for e in evs)
            if ns not in seen:
                seen.add(ns)
                frontier.append(ns)
    for kind, evs in emitted.items():
        if kind in ("deliver", "dup"):
            listed = set().union(*(re.findall(r"[a-z_]+", rows[k]["events"]) for k in rows if k.startswith("deliver ")))
        else:
            listed = set(re.findall(r"[a-z_]+", rows[kind]["events"]))
            if "cleanup" in rows[kind]["effect"]:
                listed |= set(re.findall(r"[a-z_]+", rows["cleanup"]["events"]))
        assert evs <= listed, (kind, evs - listed)
