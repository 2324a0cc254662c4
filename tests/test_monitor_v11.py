"""The monitor on format 1.1: shared blocks with one reference per generation,
ranged (chunked, layer-wise, partial-block) transfers and commit readiness,
prefix-cache hits at the first-token boundary, and the verdict state of the
new tables (key, renaming).  Version 1 behaviour is pinned by test_monitor.py
and the examples."""

from __future__ import annotations

import json
import os

from _toy_handoff import rename_event
from make_examples import chunked, clean_shared_prefix, layerwise, shared_prefix_start
from test_monitor import run

from pdproto import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Finish,
    Free,
    HistoryHeader,
    KVSpec,
    Monitor,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Share,
    Submit,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    event_from_dict,
)


def kinds(violations):
    return [(v.invariant, v.line) for v in violations]


def labelled(*events):
    return [(f"e{i}", ev) for i, ev in enumerate(events)]


# -- shared blocks --------------------------------------------------------------

#: r1 owns P0 blocks 0 and 1; r2 shares block 0 (lines 2..7)
SHARED = labelled(
    Submit("r1", 0, prompt_len=6),
    Alloc("r1", 0, "P0", (0, 1)),
    Submit("r2", 0, prompt_len=6),
    Share("r2", 0, "P0", (0,), tokens=4),
    Submit("r3", 0, prompt_len=4),
    Cancel("r1", 0),
)


def test_a_share_is_a_reference_not_a_double_allocation():
    violations, _ = run(SHARED)
    assert violations == []


def test_a_shared_block_returns_to_the_pool_with_its_last_owner():
    # r1's free drops its reference; r2 still holds block 0, so r3 cannot take it
    violations, lines = run(SHARED + [
        ("free1", Free("P0", (0, 1), request="r1", gen=0)),
        ("alloc3", Alloc("r3", 0, "P0", (0,))),
    ])
    (v,) = violations
    assert (v.invariant, v.line, v.witness) == ("double-allocation", lines["alloc3"], (lines["e3"],))
    assert v.message == "alloc of request 'r3' gen 0 takes block 0 on 'P0', already owned by request 'r2' gen 0"
    # both references dropped: the block is free, and block 1 went with r1's free
    violations, _ = run(SHARED + [
        ("free1", Free("P0", (0, 1), request="r1", gen=0)),
        ("free2", Free("P0", (0,), request="r2", gen=0)),
        ("alloc3", Alloc("r3", 0, "P0", (0, 1))),
    ])
    assert violations == []


def test_allocating_a_block_two_generations_share():
    violations, lines = run(SHARED + [("alloc3", Alloc("r3", 0, "P0", (0,)))])
    (v,) = violations
    assert (v.invariant, v.line) == ("double-allocation", lines["alloc3"])
    assert "already shared by request 'r1' gen 0 and request 'r2' gen 0" in v.message
    # the allocation took the block: both earlier owners lost it
    violations, lines = run(SHARED + [
        ("alloc3", Alloc("r3", 0, "P0", (0,))),
        ("free2", Free("P0", (0,), request="r2", gen=0)),
    ])
    assert kinds(violations) == [("double-allocation", lines["alloc3"]), ("bad-free", lines["free2"])]


def test_sharing_a_block_it_already_holds():
    for again in (Share("r2", 0, "P0", (0,), tokens=4), Share("r1", 0, "P0", (1,), tokens=4)):
        violations, lines = run(SHARED[:4] + [("again", again)])
        (v,) = violations
        assert (v.invariant, v.line) == ("double-allocation", lines["again"])
        assert "which it already holds" in v.message


def test_share_revives_a_free_cached_block():
    violations, _ = run(labelled(
        Submit("r1", 0, prompt_len=4),
        Alloc("r1", 0, "P0", (0,)),
        Finish("r1", 0),
        Free("P0", (0,), request="r1", gen=0),
        Submit("r2", 0, prompt_len=6),
        Share("r2", 0, "P0", (0,), tokens=4),
        Finish("r2", 0),
        Free("P0", (0,), request="r2", gen=0),
    ), complete=True)
    assert violations == []


def test_bad_free_of_a_shared_block():
    # a generation that holds no reference: reported, nothing changes
    violations, lines = run(SHARED + [
        ("free3", Free("P0", (0,), request="r3", gen=0)),
        ("alloc3", Alloc("r3", 0, "P0", (0,))),
    ])
    assert kinds(violations) == [("bad-free", lines["free3"]), ("double-allocation", lines["alloc3"])]
    assert "request 'r1' gen 0 and request 'r2' gen 0 share it" in violations[0].message
    # a free naming no generation cannot say whose reference it drops: the block goes back whole
    violations, lines = run(SHARED + [
        ("free", Free("P0", (0,))),
        ("alloc3", Alloc("r3", 0, "P0", (0,))),
    ])
    assert kinds(violations) == [("bad-free", lines["free"])]
    assert violations[0].witness == (lines["e3"],) and "names no generation" in violations[0].message


def test_a_free_naming_only_the_request_drops_every_generation_of_it():
    violations, _ = run(labelled(
        Submit("r1", 0, prompt_len=4),
        Alloc("r1", 0, "P0", (0,)),
        Cancel("r1", 0),
        Submit("r1", 1, prompt_len=4),
        Share("r1", 1, "P0", (0,), tokens=4),
        Finish("r1", 1),
        Free("P0", (0,), request="r1"),
    ), complete=True)
    assert violations == []


def test_a_transfer_never_writes_a_shared_block():
    base = labelled(
        Submit("r1", 0, prompt_len=6),
        Reserve("r1", 0, "t1", "D0", (0, 1)),
        Submit("r2", 0, prompt_len=6),
        Share("r2", 0, "D0", (0,), tokens=4),
        Reserve("r2", 0, "t2", "D0", (3,)),
        PrefillStart("r2", 0, "P0", (2, 3)),
    )
    violations, lines = run(base + [("x", TransferStart("x", "t2", "r2", 0, "P0", (2, 3), "D0", (0, 3)))])
    (v,) = violations
    assert (v.invariant, v.line, v.witness) == ("foreign-block-access", lines["x"], (lines["e3"],))
    assert v.message == (
        "transfer_start of request 'r2' gen 0 writes block 0 on 'D0', which it shares with request 'r1' "
        "gen 0: a shared prefix is never written"
    )
    # only the positions after the shared prefix move: clean; a decode reads the shared block
    violations, _ = run(base + labelled(
        PrefillDone("r2", 0, "P0", first_token=9, processed_len=6),
        TransferStart("x", "t2", "r2", 0, "P0", (3,), "D0", (3,), tokens=(4, 6)),
        TransferWriteDone("x"),
        Commit("r2", 0, "t2", "D0"),
        Decode("r2", 0, "D0", position=6, input_token=9, output_token=10, blocks=(0, 3)),
    ))
    assert violations == []
    # reading a shared block (the source of a transfer) is fine
    violations, _ = run(SHARED[:4] + labelled(
        Reserve("r2", 0, "t2", "D0", (0, 1)),
        TransferStart("x", "t2", "r2", 0, "P0", (0,), "D0", (0,)),
    ))
    assert violations == []


def test_sharing_a_block_a_transfer_still_writes():
    violations, lines = run(labelled(
        Submit("r1", 0, prompt_len=6),
        Reserve("r1", 0, "t1", "D0", (0, 1)),
        PrefillStart("r1", 0, "P0", (0, 1)),
        TransferStart("x1", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1)),
        Submit("r2", 0, prompt_len=6),
    ) + [("share", Share("r2", 0, "D0", (0, 1), tokens=8))])
    (v,) = violations  # one report per event
    assert (v.invariant, v.line, v.witness, v.transfer) == ("foreign-block-access", lines["share"], (5,), "x1")
    assert "which transfer(s) 'x1' of request 'r1' gen 0 can still write into" in v.message


def test_early_source_free_when_the_last_reference_goes():
    entries = SHARED[:4] + labelled(
        Reserve("r2", 0, "t2", "D0", (0,)),
        TransferStart("x", "t2", "r2", 0, "P0", (0,), "D0", (0,)),
    )
    # r1 drops its reference while r2's transfer reads the block: the block stays
    violations, _ = run(entries + [("free1", Free("P0", (0,), request="r1", gen=0))])
    assert violations == []
    violations, lines = run(entries + [
        ("free1", Free("P0", (0,), request="r1", gen=0)),
        ("free2", Free("P0", (0,), request="r2", gen=0)),
    ])
    (v,) = violations
    assert (v.invariant, v.line, v.request) == ("early-source-free", lines["free2"], "r2")


def test_leak_of_a_shared_block():
    violations, lines = run(SHARED + [("free2", Free("P0", (0,), request="r2", gen=0))], complete=True)
    # r1 ended holding blocks 0 (shared until r2's free) and 1; r2 and r3 never ended
    assert [(v.invariant, v.request) for v in violations] == [("leak", "r1"), ("stuck", "r2"), ("stuck", "r3")]
    assert "block(s) [0, 1]" in violations[0].message
    violations, _ = run(SHARED, complete=True)
    assert [(v.invariant, v.request) for v in violations] == [("leak", "r1"), ("stuck", "r2"), ("stuck", "r3")]


def test_restart_drops_shared_blocks_and_shares():
    violations, lines = run(SHARED + [
        ("restart", Restart("P0", 1)),
        ("free2", Free("P0", (0,), request="r2", gen=0)),
    ])
    (v,) = violations
    assert (v.invariant, v.line, v.witness) == ("bad-free", lines["free2"], (lines["restart"],))
    m = Monitor()
    m.feed_all(ev for _, ev in SHARED)
    m.feed(Restart("P0", 1))
    assert m._shared == {} and m._share_tokens == {} and m._owner == {}


def test_a_ticket_closes_when_its_generation_drops_its_shared_block():
    m = Monitor()
    m.feed_all([
        Submit("r1", 0, prompt_len=4),
        Reserve("r1", 0, "t1", "D0", (0,)),
        Submit("r2", 0, prompt_len=4),
        Share("r2", 0, "D0", (0,), tokens=4),
        Free("D0", (0,), request="r1", gen=0),
    ])
    assert m._open_tickets == {} and m._owner == {"D0": {0: ("r2", 0)}} and m._shared == {}


# -- readiness over ranges ---------------------------------------------------------


def test_chunked_and_layerwise_examples():
    kv = KVSpec(layers=2, block_size=4)
    for build in (chunked, layerwise):
        assert run(build(), complete=True, kv=kv)[0] == []
        violations, lines = run(build(commit_early=True), complete=True, kv=kv)
        (v,) = violations
        assert (v.invariant, v.line) == ("commit-before-ready", lines["commit"])
        assert v.witness == tuple(sorted((lines["r1_reserve"], lines["x1_start"], lines["x2_start"])))
    # without the kv header the layers come from the transfers of the ticket
    assert run(layerwise(), complete=True)[0] == []
    assert kinds(run(layerwise(commit_early=True), complete=True)[0]) == [("commit-before-ready", 10)]


def ticket(*transfers, prompt=8, shares=()):
    """r1 with an 8-token prompt, 2 blocks on each side, the transfers under one ticket."""
    out = [
        Submit("r1", 0, prompt_len=prompt) if prompt is not None else Submit("r0", 0, prompt_len=1),
        Reserve("r1", 0, "t1", "D0", (0, 1)),
        PrefillStart("r1", 0, "P0", (0, 1)),
        *shares,
    ]
    for i, (layers, tokens, done) in enumerate(transfers):
        out.append(TransferStart(f"x{i}", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1), layers=layers, tokens=tokens))
        out.extend([TransferWriteDone(f"x{i}")] if done else [])
    return out + [Commit("r1", 0, "t1", "D0")]


def commit_verdict(events, kv=KVSpec(layers=4)):
    m = Monitor(kv=kv)
    m.feed_all(events)
    return [v.message for v in m.violations]


def test_readiness_is_every_layer_of_every_position():
    assert commit_verdict(ticket(((0, 4), (0, 8), True))) == []
    assert commit_verdict(ticket(((0, 2), None, True), ((2, 4), None, True))) == []
    assert commit_verdict(ticket((None, (0, 3), True), (None, (3, 8), True))) == []
    # overlapping rectangles
    assert commit_verdict(ticket(((0, 3), (0, 8), True), ((1, 4), (0, 5), True), ((2, 4), (4, 8), True))) == []
    (msg,) = commit_verdict(ticket(((0, 3), (0, 8), True), ((1, 4), (0, 5), True), ((2, 4), (6, 8), True)))
    assert msg.endswith("miss layer(s) [3, 4) of prompt positions [5, 6)")
    (msg,) = commit_verdict(ticket(((0, 2), None, True), ((2, 4), None, False)))
    assert msg == (
        "commit of request 'r1' gen 0 on 'D0' under ticket 't1', but the landed transfer(s) 'x0' miss "
        "layer(s) [2, 4) of prompt positions [0, 8); transfer 'x1' has not finished writing"
    )
    (msg,) = commit_verdict(ticket((None, (0, 4), True), (None, (5, 8), True)))
    assert msg.endswith("'x0', 'x1' miss layer(s) [0, 4) of prompt positions [4, 5)")
    # a rangeless transfer covers everything, as in version 1
    assert commit_verdict(ticket((None, (0, 4), False), (None, None, True))) == []


def test_readiness_when_nothing_ranged_landed_keeps_the_version_1_message():
    (msg,) = commit_verdict(ticket(((0, 4), (0, 8), False)))
    assert msg.endswith("but transfer 'x0' has not finished writing")
    failed = ticket(((0, 2), None, True))[:-1] + [
        TransferStart("x9", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1), layers=(2, 4)),
        TransferFailed("x9"),
        Commit("r1", 0, "t1", "D0"),
    ]
    (msg,) = commit_verdict(failed)
    assert msg.endswith("miss layer(s) [2, 4) of prompt positions [0, 8); transfer 'x9' failed")


def test_readiness_after_a_prefix_cache_hit_on_decode():
    share = (Submit("r2", 0, prompt_len=8), Alloc("r2", 0, "D0", (5,)), Share("r1", 0, "D0", (5,), tokens=4))
    # the shared positions need not move
    assert commit_verdict(ticket((None, (4, 8), True), shares=share)) == []
    (msg,) = commit_verdict(ticket((None, (5, 8), True), shares=share))
    assert msg.endswith("miss layer(s) [0, 4) of prompt positions [4, 5)")
    # without the share they must
    (msg,) = commit_verdict(ticket((None, (4, 8), True)))
    assert msg.endswith("of prompt positions [0, 4)")
    # a hit of the whole prompt needs no transfer at all
    whole = (Submit("r2", 0, prompt_len=8), Alloc("r2", 0, "D0", (5, 6)), Share("r1", 0, "D0", (5, 6), tokens=8))
    assert commit_verdict(ticket(shares=whole)) == []
    (msg,) = commit_verdict(ticket(shares=share))
    assert msg.endswith("but no transfer of that ticket has started")


def test_readiness_without_a_prompt_length_or_layer_count():
    # the prompt length is unknown: the furthest position a transfer of the ticket names
    assert commit_verdict(ticket((None, (0, 3), True), (None, (3, 8), True), prompt=None)) == []
    (msg,) = commit_verdict(ticket((None, (0, 3), True), (None, (3, 8), False), prompt=None))
    assert "miss layer(s) [0, 4) of prompt positions [3, 8)" in msg
    # the layer count is unknown: the highest layer a transfer of the ticket names
    assert commit_verdict(ticket(((0, 1), None, True), ((1, 3), None, True)), kv=None) == []
    (msg,) = commit_verdict(ticket(((0, 1), None, True), ((1, 3), None, False)), kv=None)
    assert "miss layer(s) [1, 3) of prompt positions [0, 8)" in msg


def test_from_header_takes_the_kv_layers():
    header = HistoryHeader(features=["kv", "ranges"], kv=KVSpec(layers=4))
    m = Monitor.from_header(header)
    assert m.kv == KVSpec(layers=4) and m.copy().kv == m.kv
    m.feed_all(ticket(((0, 2), None, True)))
    assert [v.invariant for v in m.violations] == ["commit-before-ready"]


# -- the first-token boundary after a prefix-cache hit -------------------------------------


def first_decode(processed, position, prompt=6, cached=4, token=9):
    m = Monitor("pull")
    m.feed_all([
        Submit("r1", 0, prompt_len=prompt) if prompt is not None else Submit("r0", 0, prompt_len=1),
        Share("r1", 0, "P0", (0,), tokens=cached),
        PrefillStart("r1", 0, "P0", (1,)),
        PrefillDone("r1", 0, "P0", first_token=9, processed_len=processed),
        Reserve("r1", 0, "t1", "D0", (0, 1)),
        TransferStart("x", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1)),
        TransferWriteDone("x"),
        Commit("r1", 0, "t1", "D0"),
        Decode("r1", 0, "D0", position=position, input_token=token, output_token=10, blocks=(0, 1)),
    ])
    return [v.message for v in m.violations]


def test_a_prefix_cache_hit_moves_the_boundary():
    assert first_decode(processed=2, position=6) == []
    assert first_decode(processed=6, position=6) == []  # the hit recomputed anyway
    (msg,) = first_decode(processed=2, position=2)
    assert msg == (
        "first decode of request 'r1' gen 0 on 'D0': position 2, but the prompt ends at 6 (prefill processed "
        "2 tokens after a cached prefix of 4): the first token goes at position 6"
    )
    (msg,) = first_decode(processed=3, position=7)
    assert msg.endswith("prefill processed 3 tokens after a cached prefix of 4, but the prompt has 6 tokens")
    (msg,) = first_decode(processed=2, position=6, token=8)
    assert msg.endswith("input_token 8, but prefill sampled first token 9")
    # unknown prompt length: either end of the prefill is a boundary
    assert first_decode(processed=2, position=6, prompt=None) == []
    assert first_decode(processed=2, position=2, prompt=None) == []
    (msg,) = first_decode(processed=2, position=5, prompt=None)
    assert "the prompt ends at 2 or 6" in msg


def test_a_share_on_another_worker_does_not_move_the_boundary():
    m = Monitor("pull")
    m.feed_all([
        Submit("r1", 0, prompt_len=6),
        Share("r1", 0, "D0", (0,), tokens=4),
        PrefillStart("r1", 0, "P0", (1,)),
        PrefillDone("r1", 0, "P0", first_token=9, processed_len=2),
        Reserve("r1", 0, "t1", "D0", (1,)),
        TransferStart("x", "t1", "r1", 0, "P0", (1,), "D0", (1,), tokens=(4, 6)),
        TransferWriteDone("x"),
        Commit("r1", 0, "t1", "D0"),
        Decode("r1", 0, "D0", position=6, input_token=9, output_token=10, blocks=(0, 1)),
    ])
    assert [v.invariant for v in m.violations] == ["first-token-boundary"]


# -- the verdict state -------------------------------------------------------------


def test_without_shares_or_ranges_the_new_tables_stay_empty():
    from make_examples import push_handoff

    m = Monitor(complete=True)
    m.feed_all(ev for _, ev in push_handoff())
    assert m._shared == {} and m._share_tokens == {}
    assert all(t.layers is None and t.tokens is None for t in m._transfers.values())


def test_renaming_covers_shares_and_ranges():
    events = [ev for _, ev in clean_shared_prefix()][:14] + [ev for _, ev in chunked()][:8]
    names = {"r1": "r2", "r2": "r1", "t-r1": "u", "x1": "y1", "P0": "P1", "D0": "D3"}
    blocks = {("P0", 0): 5, ("P0", 5): 0, ("D0", 2): 7}
    a, b = Monitor(), Monitor()
    for ev in events:
        a.feed(ev)
        b.feed(rename_event(ev, names, blocks))
        assert Monitor.renamed_key(a.key(), names, blocks) == b.key()
    assert a._shared or a._share_tokens
    c = a.renamed(names, blocks)
    assert c.key() == b.key() and c._lines == b._lines


def test_key_distinguishes_shares_and_copy_is_independent():
    a = Monitor()
    a.feed_all(ev for _, ev in shared_prefix_start())
    b = a.copy()
    b.feed(Free("P0", (0,), request="r1", gen=0))
    assert a.key() != b.key() and ("P0", 0) in a._shared and ("P0", 0) not in b._shared
    assert Monitor.from_key(a.key()).key() == a.key()


# -- random histories over a few ids: no crash, and renaming stays sound ---------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_req, _gen, _wk = st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 1), st.sampled_from(["P0", "D0"])
_blk = st.lists(st.integers(0, 3), max_size=3).map(tuple)
_tid, _tk = st.sampled_from(["x1", "x2", "x3"]), st.sampled_from(["t1", "t2"])
_rng = st.none() | st.tuples(st.integers(0, 6), st.integers(1, 8)).filter(lambda r: r[0] < r[1])
_small_events = st.one_of(
    st.builds(Submit, _req, _gen, prompt_len=st.integers(0, 8)),
    st.builds(Reserve, _req, _gen, _tk, _wk, _blk),
    st.builds(PrefillStart, _req, _gen, _wk, _blk),
    st.builds(PrefillDone, _req, _gen, _wk, first_token=st.integers(0, 3), processed_len=st.integers(0, 8)),
    st.builds(Alloc, _req, _gen, _wk, _blk),
    st.builds(Share, _req, _gen, _wk, _blk, tokens=st.integers(0, 8)),
    st.builds(TransferStart, _tid, _tk, _req, _gen, _wk, _blk, _wk, _blk, layers=_rng, tokens=_rng),
    st.builds(TransferReadDone, _tid),
    st.builds(TransferWriteDone, _tid),
    st.builds(TransferFailed, _tid),
    st.builds(Commit, _req, _gen, _tk, _wk),
    st.builds(Decode, _req, _gen, _wk, st.integers(0, 9), st.integers(0, 3), st.integers(0, 3), _blk),
    st.builds(Finish, _req, _gen),
    st.builds(Cancel, _req, _gen),
    st.builds(Free, _wk, _blk, request=st.none() | _req, gen=st.none() | _gen),
    st.builds(Restart, _wk, st.integers(0, 2)),
)
_SWAP = {"r1": "r2", "r2": "r1", "t1": "t2", "t2": "t1", "x1": "x3", "x3": "x1", "P0": "D0", "D0": "P0"}
_SWAP_BLOCKS = {("P0", 0): 3, ("P0", 3): 0, ("D0", 1): 2, ("D0", 2): 1}


@given(st.lists(_small_events, max_size=40), st.sampled_from(["push", "pull"]))
@settings(max_examples=150, deadline=None)
def test_random_histories_with_shares_and_ranges(evs, policy):
    kv = KVSpec(layers=8)
    a, b = Monitor(policy, complete=True, kv=kv), Monitor(policy, complete=True, kv=kv)
    for ev in evs:
        a.feed(ev)
        b.feed(rename_event(ev, _SWAP, _SWAP_BLOCKS))
        assert Monitor.renamed_key(a.key(), _SWAP, _SWAP_BLOCKS) == b.key()
        assert not {(w, b) for w, t in a._owner.items() for b in t} & set(a._shared)  # one owner, or two or more: never both
        assert all(len(holders) >= 2 for holders in a._shared.values())
    assert [v.invariant for v in a.finish()] == [v.invariant for v in b.finish()]
    assert [(v.invariant, v.line) for v in a.violations] == [(v.invariant, v.line) for v in b.violations]


# -- with a block size (format 1.1): positions are blocks of the block table ---

REVIEW = os.path.join(os.path.dirname(__file__), "data", "v11")


def audit_file(name):
    from pdproto import audit

    return [(v.invariant, v.line) for v in audit(os.path.join(REVIEW, name)).violations]


def test_a_whole_transfer_covers_only_the_blocks_it_writes():
    """A prefix hit on P, and P sends only the blocks it computed: D's table
    positions of the prefix never arrive (v1 counts any whole transfer as
    everything; with a block size the monitor knows better)."""
    assert audit_file("prefix-not-sent.jsonl") == [("commit-before-ready", 16)]


def test_a_share_holds_what_its_blocks_can_hold():
    """A share claiming 6 tokens of one 4-token block cannot switch readiness off."""
    found = audit_file("share-claims-too-much.jsonl")
    assert found == [("commit-before-ready", 15)]


def test_a_decode_never_writes_a_shared_block():
    """Both owners of a half-filled shared block decode into it."""
    found = audit_file("decode-into-shared-block.jsonl")
    assert found == [("foreign-block-access", 18), ("foreign-block-access", 19), ("foreign-block-access", 20)]


def test_version_1_keeps_whole_transfers_as_everything():
    """The same prefix-not-sent history without the share, as version 1 with a
    block_size key: judged as always (no block arithmetic)."""
    with open(os.path.join(REVIEW, "prefix-not-sent.jsonl"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    header = json.loads(lines[0])
    header.update(version=1, block_size=4)
    for key in ("features", "kv"):
        header.pop(key)
    body = [ln for ln in lines[1:] if '"share"' not in ln]
    m = Monitor.from_header(HistoryHeader.from_dict(header))
    assert m.block_size is None
    for i, ln in enumerate(body):
        m.feed(event_from_dict(json.loads(ln)), i + 2)
    assert "commit-before-ready" not in kinds(m.violations)
