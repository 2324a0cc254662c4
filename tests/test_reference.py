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
from pdproto.protocol._config import FAULT_KINDS, ModelConfig
from pdproto.protocol._model import Action, ActionNotEnabled
from pdproto.spec._monitor import Monitor
from pdproto.protocol._reference import Handoff, HandoffModel, HState, transition_table, transition_table_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = sorted(
    m.name for m in pkgutil.iter_modules(models.__path__) if m.name != "reference"
)


def monitor_for(model: HandoffModel) -> Monitor:
    return Monitor(model.header.policy, complete=True, workers=model.header.workers)


def bfs(model, max_states=2_000_000):
    """Breadth-first search over (model state, monitor key), independent of
    pdproto.drivers._explore (no symmetry, no interning, no memo).  Returns (states,
    first finding) where a finding is (invariant, path, kind).

    The first finding is a shortest one: a violation is a property of the
    transition (checked before the target is looked up in ``seen``, so one
    into a product state seen before still counts), found while expanding
    depth d - 1; a deadlock (quiet state breaking ``leak``/``stuck``) of depth
    d is found when that state is popped, after every state of depth d - 1
    was expanded."""
    mon0 = monitor_for(model)
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
    return len(seen), None


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


@pytest.mark.slow
def test_reference_default_config_pull_explored():
    """The reference's default configuration in pull mode, explored in full
    (push is checked by tests/test_models.py through ``pdproto check``)."""
    from pdproto.drivers._explore import explore

    ref = importlib.import_module("models.reference")
    r = explore(ref.build(attrs.evolve(ref.DEFAULT_CONFIG, mode="pull")))
    assert r.complete and not r.truncated
    assert r.ok and not r.violations and not r.deadlocks and not r.invariant_failures, [
        (c.invariant, [str(st.action) for st in c.trace]) for c in r.failures
    ]
    assert not r.unmet_sometimes and set(r.met_sometimes) == set(ref.build(attrs.evolve(ref.DEFAULT_CONFIG, mode="pull")).sometimes)


def test_sometimes_reachable_small(mode):
    from pdproto.drivers._explore import explore

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


@pytest.mark.parametrize("symmetry", [True, False], ids=["symmetry", "no-symmetry"])
@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_counterexample_is_shortest(name, symmetry):
    """The explorer's counterexample has exactly the shortest length this
    file's own BFS finds, and the intended invariant."""
    from pdproto.drivers._explore import explore

    mod = importlib.import_module(f"models.{name}")
    _, found = bfs(mod.build(mod.DEFAULT_CONFIG))
    assert found is not None, name
    shortest = len(found[1])
    r = explore(mod.build(mod.DEFAULT_CONFIG), symmetry=symmetry)
    assert r.failures, name
    cx = r.failures[0]
    assert cx.invariant == mod.EXPECTED, (name, cx.invariant)
    assert len(cx.trace) == shortest, (name, len(cx.trace), shortest, [str(st.action) for st in cx.trace])
    assert cx.kind == ("deadlock" if mod.EXPECTED in ("leak", "stuck") else "violation")


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


# -- symmetry reduction ------------------------------------------------------


def _reachable(model):
    """Every reachable (model state, monitor) pair, without symmetry."""
    mon0 = monitor_for(model)
    seen = {}
    frontier = deque()
    for s in model.initial_states():
        seen[(s, mon0.key())] = mon0
        frontier.append((s, mon0))
    while frontier:
        s, mon = frontier.popleft()
        for a in model.actions(s):
            ns, evs = model.step(s, a)
            child = mon.copy()
            if child.feed_all(evs):
                continue
            key = (ns, child.key())
            if key not in seen:
                seen[key] = child
                frontier.append((ns, child))
    return seen


SYM_CONFIGS = [
    pytest.param(dict(requests=2, blocks=2, faults={"cancel": 1, "restart": 1}), id="r2b2-cancel-restart"),
    pytest.param(dict(requests=3, blocks=1, faults={"cancel": 1}), id="r3b1-cancel"),
    pytest.param(dict(requests=2, blocks=2, faults={"transfer_fail": 1, "retry": 1, "timeout": 1}), id="r2b2-fail-retry"),
    pytest.param(dict(requests=2, blocks=1, prefill_workers=2, decode_workers=2, faults={"restart": 1}), id="2P2D-restart"),
    pytest.param(dict(requests=2, blocks=1, faults={"loss": 1, "dup": 1, "reorder": 1}), id="r2b1-net"),
]


def _orbit(model, s, mkey):
    """Every image of the product state (s, mkey) under a renaming of the
    submitted requests, of the workers of one role and of the blocks of each
    pool: written here independently of HandoffModel.symmetry."""
    from itertools import permutations, product

    from pdproto.drivers._explore import rename_monitor_key

    reqs, xfers, msgs, inc, budget = s
    n = sum(1 for q in reqs if q.gen >= 0)
    np_, nw, nb = model.np, len(model.wname), model.nblocks
    gens = range(model.budget0[FAULT_KINDS.index("retry")] + 1)
    out = set()
    for rperm in permutations(range(n)):
        rp = list(rperm) + list(range(n, len(reqs)))
        for pp in permutations(range(np_)):
            for dp in permutations(range(np_, nw)):
                wp = pp + dp
                for bps in product(*(list(permutations(range(nb))) for _ in range(nw))):
                    def B(w, bs):
                        return tuple(bps[w][b] for b in bs)

                    nreqs = [None] * len(reqs)
                    for r, q in enumerate(reqs):
                        if q.gen >= 0:
                            q = q._replace(p=wp[q.p], d=wp[q.d], src=B(q.p, q.src), dst=B(q.d, q.dst))
                        nreqs[rp[r]] = q
                    nx = tuple(
                        x._replace(r=rp[x.r], p=wp[x.p], src=B(x.p, x.src), d=wp[x.d], dst=B(x.d, x.dst))
                        for x in xfers
                    )
                    nm = tuple(m._replace(r=rp[m.r], frm=wp[m.frm], to=wp[m.to]) for m in msgs)
                    ninc = [0] * nw
                    for w in range(nw):
                        ninc[wp[w]] = inc[w]
                    names = {}
                    for r in range(n):
                        names[model.rname[r]] = model.rname[rp[r]]
                        for g in gens:
                            names[model.ticket(r, g)] = model.ticket(rp[r], g)
                            names[model.transfer_id(r, g)] = model.transfer_id(rp[r], g)
                    for w in range(nw):
                        names[model.wname[w]] = model.wname[wp[w]]
                    blocks = {(model.wname[w], b): bps[w][b] for w in range(nw) for b in range(nb)}
                    ns = HState(tuple(nreqs), nx, nm, tuple(ninc), budget)
                    out.add((ns, _live(rename_monitor_key(mkey, names, blocks))))
    return frozenset(out)


def _live(mkey):
    """The monitor key without dead data: the block ids of a transfer that no
    longer reads (writes) are never looked at again (Monitor._stop), so two
    histories differing only there have the same future verdicts."""
    i = Monitor._VERDICT.index("_transfers")
    ts = frozenset(
        (tid, t._replace(src_blocks=t.src_blocks if t.reading else (), dst_blocks=t.dst_blocks if t.writing else ()))
        for tid, t in mkey[i]
    )
    return mkey[:i] + (ts,) + mkey[i + 1 :]


@pytest.mark.parametrize("cfg", SYM_CONFIGS)
def test_symmetry_reduction_is_sound(mode, cfg):
    """Symmetry reduction loses no reachable behaviour: a breadth-first search
    keyed by the canonical form (the model state from ``symmetry``, the
    monitor key renamed with the same Renaming, as pdproto.drivers._explore does)
    reaches a representative of every orbit of the reachable product states
    (orbits computed by brute force over every renaming), keeps one key per
    state it stores, and stores as many states as the explorer."""
    from pdproto.drivers._explore import Renaming, explore, rename_monitor_key

    model = HandoffModel(ModelConfig(mode=mode, **cfg))

    def canon(s, mkey):
        cs, ren = model.symmetry(s)
        if ren is not None:
            assert isinstance(ren, Renaming)
            mkey = rename_monitor_key(mkey, ren.names, ren.blocks)
        return cs, mkey

    # the reduced search
    mon0 = monitor_for(model)
    (s0,) = model.initial_states()
    seen = {canon(s0, mon0.key())}
    reps = [(s0, mon0.key())]
    frontier = deque([(s0, mon0)])
    while frontier:
        s, mon = frontier.popleft()
        for a in model.actions(s):
            ns, evs = model.step(s, a)
            child = mon.copy()
            assert not child.feed_all(evs)
            k = canon(ns, child.key())
            if k not in seen:
                seen.add(k)
                reps.append((ns, child.key()))
                frontier.append((ns, child))
    everything = _reachable(model)
    orbits = {_orbit(model, s, mk) for (s, mk) in everything}
    rep_orbits = {_orbit(model, s, mk) for (s, mk) in reps}
    assert rep_orbits == orbits
    # the canonical key is the image of the state under one renaming
    for s, mk in reps:
        cs, cmk = canon(s, mk)
        assert (cs, _live(cmk)) in _orbit(model, s, mk)
    r = explore(model)
    assert r.symmetry == "renaming" and not r.failures and r.complete
    assert r.states == len(reps) < len(everything) == explore(model, symmetry=False).states
    assert len(orbits) <= r.states


@pytest.mark.parametrize("cfg", SYM_CONFIGS)
def test_free_blocks_are_blank(mode, cfg):
    """Block renaming relies on the model's free blocks being interchangeable:
    no block the model would hand out is owned, read, written, quarantined
    or reserved in the monitor's view."""
    model = HandoffModel(ModelConfig(mode=mode, **cfg))
    for (s, _), mon in _reachable(model).items():
        for w, wn in enumerate(model.wname):
            for b in model.free_blocks(s, w):
                wb = (wn, b)
                assert not any(wb in getattr(mon, f) for f in ("_owner", "_quarantine", "_reading", "_writing", "_block_ticket")), (s, wb)


def test_symmetry_renaming_matches_state():
    """The Renaming names the ids of the renamed state: request r0 of the
    canonical state is the request the renaming maps to "r0"."""
    model = HandoffModel(ModelConfig(mode="push", requests=2, blocks=2))
    h = Handoff(model=model)
    h.do("submit", "r0")
    h.do("submit", "r1")
    h.do("reserve", "r0")  # r0 is further along (R after Q): the canonical order swaps them
    cs, ren = model.symmetry(h.state)
    assert ren is not None and ren.names["r1"] == "r0" and ren.names["r0"] == "r1"
    assert ren.names["t:r0:0"] == "t:r1:0" and ren.names["x:r1:0:0"] == "x:r0:0:0"
    assert cs.reqs[0] == h.state.reqs[1] and cs.reqs[1] == h.state.reqs[0]
    assert model.symmetry(cs) == (cs, None)  # canonical forms are fixed points
    # the identity is reported as None (no renaming of the monitor)
    h2 = Handoff(model=model)
    h2.do("submit", "r0")
    assert model.symmetry(h2.state) == (h2.state, None)
