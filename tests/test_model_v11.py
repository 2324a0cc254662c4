"""The reference model's format 1.1 behaviour (pdproto/protocol, models/):
prefix caching (``prefix_cache``) and chunked or layer-wise handoffs
(``chunks``, ``layerwise``), each off by default; the mutants that break
them; the ``pdproto check`` flags that set them."""

from __future__ import annotations

import importlib
import json

import attrs
import pytest

from pdproto.drivers import explore
from pdproto.protocol import FAULT_KINDS, HandoffModel, ModelConfig
from pdproto.protocol import Handoff
from pdproto.spec import POLICIES
from pdproto.spec import Monitor

PREFIX = dict(block_size=2, prompt_len=3, prefix_cache=True)


def _monitor(model):
    h = model.header
    return Monitor(h.policy, complete=True, workers=h.workers, kv=h.kv)


def _explore(model, **kw):
    """Explore with a monitor that knows the header's KV layout (layer ranges)."""
    return explore(model, monitor_factory=lambda: _monitor(model), **kw)


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


# -- configuration ------------------------------------------------------------


def test_flags_off_by_default_and_format_1():
    cfg = ModelConfig()
    assert (cfg.prefix_cache, cfg.chunks, cfg.layerwise) == (False, 1, False)
    assert cfg.features == frozenset()
    header = HandoffModel(cfg).header
    assert header.version == 1 and header.features == frozenset() and header.kv is None
    h = Handoff(ModelConfig(requests=2, blocks=2))
    events = h.run()
    assert "share" not in {e.EV for e in events}
    assert all(e.layers is None and e.tokens is None for e in events if e.EV == "transfer_start")
    assert [e.transfer for e in events if e.EV == "transfer_start"] == ["x:r0:0:0", "x:r1:0:0"]


def test_header_declares_the_features_used():
    h = HandoffModel(ModelConfig(**PREFIX)).header
    assert h.version == "1.1" and h.features == {"share"} and h.kv is None
    h = HandoffModel(ModelConfig(chunks=3)).header
    assert h.version == "1.1" and h.features == {"ranges"} and h.kv is None
    h = HandoffModel(ModelConfig(chunks=2, layerwise=True)).header
    assert h.version == "1.1" and h.features == {"ranges", "kv"} and h.kv.layers == 2


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(prefix_cache=True), "prompt longer than one block"),
    (dict(layerwise=True), "one layer per chunk"),
    (dict(chunks=4), "at most prompt_len"),
    (dict(chunks=0), "chunks"),
    (dict(prefix_cache=1), "True or False"),
])
def test_bad_flags_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_chunk_ranges_cover_the_prompt_or_the_layers():
    assert ModelConfig(prompt_len=5, chunks=2).chunk_ranges == ((0, 2), (2, 5))
    assert ModelConfig(chunks=3).chunk_ranges == ((0, 1), (1, 2), (2, 3))
    assert ModelConfig(chunks=4, layerwise=True).chunk_ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    cfg = ModelConfig(chunks=2, prefix_cache=True, block_size=2, prompt_len=5)
    assert cfg.prefix_blocks == 2 and cfg == eval(repr(cfg), {"ModelConfig": ModelConfig})


# -- behaviour along one run ----------------------------------------------------


def test_prefix_shared_by_a_later_prefill(policy):
    h = Handoff(ModelConfig(policy=policy, requests=2, blocks=4, **PREFIX))
    events = h.run()
    mon = _monitor(h.model)
    assert mon.feed_all(events) == [] and mon.finish() == []
    (share,) = [e for e in events if e.EV == "share"]
    assert (share.request, share.worker, share.tokens) == ("r1", "P0", 2)
    starts = {e.request: e for e in events if e.EV == "prefill_start"}
    done = {e.request: e for e in events if e.EV == "prefill_done"}
    assert share.blocks == starts["r0"].blocks[:1] and len(starts["r1"].blocks) == 1
    assert share.blocks[0] not in starts["r1"].blocks
    assert done["r0"].processed_len == 3 and done["r1"].processed_len == 1
    # the sharer's transfer reads its whole block table: the shared block first
    xs = {e.request: e for e in events if e.EV == "transfer_start"}
    assert xs["r1"].src_blocks == share.blocks + starts["r1"].blocks
    # each generation frees its own references; the shared block twice, once per owner
    frees = [(e.request, e.blocks) for e in events if e.EV == "free" and e.worker == "P0"]
    assert sorted(frees) == [("r0", starts["r0"].blocks), ("r1", xs["r1"].src_blocks)]


@pytest.mark.parametrize("layerwise", [False, True], ids=["tokens", "layers"])
def test_chunks_move_in_order_under_one_ticket(policy, layerwise):
    h = Handoff(ModelConfig(policy=policy, requests=1, blocks=3, chunks=3 if layerwise else 2,
                            layerwise=layerwise, prompt_len=5, block_size=2))
    events = h.run()
    mon = _monitor(h.model)
    assert mon.feed_all(events) == [] and mon.finish() == []
    starts = [e for e in events if e.EV == "transfer_start"]
    assert [e.transfer for e in starts] == [f"x:r0:0:{c}" for c in range(len(starts))]
    assert len({e.ticket for e in starts}) == 1
    if layerwise:
        assert [e.layers for e in starts] == [(0, 1), (1, 2), (2, 3)]
        assert all(e.tokens is None and len(e.dst_blocks) == 3 for e in starts)
    else:
        assert [e.tokens for e in starts] == [(0, 2), (2, 5)]
        assert [len(e.src_blocks) for e in starts] == [1, 2]  # [2, 5) spans blocks 1 and 2
        (reserve,) = [e for e in events if e.EV == "reserve"]
        assert starts[0].dst_blocks + starts[1].dst_blocks == reserve.blocks
    kinds = [e.EV for e in events]
    last_done = max(i for i, e in enumerate(events) if e.EV == "transfer_write_done")
    assert kinds.index("commit") > last_done  # ready only once every chunk landed


# -- exhaustive, small -----------------------------------------------------------


_CLEAN = {
    "prefix": dict(requests=2, blocks=3, faults={"cancel": 1, "timeout": 1, "retry": 1}, **PREFIX),
    # push frees P's source once read: sharing needs room on D for two targets
    "prefix-push": dict(requests=2, blocks=4, faults={"cancel": 1}, **PREFIX),
    "chunks-all-faults": dict(requests=1, blocks=1, chunks=2, faults={k: 1 for k in FAULT_KINDS}),
    "layerwise": dict(requests=1, blocks=1, chunks=2, layerwise=True,
                      faults={"cancel": 1, "restart": 1, "transfer_fail": 1}),
}
#: about 3 s each on an idle machine, more on a busy one: the slow tier
_CLEAN_SLOW = {("pull", "prefix"), ("pull", "chunks-all-faults")}


@pytest.mark.parametrize(("policy", "name"), [
    pytest.param(policy, name, id=f"{policy}-{name}", marks=[pytest.mark.slow] if (policy, name) in _CLEAN_SLOW else [])
    for policy in POLICIES for name in _CLEAN
    if name != ("prefix" if policy == "push" else "prefix-push")
])
def test_reference_with_flags_stays_clean(policy, name):
    flags = _CLEAN[name]
    r = _explore(HandoffModel(ModelConfig(policy=policy, **flags)))
    assert r.complete and not r.failures, [(c.invariant, [str(s.action) for s in c.trace]) for c in r.failures]
    # one request never waits in D's queue
    assert set(r.unmet_sometimes) <= ({"phase-W"} if policy == "pull" and flags["requests"] == 1 else set())
    if flags.get("prefix_cache"):
        assert "prefix-shared" in r.met_sometimes
    if flags.get("chunks", 1) > 1:
        assert "last-chunk" in r.met_sometimes


def test_push_prefix_needs_room_for_two_handoffs():
    """Push frees P's source as soon as the transfer read it: a later prefill
    shares the prefix only while an earlier one's transfer is in flight, so D
    needs room for both targets."""
    r = _explore(HandoffModel(ModelConfig(policy="push", requests=2, blocks=3, **PREFIX)))
    assert r.complete and r.unmet_sometimes == ("prefix-shared",)
    r = _explore(HandoffModel(ModelConfig(policy="push", requests=2, blocks=4, **PREFIX)))
    assert r.ok and r.complete and "prefix-shared" in r.met_sometimes


def test_flags_off_explicitly_change_nothing(policy):
    cfg = ModelConfig(policy=policy, requests=2, blocks=1, faults={"cancel": 1, "loss": 1})
    a = explore(HandoffModel(cfg))
    b = explore(HandoffModel(attrs.evolve(cfg, prefix_cache=False, chunks=1, layerwise=False)))
    assert a.states == b.states and a.transitions == b.transitions


# -- mutants ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "changes", "invariant"), [
    ("commit_after_first_chunk", dict(policy="pull"), "commit-before-ready"),
    ("commit_after_first_chunk", dict(layerwise=True), "commit-before-ready"),
    ("commit_after_first_chunk", dict(layerwise=True, policy="pull"), "commit-before-ready"),
    ("chunk_sent_after_abort", dict(policy="pull"), "resurrection"),
    ("abort_frees_shared_prefix", dict(faults={"cancel": 1, "retry": 1, "timeout": 1}), "double-allocation"),
])
def test_mutants_caught_in_other_configurations(name, changes, invariant):
    mod = importlib.import_module(f"models.{name}")
    r = _explore(mod.build(attrs.evolve(mod.DEFAULT_CONFIG, **changes)))
    assert [c.invariant for c in r.failures] == [invariant]


def test_mutant_fixed_is_the_reference():
    """With the flag its rule is about turned off, each new mutant is clean."""
    for name, off in (("commit_after_first_chunk", dict(chunks=1)), ("chunk_sent_after_abort", dict(chunks=1)),
                      ("abort_frees_shared_prefix", dict(prefix_cache=False))):
        mod = importlib.import_module(f"models.{name}")
        r = _explore(mod.build(attrs.evolve(mod.DEFAULT_CONFIG, **off)))
        assert r.ok, name


# -- the command line ---------------------------------------------------------------


def _check(argv, capsys):
    from pdproto._cli import main

    rc = main(["check", *argv])
    return rc, capsys.readouterr()


def test_check_flags_reach_the_model(capsys):
    rc, out = _check(["--chunks", "2", "--requests", "1", "--blocks", "1", "--faults", "cancel=1", "--json"], capsys)
    obj = json.loads(out.out)
    assert rc == 0 and obj["ok"] and obj["config"]["chunks"] == 2 and "prefix_cache" not in obj["config"]
    rc, out = _check(["--prefix-cache", "--block-size", "2", "--blocks", "3", "--policy", "pull",
                      "--faults", "none", "--json"], capsys)
    obj = json.loads(out.out)
    assert rc == 0 and obj["config"]["prefix_cache"] is True and obj["config"]["block_size"] == 2
    assert "prefix-shared" in obj["met_sometimes"]


def test_check_flags_off_print_the_format_1_configuration(capsys):
    rc, out = _check(["--requests", "1", "--faults", "none", "--json"], capsys)
    config = json.loads(out.out)["config"]
    assert rc == 0 and not {"prefix_cache", "chunks", "layerwise"} & set(config)


@pytest.mark.parametrize(("argv", "words"), [
    (["--prefix-cache"], "prompt longer than one block"),
    (["--layerwise"], "one layer per chunk"),
    (["--chunks", "65"], "from 1 to 64"),
    (["--prompt-len", "5000"], "from 1 to 4096"),
])
def test_check_bad_flags_one_line_exit_2(argv, words, capsys):
    rc, out = _check(argv, capsys)
    assert rc == 2 and words in out.err and len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
