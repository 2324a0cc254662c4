"""Tests of the reference handoff model, its rule tables and its mutants
(pdproto/protocol/_reference.py, _push_pull.py, _rules.py, _symmetry.py, models/)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from collections import deque

import attrs
import pytest

import models
from pdproto.protocol import REFERENCE, End, Kind, MsgKind, Phase, RuleBook, XferState
from pdproto.protocol import FAULT_KINDS, ModelConfig
from pdproto.protocol import Action, ActionNotEnabled
from pdproto.protocol import Handoff, HandoffModel, HState, transition_table, transition_table_markdown
from pdproto.spec import POLICIES
from pdproto.spec import Monitor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = sorted(
    m.name for m in pkgutil.iter_modules(models.__path__)
    if m.name != "reference" and importlib.import_module(f"models.{m.name}").EXPECTED is not None
)


def monitor_for(model: HandoffModel) -> Monitor:
    """The monitor the explorer uses: set up by the model's header (its policy,
    pools and, in format 1.1, KV layout and block size)."""
    return Monitor.from_header(model.header, complete=True)


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


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


def test_header_and_interface(policy):
    m = HandoffModel(ModelConfig.all_faults(1, policy=policy, prefill_workers=2, decode_workers=1, blocks=3))
    assert m.header.policy == policy and m.header.complete
    assert {n: (w.role, w.blocks) for n, w in m.header.workers.items()} == {
        "P0": ("prefill", 3),
        "P1": ("prefill", 3),
        "D0": ("decode", 3),
    }
    (s0,) = m.initial_states()
    hash(s0)
    assert all(isinstance(a, Action) for a in m.actions(s0))


def test_actions_deterministic_and_hashable(policy):
    cfg = ModelConfig.all_faults(1, policy=policy)
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


def test_not_enabled_changes_nothing(policy):
    m = HandoffModel(ModelConfig(policy=policy))
    s = m.initial_states()[0]
    before = (s, m.actions(s))
    with pytest.raises(ActionNotEnabled) as info:
        m.step(s, Action("finish", "D0", ("r0",)))
    assert "not enabled" in str(info.value)
    assert (s, m.actions(s)) == before
    h = Handoff(ModelConfig(policy=policy))
    with pytest.raises(ActionNotEnabled):
        h.do("decode", "r0")
    assert h.events == [] and h.state == m.initial_states()[0]


@pytest.mark.parametrize("requests", [1, 2])
def test_clean_run_is_clean(policy, requests):
    h = Handoff(ModelConfig(policy=policy, requests=requests, blocks=2))
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
    if policy == "push":
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
def test_reference_exhaustive_small(policy, faults):
    m = HandoffModel(ModelConfig(policy=policy, requests=1, blocks=1, faults=faults))
    states, found = bfs(m)
    assert found is None, found
    assert states > 10


def test_reference_two_requests_some_faults(policy):
    m = HandoffModel(ModelConfig(policy=policy, requests=2, blocks=1, faults={"cancel": 1, "loss": 1, "transfer_fail": 1}))
    states, found = bfs(m)
    assert found is None, found


@pytest.mark.slow
def test_reference_default_config_pull_explored():
    """The reference's default configuration in pull mode, explored in full
    (push is checked by tests/test_models.py through ``pdproto check``)."""
    from pdproto.drivers import explore

    ref = importlib.import_module("models.reference")
    r = explore(ref.build(attrs.evolve(ref.DEFAULT_CONFIG, policy="pull")))
    assert r.complete and not r.truncated
    assert r.ok and not r.violations and not r.deadlocks and not r.invariant_failures, [
        (c.invariant, [str(st.action) for st in c.trace]) for c in r.failures
    ]
    assert not r.unmet_sometimes and set(r.met_sometimes) == set(ref.build(attrs.evolve(ref.DEFAULT_CONFIG, policy="pull")).sometimes)


def test_sometimes_reachable_small(policy):
    from pdproto.drivers import explore

    m = HandoffModel(ModelConfig(policy=policy, requests=2, blocks=1, faults={k: 1 for k in FAULT_KINDS if k not in ("restart", "retry")}))
    r = explore(m)
    assert r.ok and not r.violations and not r.deadlocks and not r.unmet_sometimes
    m = HandoffModel(ModelConfig(policy=policy, requests=1, blocks=1, faults={k: 1 for k in FAULT_KINDS}))
    r = explore(m)
    assert not r.violations and not r.deadlocks
    # one request never waits in D's queue
    assert set(r.unmet_sometimes) <= ({"phase-W"} if policy == "pull" else set())


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
    # the real bug it reproduces: a public issue or PR (the contract's LINKS) or the seed
    links = getattr(mod, "LINKS", ())
    assert mod.__doc__ and (
        any(re.match(r"https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+", u) for u in links)
        or re.search(r"[\w.-]+/[\w.-]+#\d+|seed", mod.__doc__)
    ), (name, links)
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
    from pdproto.drivers import explore

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
    for policy in POLICIES:
        m = re.search(
            rf"<!-- BEGIN GENERATED TABLE {policy} -->\n(.*?)<!-- END GENERATED TABLE {policy} -->", doc, re.S
        )
        assert m, policy
        assert m.group(1) == transition_table_markdown(policy), f"regenerate with benchmarks/gen_protocol_table.py ({policy})"


def _declared(table, rule):
    """The events ``rule`` declares, with those of the handler rules it runs."""
    out = set(rule.events)
    for name in rule.calls:
        out |= _declared(table, table[name])
    if rule.kind == Kind.MESSAGE:  # a delivery runs the receiver's recv_ rule
        for kind in MsgKind:
            if table.get("recv_" + kind.word):
                out |= _declared(table, table["recv_" + kind.word])
    return out


def test_rules_declare_every_emitted_event(policy):
    table = HandoffModel.rules[policy]
    declared: dict[str, set] = {}
    for rule in table:
        if rule.kind != Kind.HANDLER:
            declared.setdefault(rule.action, set()).update(_declared(table, rule))
    m = HandoffModel(ModelConfig(policy=policy, requests=2, blocks=1, faults={k: 1 for k in FAULT_KINDS},
                                 heartbeat=True))  # the heartbeat extension: lease_expire fires too
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
    assert set(emitted) == set(declared)  # every action rule fires somewhere
    for kind, evs in emitted.items():
        assert evs <= declared[kind], (kind, evs - declared[kind])
    rows = transition_table(policy)
    assert [r["action"].split(" ")[0] for r in rows] == list(table.names())


def test_table_order_is_the_action_order(policy):
    """``actions`` offers the action rules in table order: the kinds of the
    actions of a state follow the table, run by run."""
    table = HandoffModel.rules[policy]
    h = Handoff(ModelConfig.all_faults(1, policy=policy, requests=1, blocks=1))
    h.do("submit", "r0")
    rank = {rule.name: i for i, rule in enumerate(table)}
    by_action = {}
    for rule in table:
        by_action.setdefault((rule.action, rule.fault is not None), rule.name)
    ranks = [rank[by_action[(a.kind, a.fault)]] for a in h.actions]
    assert ranks == sorted(ranks) and len(ranks) >= 3


def test_mutants_replace_one_rule():
    """Each mutant is the reference with at most one rule replaced (the
    ticket-reuse mutant overrides the ids instead), in every family."""
    for name in MUTANTS:
        mod = importlib.import_module(f"models.{name}")
        cls = type(mod.build(mod.DEFAULT_CONFIG))
        assert isinstance(cls.rules, RuleBook)
        changed = set()
        for policy in POLICIES:
            ours, ref = cls.rules[policy], REFERENCE[policy]
            assert ours.names() == ref.names(), name
            changed |= {r.name for r in ours if r is not ref[r.name]}
        assert len(changed) <= 1, (name, changed)
        assert changed or name == "ticket_reused_by_retry", name


def test_replace_unknown_rule_is_refused():
    with pytest.raises(KeyError, match="no rule 'recv_nothing'"):
        REFERENCE.replace("recv_nothing", guard=None)
    with pytest.raises(KeyError, match="family 'push'"):
        REFERENCE["push"].replace("recv_ready", guard=None)
    assert "recv_ready" in REFERENCE["pull"] and "recv_ready" not in REFERENCE["push"]


def test_enum_order_is_the_letter_order():
    """Symmetry reduction keeps the least renamed state by tuple comparison:
    the enums sort like the letter codes they replaced, so it keeps the same."""
    assert [p.letter for p in sorted(Phase)] == sorted(p.letter for p in Phase) == list("-CFPQRWX")
    assert [e.name for e in sorted(End)] == ["LIVE", "CANCELLED", "FINISHED", "FAILED"]
    assert [k.word for k in sorted(MsgKind)] == sorted(k.word for k in MsgKind)
    assert list(XferState) == sorted(XferState)
    assert eval(repr(Phase.QUEUED)) is Phase.QUEUED


def test_mode_is_the_old_name_of_policy():
    cfg = ModelConfig(mode="pull", requests=1)
    assert cfg.policy == cfg.mode == "pull" and cfg == ModelConfig(policy="pull", requests=1)
    assert attrs.evolve(cfg, mode="push").policy == "push"
    assert attrs.evolve(cfg, policy="push").policy == "push"
    assert HandoffModel(cfg).mode == HandoffModel(cfg).policy == "pull"
    assert eval(repr(cfg)) == cfg
    with pytest.raises(Exception, match="policy"):
        ModelConfig(policy="sideways")


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


_SYM = {
    "r2b2-cancel-restart": dict(requests=2, blocks=2, faults={"cancel": 1, "restart": 1}),
    "r3b1-cancel": dict(requests=3, blocks=1, faults={"cancel": 1}),
    "r2b2-fail-retry": dict(requests=2, blocks=2, faults={"transfer_fail": 1, "retry": 1, "timeout": 1}),
    "2P2D-restart": dict(requests=2, blocks=1, prefill_workers=2, decode_workers=2, faults={"restart": 1}),
    "r2b1-net": dict(requests=2, blocks=1, faults={"loss": 1, "dup": 1, "reorder": 1}),
    # format 1.1: shared prefix blocks (P's pool of 3, 2 per request, 1 shared) and chunked transfers
    "r2b3-prefix-cancel": dict(requests=2, blocks=3, block_size=2, prompt_len=3, prefix_cache=True,
                               faults={"cancel": 1}),
    "r2b2-chunks-cancel": dict(requests=2, blocks=2, chunks=2, faults={"cancel": 1, "transfer_fail": 1}),
}
#: Brute force over these takes 10-35 s each: the slow tier.  The fast tier
#: keeps one case of each symmetry kind (requests, blocks, workers) in push.
_SYM_SLOW = {("pull", "r2b2-cancel-restart"), ("pull", "r2b2-fail-retry"), ("push", "r2b2-fail-retry"),
             ("pull", "2P2D-restart"), ("push", "r2b2-chunks-cancel"), ("pull", "r2b2-chunks-cancel"),
             ("pull", "r2b3-prefix-cancel")}
SYM_CASES = [
    pytest.param(policy, cfg, id=f"{policy}-{name}",
                 marks=[pytest.mark.slow] if (policy, name) in _SYM_SLOW else [])
    for name, cfg in _SYM.items()
    for policy in POLICIES
]


def _orbit(model, s, mkey):
    """Every image of the product state (s, mkey) under a renaming of the
    submitted requests, of the workers of one role and of the blocks of each
    pool: written here independently of HandoffModel.symmetry."""
    from itertools import permutations, product

    from pdproto.drivers import rename_monitor_key

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
                            for c in range(model.chunks):
                                names[model.transfer_id(r, g, c)] = model.transfer_id(rp[r], g, c)
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


@pytest.mark.parametrize(("policy", "cfg"), SYM_CASES)
def test_symmetry_reduction_is_sound(policy, cfg):
    """Symmetry reduction loses no reachable behaviour: a breadth-first search
    keyed by the canonical form (the model state from ``symmetry``, the
    monitor key renamed with the same Renaming, as pdproto.drivers._explore does)
    reaches a representative of every orbit of the reachable product states
    (orbits computed by brute force over every renaming), keeps one key per
    state it stores, and stores as many states as the explorer."""
    from pdproto import Renaming
    from pdproto.drivers import explore, rename_monitor_key

    model = HandoffModel(ModelConfig(policy=policy, **cfg))

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


@pytest.mark.parametrize(("policy", "cfg"), SYM_CASES)
def test_free_blocks_are_blank(policy, cfg):
    """Block renaming relies on the model's free blocks being interchangeable:
    no block the model would hand out is owned, read, written, quarantined
    or reserved in the monitor's view."""
    model = HandoffModel(ModelConfig(policy=policy, **cfg))
    for (s, _), mon in _reachable(model).items():
        for w, wn in enumerate(model.wname):
            for b in model.free_blocks(s, w):
                wb = (wn, b)
                assert not any(b in getattr(mon, f).get(wn, ()) for f in (  # per worker: {worker: {block: ...}}
                    "_owner", "_reading", "_writing", "_block_ticket")), (s, wb)
                assert not any(wb in getattr(mon, f) for f in ("_quarantine", "_shared")), (s, wb)


def test_symmetry_renaming_matches_state():
    """The Renaming names the ids of the renamed state: request r0 of the
    canonical state is the request the renaming maps to "r0"."""
    model = HandoffModel(ModelConfig(policy="push", requests=2, blocks=2))
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


def test_policy_flag_reaches_a_configuration_that_calls_it_mode():
    """A user's DEFAULT_CONFIG from before the rename (a ``mode`` field, no
    ``policy``) still takes --policy / --mode."""
    from pdproto.drivers._loader import _configure

    assert _configure({"mode": "push", "requests": 2}, {"policy": "pull"}, "x") == {"mode": "pull", "requests": 2}
    assert _configure({"policy": "push"}, {"policy": "pull"}, "x") == {"policy": "pull"}
