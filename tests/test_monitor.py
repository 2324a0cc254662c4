"""The monitor: every invariant with a clean near miss and a violating
history, asserting the violating line and its witness lines.

The violating histories of docs/examples are checked line for line in
test_examples.py; here each invariant also gets the legitimate behaviour
closest to the bug, which must stay clean.
"""

from __future__ import annotations

import os

import pytest
from conftest import ROOT
from _toy_handoff import rename_event

from make_examples import WORKERS, cancel_mid_transfer, drop, pull_handoff, push_handoff, replace
from pdproto import (
    INVARIANTS,
    Alloc,
    Cancel,
    Commit,
    Decode,
    Fail,
    Free,
    Monitor,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Share,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    UsageError,
)


def run(entries, policy="push", complete=False, workers=WORKERS, skip=(), kv=None):
    """Feed labelled events (lines from 2, as after a header); return the
    violations and the label -> line map."""
    m = Monitor(policy, complete=complete, workers=workers, skip=skip, kv=kv)
    lines = {}
    for i, (label, event) in enumerate(entries):
        lines[label] = i + 2
        m.feed(event, i + 2)
    m.finish()
    return m.violations, lines


def only(violations):
    assert len(violations) == 1, violations
    return violations[0]


def clean(entries, **kw):
    violations, _ = run(entries, **kw)
    assert violations == []


# -- clean histories --------------------------------------------------------


def test_clean_push_and_pull_complete():
    clean(push_handoff(), complete=True)
    clean(pull_handoff(), policy="pull", complete=True)


def test_cancel_mid_transfer_waiting_for_failure_is_clean():
    clean(cancel_mid_transfer(), complete=True)


# -- one test per invariant: near miss clean, bug violating ----------------


def test_double_allocation():
    # near miss: a block freed by one request may go to the next
    entries = push_handoff() + [
        ("submit2", Submit("r2", 0, prompt_len=6)),
        ("reserve2", Reserve("r2", 0, "t2", "D0", (0, 1))),
    ]
    clean(entries)
    bad = push_handoff()[:2] + [
        ("submit2", Submit("r2", 0, prompt_len=6)),
        ("reserve2", Reserve("r2", 0, "t2", "D0", (1,))),
    ]
    violations, lines = run(bad)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("double-allocation", lines["reserve2"], (lines["reserve"],))
    assert (v.worker, v.block, v.request) == ("D0", 1, "r2")


def test_double_allocation_within_one_event():
    violations, lines = run([("a", Alloc("r1", 0, "D0", (3, 3)))])
    assert only(violations).invariant == "double-allocation"


def test_bad_free_unowned_and_wrong_owner():
    violations, lines = run([("free", Free("D0", (2,)))])
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("bad-free", lines["free"], ())
    entries = push_handoff()[:2] + [("free", Free("D0", (0,), request="r2", gen=0))]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.witness) == ("bad-free", (lines["reserve"],))
    assert "r2" in v.message and "'r1' gen 0 owns it" in v.message
    # near miss: free without naming the owner is fine
    clean(push_handoff()[:2] + [("free", Free("D0", (0,)))])


def test_early_source_free():
    # near miss: free after transfer_read_done, before the write landed
    clean(pull_handoff(), policy="pull", complete=True)
    entries = pull_handoff()[:5] + [("free_p", Free("P0", (1,), request="r1", gen=0))]
    violations, lines = run(entries, policy="pull")
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("early-source-free", lines["free_p"], (lines["transfer_start"],))
    assert v.transfer == "x-r1-0" and v.block == 1
    # a failed transfer reads no more: freeing is fine then
    clean(pull_handoff()[:5] + [("failed", TransferFailed("x-r1-0")), ("free_p", Free("P0", (0, 1)))], policy="pull")


def test_early_target_reuse_on_free():
    entries = push_handoff()[:5] + [
        ("cancel", Cancel("r1", 0)),
        ("abort", TransferAbort("x-r1-0")),  # an abort does not end the write
        ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
    ]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("early-target-reuse", lines["free_d"], (lines["transfer_start"],))
    assert "[0, 1]" in v.message


def test_early_target_reuse_after_restart_quarantine():
    # D restarts while P's write is in flight: the target blocks are quarantined
    entries = push_handoff()[:5] + [
        ("restart", Restart("D0", 1)),
        ("submit2", Submit("r2", 0, prompt_len=6)),
        ("reserve2", Reserve("r2", 0, "t2", "D0", (1, 2))),
    ]
    violations, lines = run(entries)
    v = only(violations)
    assert v.invariant == "early-target-reuse" and v.line == lines["reserve2"]
    assert v.witness == (lines["transfer_start"], lines["restart"])
    # near miss: once the transfer failed, the blocks may be reused
    ok = entries[:-2] + [("failed", TransferFailed("x-r1-0"))] + entries[-2:]
    clean(ok)


def test_restart_frees_blocks_so_a_later_free_is_bad():
    entries = push_handoff()[:3] + [("restart", Restart("P0", 1)), ("free", Free("P0", (0,)))]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.witness) == ("bad-free", (lines["restart"],))


def test_commit_before_ready():
    entries = push_handoff()[:6] + [("commit", Commit("r1", 0, "t-r1-0", "D0"))]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.line) == ("commit-before-ready", lines["commit"])
    assert v.witness == (lines["reserve"], lines["transfer_start"])
    assert "has not finished writing" in v.message
    # no transfer at all
    violations, lines = run(push_handoff()[:4] + [("commit", Commit("r1", 0, "t-r1-0", "D0"))])
    assert only(violations).invariant == "commit-before-ready"


def test_a_transfer_that_reads_no_source_block_makes_nothing_ready():
    # a landed transfer with src_blocks [] and target blocks named used to count as moving the whole prompt
    empty = replace(push_handoff(), "transfer_start",
                    ("transfer_start", TransferStart("x-r1-0", "t-r1-0", "r1", 0, "P0", (), "D0", (0, 1))))
    violations, lines = run(empty[:6] + empty[7:9])
    v = only(violations)
    assert (v.invariant, v.line) == ("commit-before-ready", lines["commit"])
    assert "'x-r1-0' read no source block" in v.message
    # with a block size (format 1.1) too
    mon = Monitor(policy="push", block_size=4)
    found = [x.invariant for _label, ev in empty[:6] + empty[7:9] for x in mon.feed(ev)]
    assert found == ["commit-before-ready"]


def test_commit_before_ready_when_source_lost_to_restart():
    entries = push_handoff()[:5] + [
        ("restart", Restart("P0", 1)),
        ("write_done", TransferWriteDone("x-r1-0")),
        ("commit", Commit("r1", 0, "t-r1-0", "D0")),
    ]
    violations, lines = run(entries)
    v = only(violations)
    assert v.invariant == "commit-before-ready" and "restart" in v.message
    # a restart of P after the read finished loses nothing
    ok = push_handoff()[:6] + [("restart", Restart("P0", 1))] + push_handoff()[7:]
    clean(ok, complete=True)


def test_double_commit():
    entries = push_handoff()[:9] + [("commit2", Commit("r1", 0, "t-r1-0", "D0"))]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("double-commit", lines["commit2"], (lines["commit"],))


def test_resurrection_and_late_completion_is_fine():
    # near miss: a late write_done / prefill_done after a cancel is harmless
    entries = push_handoff()[:5] + [
        ("cancel", Cancel("r1", 0)),
        ("read_done", TransferReadDone("x-r1-0")),
        ("write_done", TransferWriteDone("x-r1-0")),
        ("free_p", Free("P0", (0, 1), request="r1", gen=0)),
        ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
        ("cancel_again", Cancel("r1", 0)),
    ]
    clean(entries, complete=True)
    bad = entries[:-1] + [("decode", Decode("r1", 0, "D0", 6, 101, 102, (0, 1)))]
    violations, lines = run(bad)
    invariants = {v.invariant for v in violations}
    assert "resurrection" in invariants
    v = next(v for v in violations if v.invariant == "resurrection")
    assert (v.line, v.witness) == (lines["decode"], (lines["cancel"],))


def test_stale_generation():
    # near miss: cleanup of gen 0 after gen 1 was submitted is fine
    entries = push_handoff()[:5] + [
        ("submit1", Submit("r1", 1, prompt_len=6)),
        ("failed", TransferFailed("x-r1-0")),
        ("cancel0", Cancel("r1", 0)),
        ("free_p", Free("P0", (0, 1), request="r1", gen=0)),
        ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
    ]
    clean(entries)
    bad = entries + [("reserve0", Reserve("r1", 0, "t-late", "D0", (4,)))]
    violations, lines = run(bad)
    stale = [v for v in violations if v.invariant == "stale-generation"]
    assert stale and stale[0].line == lines["reserve0"] and stale[0].witness == (lines["submit1"],)
    violations, lines = run([("s1", Submit("r1", 1, 4)), ("s0", Submit("r1", 1, 4))])
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("stale-generation", lines["s0"], (lines["s1"],))


def test_ticket_mismatch():
    entries = push_handoff()[:4] + [
        ("transfer_start", TransferStart("x", "t-r1-0", "r1", 0, "P0", (0, 1), "D1", (0, 1))),
    ]
    workers = dict(WORKERS, D1=WORKERS["D0"])
    violations, lines = run(entries, workers=workers)
    mism = [v for v in violations if v.invariant == "ticket-mismatch"]
    assert len(mism) == 1 and "'D0'" in mism[0].message and mism[0].witness == (lines["reserve"],)
    violations, lines = run(push_handoff()[:4] + [("c", Commit("r1", 0, "t-none", "D0"))])
    assert "never reserved" in next(v for v in violations if v.invariant == "ticket-mismatch").message


def test_id_reuse():
    entries = push_handoff()[:5] + [
        ("failed", TransferFailed("x-r1-0")),
        ("again", TransferStart("x-r1-0", "t-r1-0", "r1", 0, "P0", (0, 1), "D0", (0, 1))),
    ]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("id-reuse", lines["again"], (lines["transfer_start"],))
    # near miss: a fresh transfer id for the second attempt
    clean(entries[:-1] + [("again", TransferStart("x2", "t-r1-0", "r1", 0, "P0", (0, 1), "D0", (0, 1)))])


def test_unknown_transfer():
    violations, lines = run([("r", TransferReadDone("nope"))])
    v = only(violations)
    assert (v.invariant, v.line, v.transfer) == ("unknown-transfer", lines["r"], "nope")


def test_foreign_block_access_in_transfer_and_decode():
    entries = push_handoff()[:4] + [
        ("transfer_start", TransferStart("x", "t-r1-0", "r1", 0, "P0", (0, 5), "D0", (0, 1))),
    ]
    violations, lines = run(entries)
    v = only(violations)
    assert v.invariant == "foreign-block-access" and v.block == 5 and "free" in v.message
    after_free = push_handoff()[:8] + [
        ("free_d", Free("D0", (1,))),
        ("commit", Commit("r1", 0, "t-r1-0", "D0")),
        ("decode", Decode("r1", 0, "D0", 6, 101, 102, (0, 1))),
    ]
    violations, lines = run(after_free)
    v = only([v for v in violations if v.invariant == "foreign-block-access"])
    assert v.line == lines["decode"] and v.witness == (lines["free_d"],)


def test_decode_before_commit_and_on_another_worker():
    entries = push_handoff()[:9] + [("decode", Decode("r1", 0, "D1", 6, 101, 102, ()))]
    workers = dict(WORKERS, D1=WORKERS["D0"])
    violations, lines = run(entries, workers=workers)
    v = only(violations)
    assert (v.invariant, v.witness) == ("decode-before-commit", (lines["commit"],))
    assert "committed on 'D0'" in v.message


@pytest.mark.parametrize(
    "position, token, why",
    [(5, 101, "position 5"), (6, 55, "input_token 55"), (7, 101, "position 7")],
)
def test_first_token_boundary(position, token, why):
    entries = push_handoff()[:9] + [("decode", Decode("r1", 0, "D0", position, token, 9, (0, 1)))]
    violations, lines = run(entries)
    v = only(violations)
    assert v.invariant == "first-token-boundary" and why in v.message
    assert v.witness == (lines["submit"], lines["prefill_done"])


def test_first_token_boundary_partial_prefill():
    entries = replace(
        push_handoff()[:10], "prefill_done", ("prefill_done", PrefillDone("r1", 0, "P0", 101, 5))
    )
    entries = replace(entries, "decode1", ("decode1", Decode("r1", 0, "D0", 5, 101, 102, (0, 1))))
    v = only(run(entries)[0])
    assert v.invariant == "first-token-boundary" and "5 tokens of a 6-token prompt" in v.message


def test_decode_continuity_and_budget():
    entries = replace(
        push_handoff()[:11],
        "decode2",
        ("decode2", Decode("r1", 0, "D0", 7, 999, 103, (0, 1))),
    )
    v = only(run(entries)[0])
    assert v.invariant == "decode-continuity" and "input_token 999" in v.message
    # max_new_tokens=3: the first token + 2 decodes; a third decode exceeds it
    over = push_handoff()[:11] + [("decode3", Decode("r1", 0, "D0", 8, 103, 104, (0, 1)))]
    violations, lines = run(over)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("decode-continuity", lines["decode3"], (lines["submit"],))


def test_reserve_before_prefill_only_in_push():
    entries = drop(push_handoff(), "reserve")[:2]
    violations, lines = run(entries)
    v = only(violations)
    assert (v.invariant, v.line, v.witness) == ("reserve-before-prefill", lines["prefill_start"], (lines["submit"],))
    clean(entries, policy="pull")
    # a reservation whose blocks were all freed is no longer open
    closed = push_handoff()[:2] + [("free", Free("D0", (0, 1)))] + push_handoff()[2:3]
    assert only(run(closed)[0]).invariant == "reserve-before-prefill"


def test_capacity_only_with_declared_pools():
    entries = [("a", Alloc("r1", 0, "D0", (7, 8, 9)))]
    v = only(run(entries)[0])
    assert (v.invariant, v.witness, v.block) == ("capacity", (1,), 8)
    assert "[8, 9]" in v.message and "[0, 8)" in v.message
    clean(entries, workers=None)


def test_leak_and_stuck_only_when_complete():
    entries = push_handoff()[:10] + [("cancel", Cancel("r1", 0))]
    clean(entries, complete=False)
    violations, lines = run(entries, complete=True)
    v = only(violations)
    assert v.invariant == "leak" and v.line == lines["cancel"]
    stuck = push_handoff()[:9]
    violations, lines = run(stuck, complete=True)
    assert [v.invariant for v in violations] == ["stuck"]
    assert violations[0].witness == (lines["submit"],)


def test_in_flight_transfer_at_end_is_a_leak():
    entries = push_handoff()[:5] + [("cancel", Cancel("r1", 0)), ("abort", TransferAbort("x-r1-0"))]
    violations, _ = run(entries, complete=True)
    assert {v.invariant for v in violations} == {"leak"}
    assert any(v.transfer == "x-r1-0" for v in violations)


# -- the API ------------------------------------------------------------------


def test_skip_and_unknown_skip():
    entries = drop(push_handoff(), "reserve")[:2]
    clean(entries, skip=["reserve-before-prefill"])
    with pytest.raises(UsageError) as info:
        Monitor(skip=["no-such-invariant"])
    assert info.value.value == "no-such-invariant"


def test_feed_numbers_lines_and_returns_new_violations():
    m = Monitor()
    assert m.feed(Submit("r", 0, 1)) == []
    found = m.feed(Free("D0", (1,)))
    assert [v.line for v in found] == [2]
    assert m.violations == found and not m.ok


def test_copy_is_independent_and_key_ignores_lines():
    a = Monitor()
    a.feed(Submit("r", 0, 1), 10)
    b = a.copy()
    b.feed(Reserve("r", 0, "t", "D0", (0,)))
    assert a.key() != b.key()
    c = Monitor()
    c.feed(Submit("r", 0, 1), 99)
    assert c.key() == a.key()
    hash(a.key())


def test_every_invariant_is_documented():
    with open(os.path.join(ROOT, "docs", "invariants.md"), encoding="utf-8") as fh:
        text = fh.read()
    for inv in INVARIANTS:
        assert f"`{inv}`" in text, inv


def test_feed_rejects_a_foreign_object_and_changes_nothing():
    m = Monitor()
    m.feed(Submit("r", 0, 1))
    m.feed(Free("D0", (1,)))
    before = (m.key(), m.line, m.events, list(m.violations), dict(m._lines))
    for foreign in ({"ev": "submit", "request": "r", "gen": 1}, "submit", None):
        with pytest.raises(UsageError) as info:
            m.feed(foreign)
        assert info.value.what == "event" and info.value.value == foreign
        assert "Submit" in info.value.allowed and "Restart" in info.value.allowed
        assert (m.key(), m.line, m.events, list(m.violations), dict(m._lines)) == before


# -- renaming ids -------------------------------------------------------------

#: a history that puts something in every verdict table and every kind of
#: witness line: a transfer whose target restarts mid-write (quarantine,
#: incarnation, a lost and then failed transfer), a clean handoff (commit,
#: decodes), and a request that never ends
_EVERY_TABLE = [
    Submit("r1", 0, prompt_len=6, max_new_tokens=3),
    Reserve("r1", 0, "t1", "D0", (0, 1)),
    PrefillStart("r1", 0, "P0", (0, 1)),
    PrefillDone("r1", 0, "P0", first_token=7, processed_len=6),
    TransferStart("x1", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1)),
    TransferReadDone("x1"),
    Restart("D0", 1),
    TransferFailed("x1"),
    Fail("r1", 0, reason="transfer failed"),
    Free("P0", (0, 1), request="r1", gen=0),
] + [ev for _, ev in push_handoff("r2", p_blocks=(2, 3), d_blocks=(2, 3))] + [
    Submit("r3", 0, prompt_len=2),
    Alloc("r3", 0, "P0", (4,)),
    Submit("r4", 0, prompt_len=6),
    Share("r4", 0, "P0", (4,), tokens=4),  # format 1.1: block 4 is shared by r3 and r4
    Free("D0", (0,)),  # bad-free: its witness is the restart's line
]
_NAMES = {"r1": "r3", "r3": "r1", "t1": "u1", "x1": "y1", "t-r2-0": "t2", "x-r2-0": "x2", "P0": "P1", "D0": "D7"}
_BLOCKS = {("P0", 0): 4, ("P0", 4): 0, ("P0", 2): 1, ("P0", 1): 2, ("D0", 0): 3, ("D0", 3): 0}


def test_renaming_has_a_rule_for_every_verdict_table():
    # every table of the monitor's state is in the verdict state (or is the witness bookkeeping)
    m = Monitor()
    m.feed_all(_EVERY_TABLE)
    tables = {name for name in Monitor.__slots__ if name.startswith("_") and isinstance(getattr(m, name), dict)}
    assert tables == set(Monitor._VERDICT) | {"_lines"}


def test_renaming_the_state_is_feeding_renamed_events():
    """On a history that fills every table: the renamed key (and the renamed
    monitor, witness lines included) is that of the renamed history, after
    every event; and both report the same afterwards."""
    # a block size (format 1.1) makes the monitor keep block tables too
    a, b = Monitor(complete=True, block_size=4), Monitor(complete=True, block_size=4)
    filled: set[str] = set()
    for ev in _EVERY_TABLE:
        a.feed(ev)
        b.feed(rename_event(ev, _NAMES, _BLOCKS))
        filled |= {name for name in Monitor._VERDICT if getattr(a, name)}
        assert Monitor.renamed_key(a.key(), _NAMES, _BLOCKS) == b.key()
    assert filled == set(Monitor._VERDICT)
    assert {tag for tag, _ in a._lines} == set(Monitor._LINE_TAGS)
    assert a.key() != b.key()
    c = a.renamed(_NAMES, _BLOCKS)
    assert c.key() == b.key() and c._lines == b._lines and c.violations == []
    assert [v.invariant for v in a.violations] == ["bad-free"] and a.violations[0].witness == (7,)
    # the same renaming as one object with .names and .blocks
    ren = type("R", (), {"names": _NAMES, "blocks": _BLOCKS})()
    assert Monitor.renamed_key(a.key(), ren) == b.key() and a.renamed(ren).key() == b.key()
    # the renamed monitor goes on as the monitor of the renamed history
    later = Free("P0", (4,), request="r1", gen=0)
    assert c.feed(rename_event(later, _NAMES, _BLOCKS)) == b.feed(rename_event(later, _NAMES, _BLOCKS))
    assert c.finish() == b.finish() != []
    assert a.key() != c.key()  # a is unchanged
    # declared pools follow their workers
    pools = Monitor(workers=WORKERS).renamed(_NAMES, _BLOCKS)
    assert pools.workers == {"P1": WORKERS["P0"], "D7": WORKERS["D0"]}


def test_from_key_and_with_key():
    a = Monitor("pull", complete=True, workers=WORKERS)
    a.feed_all(ev for _, ev in pull_handoff()[:5])
    b = Monitor.from_key(a.key(), "pull", complete=True, workers=WORKERS)
    assert b.key() == a.key() and b.policy == "pull" and b.complete and b.violations == []
    c = a.with_key(Monitor().key())
    assert c.key() == Monitor().key() and c.policy == "pull" and c.workers == a.workers
    rest = [ev for _, ev in pull_handoff()[5:]]
    assert b.feed_all(rest) == [] and b.finish() == []
