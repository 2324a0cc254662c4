"""Write the example histories of docs/examples/.

Each example is a list of labelled events plus, by hand, what ``pdproto
audit`` must report: for every expected violation its invariant, the label
of the event that makes it certain, and the labels of its witness lines.
The expectation goes into the header under the extra key ``"expect"``, and
tests/test_audit.py checks that the audit agrees.

The header's extra key ``"replay_expect"`` lists, as ``{"invariant":
"kv-corruption", "line": N}``, what ``pdproto replay`` reports on top of the
audit: the lines where the bug becomes wrong bytes that a commit, a decode, a
final check or the end of the history reads (empty when the data is fine).

Format 1.1 examples (shared prefixes, chunked and layer-wise transfers, fp8,
MLA, per-worker TP) declare the features they use; the others are version 1.

Run ``python docs/examples/make_examples.py`` after changing an example.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pdproto import (  # noqa: E402
    Cancel,
    Commit,
    Decode,
    Fail,
    Finish,
    Free,
    HistoryHeader,
    KVSpec,
    PrefillDone,
    PrefillStart,
    Reserve,
    Share,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = {
    "P0": WorkerSpec("prefill", 8),
    "D0": WorkerSpec("decode", 8),
}
END = "<end>"  # label of the end of the history (for leak and stuck)


def push_handoff(r="r1", gen=0, p_blocks=(0, 1), d_blocks=(0, 1), first=101, prompt=6):
    """A clean reserve-first (push) handoff of one generation, labelled."""
    t, x = f"t-{r}-{gen}", f"x-{r}-{gen}"
    return [
        ("submit", Submit(r, gen, prompt_len=prompt, max_new_tokens=3)),
        ("reserve", Reserve(r, gen, t, "D0", d_blocks)),
        ("prefill_start", PrefillStart(r, gen, "P0", p_blocks)),
        ("prefill_done", PrefillDone(r, gen, "P0", first_token=first, processed_len=prompt)),
        ("transfer_start", TransferStart(x, t, r, gen, "P0", p_blocks, "D0", d_blocks)),
        ("read_done", TransferReadDone(x)),
        ("free_p", Free("P0", p_blocks, request=r, gen=gen)),
        ("write_done", TransferWriteDone(x)),
        ("commit", Commit(r, gen, t, "D0")),
        ("decode1", Decode(r, gen, "D0", position=prompt, input_token=first, output_token=first + 1, blocks=d_blocks)),
        ("decode2", Decode(r, gen, "D0", position=prompt + 1, input_token=first + 1, output_token=first + 2, blocks=d_blocks)),
        ("finish", Finish(r, gen, reason="length")),
        ("free_d", Free("D0", d_blocks, request=r, gen=gen)),
    ]


def pull_handoff(r="r1", gen=0):
    """A clean prefill-first (pull) handoff: D reserves after prefill and reads from P."""
    t, x = f"t-{r}-{gen}", f"x-{r}-{gen}"
    return [
        ("submit", Submit(r, gen, prompt_len=6, max_new_tokens=2)),
        ("prefill_start", PrefillStart(r, gen, "P0", (0, 1))),
        ("prefill_done", PrefillDone(r, gen, "P0", first_token=7, processed_len=6)),
        ("reserve", Reserve(r, gen, t, "D0", (3, 4))),
        ("transfer_start", TransferStart(x, t, r, gen, "P0", (0, 1), "D0", (3, 4))),
        ("write_done", TransferWriteDone(x)),
        ("read_done", TransferReadDone(x)),
        ("free_p", Free("P0", (0, 1), request=r, gen=gen)),
        ("commit", Commit(r, gen, t, "D0")),
        ("decode1", Decode(r, gen, "D0", position=6, input_token=7, output_token=8, blocks=(3, 4))),
        ("finish", Finish(r, gen, reason="length")),
        ("free_d", Free("D0", (3, 4), request=r, gen=gen)),
    ]


def recompute_handoff(first_at=5):
    """A clean pull handoff under vLLM's first-token convention (header
    ``boundary: recompute``): P's sampled token (7) is discarded; D recomputes
    the last prompt token (55, position 5) and its output (8) is the first
    token.  ``first_at=6``: D feeds P's discarded token at prompt_len instead."""
    first_in = 55 if first_at == 5 else 7
    return replace(
        pull_handoff(), "decode1",
        ("decode1", Decode("r1", 0, "D0", position=first_at, input_token=first_in, output_token=8, blocks=(3, 4))),
        ("decode2", Decode("r1", 0, "D0", position=first_at + 1, input_token=8, output_token=9, blocks=(3, 4))),
    )


# -- format 1.1 ------------------------------------------------------------

#: the KV layout of the examples that need one: 2 layers, 4 positions a block
KV = KVSpec(layers=2, block_size=4)


def handoff_start(r, first, prompt, p_blocks, d_blocks, max_new=3):
    """submit, reserve, prefill_start and prefill_done of a push handoff."""
    return [
        (f"{r}_submit", Submit(r, 0, prompt_len=prompt, max_new_tokens=max_new)),
        (f"{r}_reserve", Reserve(r, 0, f"t-{r}", "D0", d_blocks)),
        (f"{r}_prefill_start", PrefillStart(r, 0, "P0", p_blocks)),
        (f"{r}_prefill_done", PrefillDone(r, 0, "P0", first_token=first, processed_len=prompt)),
    ]


def shared_prefix_start():
    """r1 prefills a 6-token prompt in P0 blocks [0, 1]; r2, whose prompt has
    the same first 4 tokens, hits the prefix cache: it shares block 0 and
    prefills only positions [4, 6) into block 2."""
    return handoff_start("r1", 101, 6, (0, 1), (0, 1)) + [
        ("r2_submit", Submit("r2", 0, prompt_len=6, max_new_tokens=2)),
        ("r2_reserve", Reserve("r2", 0, "t-r2", "D0", (2, 3))),
        ("r2_share", Share("r2", 0, "P0", (0,), tokens=4)),
        ("r2_prefill_start", PrefillStart("r2", 0, "P0", (2,))),
        ("r2_prefill_done", PrefillDone("r2", 0, "P0", first_token=201, processed_len=2)),
    ]


def clean_shared_prefix():
    """Both requests hand off; each frees its own reference to the shared block
    0, which returns to the pool with the second free."""
    return shared_prefix_start() + [
        ("x1_start", TransferStart("x1", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1))),
        ("x1_read_done", TransferReadDone("x1")),
        ("r1_free_p", Free("P0", (0, 1), request="r1", gen=0)),
        ("x2_start", TransferStart("x2", "t-r2", "r2", 0, "P0", (0, 2), "D0", (2, 3))),
        ("x2_read_done", TransferReadDone("x2")),
        ("r2_free_p", Free("P0", (0, 2), request="r2", gen=0)),
        ("x1_write_done", TransferWriteDone("x1")),
        ("r1_commit", Commit("r1", 0, "t-r1", "D0")),
        ("x2_write_done", TransferWriteDone("x2")),
        ("r2_commit", Commit("r2", 0, "t-r2", "D0")),
        ("r1_decode", Decode("r1", 0, "D0", position=6, input_token=101, output_token=102, blocks=(0, 1))),
        ("r2_decode", Decode("r2", 0, "D0", position=6, input_token=201, output_token=202, blocks=(2, 3))),
        ("r1_finish", Finish("r1", 0, reason="stop")),
        ("r1_free_d", Free("D0", (0, 1), request="r1", gen=0)),
        ("r2_finish", Finish("r2", 0, reason="length")),
        ("r2_free_d", Free("D0", (2, 3), request="r2", gen=0)),
    ]


def shared_prefix_freed_early():
    """r1 is cancelled and its free drops its reference to the shared block 0;
    the allocator, ignoring r2's reference, hands block 0 to r3, whose prefill
    overwrites it while r2's transfer has yet to read it."""
    return shared_prefix_start() + [
        ("x2_start", TransferStart("x2", "t-r2", "r2", 0, "P0", (0, 2), "D0", (2, 3))),
        ("r1_cancel", Cancel("r1", 0, reason="client")),
        ("r1_free_p", Free("P0", (0, 1), request="r1", gen=0)),
        ("r1_free_d", Free("D0", (0, 1), request="r1", gen=0)),
        ("r3_submit", Submit("r3", 0, prompt_len=4, max_new_tokens=2)),
        ("r3_reserve", Reserve("r3", 0, "t-r3", "D0", (4,))),
        ("r3_prefill_start", PrefillStart("r3", 0, "P0", (0,))),
        ("r3_prefill_done", PrefillDone("r3", 0, "P0", first_token=301, processed_len=4)),
        ("x2_read_done", TransferReadDone("x2")),
        ("x2_write_done", TransferWriteDone("x2")),
        ("r2_commit", Commit("r2", 0, "t-r2", "D0")),
    ]


def shared_prefix_written():
    """D0 serves r1; r2 hits D0's prefix cache on block 0, but P pushes r2's
    whole prompt, block 0 included, into the shared block."""
    return handoff_start("r1", 101, 6, (0, 1), (0, 1)) + [
        ("x1_start", TransferStart("x1", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1))),
        ("x1_read_done", TransferReadDone("x1")),
        ("x1_write_done", TransferWriteDone("x1")),
        ("r1_commit", Commit("r1", 0, "t-r1", "D0")),
        ("r1_decode1", Decode("r1", 0, "D0", position=6, input_token=101, output_token=102, blocks=(0, 1))),
        ("r2_submit", Submit("r2", 0, prompt_len=6, max_new_tokens=2)),
        ("r2_share", Share("r2", 0, "D0", (0,), tokens=4)),
        ("r2_reserve", Reserve("r2", 0, "t-r2", "D0", (3,))),
        ("r2_prefill_start", PrefillStart("r2", 0, "P0", (2, 3))),
        ("r2_prefill_done", PrefillDone("r2", 0, "P0", first_token=201, processed_len=6)),
        ("x2_start", TransferStart("x2", "t-r2", "r2", 0, "P0", (2, 3), "D0", (0, 3))),
        ("x2_read_done", TransferReadDone("x2")),
        ("x2_write_done", TransferWriteDone("x2")),
        ("r1_decode2", Decode("r1", 0, "D0", position=7, input_token=102, output_token=103, blocks=(0, 1))),
    ]


def chunked(commit_early=False):
    """A 10-token prompt (3 blocks of 4, the last one partial) moved in two
    chunks under one ticket: positions [0, 6) from blocks [0, 1], then [6, 10)
    from blocks [1, 2]; block 1 is split between the chunks at slot 2.  With
    ``commit_early``, D commits (and decodes) after the first chunk landed."""
    return _two_parts(
        handoff_start("r1", 101, 10, (0, 1, 2), (0, 1, 2)),
        TransferStart("x1", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1), tokens=(0, 6)),
        TransferStart("x2", "t-r1", "r1", 0, "P0", (1, 2), "D0", (1, 2), tokens=(6, 10)),
        (0, 1, 2), (0, 1, 2), 10, commit_early,
    )


def layerwise(commit_early=False):
    """An 8-token prompt (2 full blocks; D reserves a third for the decode)
    moved layer by layer under one ticket: layer 0, then layer 1.  With
    ``commit_early``, D commits (and decodes) after layer 0 landed."""
    return _two_parts(
        handoff_start("r1", 101, 8, (0, 1), (0, 1, 2)),
        TransferStart("x1", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1), layers=(0, 1)),
        TransferStart("x2", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1), layers=(1, 2)),
        (0, 1), (0, 1, 2), 8, commit_early,
    )


def _two_parts(start, x1, x2, p_blocks, blocks, prompt, commit_early):
    commit = ("commit", Commit("r1", 0, "t-r1", "D0"))
    decode1 = ("decode1", Decode("r1", 0, "D0", position=prompt, input_token=101, output_token=102, blocks=blocks))
    early = [commit, decode1] if commit_early else []
    late = [] if commit_early else [commit, decode1]
    return start + [
        ("x1_start", x1),
        ("x2_start", x2),
        ("x1_read_done", TransferReadDone("x1")),
        ("x1_write_done", TransferWriteDone("x1")),
        *early,
        ("x2_read_done", TransferReadDone("x2")),
        ("free_p", Free("P0", p_blocks, request="r1", gen=0)),
        ("x2_write_done", TransferWriteDone("x2")),
        *late,
        ("decode2", Decode("r1", 0, "D0", position=prompt + 1, input_token=102, output_token=103, blocks=blocks)),
        ("finish", Finish("r1", 0, reason="length")),
        ("free_d", Free("D0", blocks, request="r1", gen=0)),
    ]


def split_transfer():
    """Version 1: one ticket, two transfers, each moving one of the two blocks
    (the held-out replay case of issue 10).  Clean."""
    return replace(
        replace(
            push_handoff(),
            "transfer_start",
            ("transfer_start", TransferStart("x-a", "t-r1-0", "r1", 0, "P0", (0,), "D0", (0,))),
            ("transfer_start_b", TransferStart("x-b", "t-r1-0", "r1", 0, "P0", (1,), "D0", (1,))),
        ),
        "read_done",
        ("read_done", TransferReadDone("x-a")),
        ("read_done_b", TransferReadDone("x-b")),
    )[:-6] + [
        ("write_done", TransferWriteDone("x-a")),
        ("write_done_b", TransferWriteDone("x-b")),
    ] + push_handoff()[8:]


def replace(events, label, *new):
    """``events`` with the entry ``label`` replaced by ``new`` entries."""
    out = []
    for entry in events:
        out.extend(new if entry[0] == label else [entry])
    return out


def drop(events, *labels):
    return [e for e in events if e[0] not in labels]


def insert_after(events, label, *new):
    out = []
    for entry in events:
        out.append(entry)
        if entry[0] == label:
            out.extend(new)
    return out


def cancel_mid_transfer():
    """The client cancels while KV is in flight; D aborts the transfer and
    keeps its target blocks until the data plane reports the transfer failed."""
    base = push_handoff()[:5]
    return base + [
        ("cancel", Cancel("r1", 0, reason="client")),
        ("abort", TransferAbort("x-r1-0")),
        ("failed", TransferFailed("x-r1-0")),
        ("free_p", Free("P0", (0, 1), request="r1", gen=0)),
        ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
    ]


def retry_after_failure():
    """The transfer fails; the router gives gen 0 up and retries as gen 1 with
    a fresh ticket and transfer id.  Clean."""
    first = push_handoff()[:5] + [
        ("failed", TransferFailed("x-r1-0")),
        ("fail", Fail("r1", 0, reason="transfer failed")),
        ("free_p0", Free("P0", (0, 1), request="r1", gen=0)),
        ("free_d0", Free("D0", (0, 1), request="r1", gen=0)),
    ]
    return first + [(f"g1_{label}", ev) for label, ev in push_handoff(gen=1, p_blocks=(2, 3), d_blocks=(2, 3))]


# name -> (description, policy, complete, labelled events, expected violations[, options])
# an expected violation is (invariant, label of the event, [witness labels]); the
# options (format 1.1 and replay) are those of write_example: features, kv,
# workers, and replay: the labels of the lines where replay finds kv-corruption
EXAMPLES = {
    "clean-push": ("A clean reserve-first (push) handoff.", "push", True, push_handoff(), []),
    "clean-pull": ("A clean prefill-first (pull) handoff.", "pull", True, pull_handoff(), []),
    "cancel-mid-transfer": (
        "Cancel while the KV is in flight, handled correctly: abort, wait for the "
        "transfer to end, then free both sides.",
        "push", True, cancel_mid_transfer(), [],
    ),
    "retry-after-failure": (
        "A failed transfer, the generation given up and retried as gen 1. Clean.",
        "push", True, retry_after_failure(), [],
    ),
    "double-allocation": (
        "Two requests are handed the same D block.",
        "push", False,
        push_handoff()[:2] + [("submit2", Submit("r2", 0, prompt_len=6)), ("reserve2", Reserve("r2", 0, "t-r2-0", "D0", (1, 2)))],
        [("double-allocation", "reserve2", ["reserve"])],
    ),
    "bad-free": (
        "D frees its blocks twice (a duplicate finish notification frees again).",
        "push", False,
        push_handoff() + [("free_again", Free("D0", (0,), request="r1", gen=0))],
        [("bad-free", "free_again", ["free_d"])],
    ),
    "early-source-free": (
        "P frees its source blocks on a timer while D is still reading them "
        "(vllm-project/vllm#21570).",
        "pull", False,
        drop(pull_handoff(), "free_p")[:6]
        + [("free_p", Free("P0", (0, 1), request="r1", gen=0))],
        [("early-source-free", "free_p", ["transfer_start"])],
    ),
    "early-target-reuse": (
        "D frees the target blocks on abort while P's write is still in flight, and "
        "reuses them (sgl-project/sglang#35049).",
        "push", False,
        push_handoff()[:6]
        + [
            ("cancel", Cancel("r1", 0)),
            ("abort", TransferAbort("x-r1-0")),
            ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
        ],
        [("early-target-reuse", "free_d", ["transfer_start"])],
    ),
    "commit-before-ready": (
        "D commits although the transfer failed (vllm-project/vllm#52234).",
        "push", False,
        push_handoff()[:6] + [("failed", TransferFailed("x-r1-0")), ("commit", Commit("r1", 0, "t-r1-0", "D0"))],
        [("commit-before-ready", "commit", ["reserve", "transfer_start"])],
    ),
    "double-commit": (
        "A duplicated completion commits the same generation twice "
        "(vllm-project/vllm#46240).",
        "push", False,
        push_handoff()[:9] + [("commit2", Commit("r1", 0, "t-r1-0", "D0"))],
        [("double-commit", "commit2", ["commit"])],
    ),
    "resurrection": (
        "A late completion starts decoding a request the client cancelled.",
        "push", False,
        push_handoff()[:8] + [("cancel", Cancel("r1", 0)), ("commit", Commit("r1", 0, "t-r1-0", "D0"))],
        [("resurrection", "commit", ["cancel"])],
    ),
    "stale-generation": (
        "A completion of gen 0 arrives after the retry gen 1 was submitted and commits "
        "(volcano-sh/kthena#1424, sgl-project/sglang#17259).",
        "push", False,
        push_handoff()[:8]
        + [("submit1", Submit("r1", 1, prompt_len=6)), ("commit", Commit("r1", 0, "t-r1-0", "D0"))],
        [("stale-generation", "commit", ["submit1"])],
    ),
    "ticket-mismatch": (
        "The retry commits under the ticket of the old generation.",
        "push", False,
        push_handoff()[:8]
        + [
            ("fail", Fail("r1", 0)),
            ("submit1", Submit("r1", 1, prompt_len=6)),
            ("commit", Commit("r1", 1, "t-r1-0", "D0")),
        ],
        [("ticket-mismatch", "commit", ["reserve"])],
    ),
    "id-reuse": (
        "The retry reuses the ticket id of the first attempt "
        "(vllm-project/vllm#49796).",
        "push", False,
        push_handoff()[:2]
        + [
            ("cancel", Cancel("r1", 0)),
            ("free_d", Free("D0", (0, 1), request="r1", gen=0)),
            ("submit1", Submit("r1", 1, prompt_len=6)),
            ("reserve1", Reserve("r1", 1, "t-r1-0", "D0", (0, 1))),
        ],
        [("id-reuse", "reserve1", ["reserve"])],
    ),
    "unknown-transfer": (
        "A completion names a transfer that never started.",
        "push", False,
        push_handoff()[:5] + [("write_done", TransferWriteDone("x-nope"))],
        [("unknown-transfer", "write_done", [])],
    ),
    "foreign-block-access": (
        "Decode reads a block that belongs to another request.",
        "push", False,
        push_handoff()[:9]
        + [
            ("submit2", Submit("r2", 0, prompt_len=6)),
            ("reserve2", Reserve("r2", 0, "t-r2-0", "D0", (5,))),
            ("decode1", Decode("r1", 0, "D0", position=6, input_token=101, output_token=102, blocks=(0, 5))),
        ],
        [("foreign-block-access", "decode1", ["reserve2"])],
    ),
    "decode-before-commit": (
        "D starts decoding before it committed ownership.",
        "push", False,
        push_handoff()[:8]
        + [("decode1", Decode("r1", 0, "D0", position=6, input_token=101, output_token=102, blocks=(0, 1)))],
        [("decode-before-commit", "decode1", [])],
    ),
    "first-token-boundary": (
        "D decodes from the last prompt token at position prompt_len - 1 instead of "
        "feeding the first token at prompt_len (vllm-project/vllm#50558).",
        "push", False,
        push_handoff()[:9]
        + [("decode1", Decode("r1", 0, "D0", position=5, input_token=55, output_token=101, blocks=(0, 1)))],
        [("first-token-boundary", "decode1", ["submit", "prefill_done"])],
    ),
    "decode-continuity": (
        "A decode step skips a position.",
        "push", False,
        replace(
            push_handoff()[:11],
            "decode2",
            ("decode2", Decode("r1", 0, "D0", position=8, input_token=102, output_token=103, blocks=(0, 1))),
        ),
        [("decode-continuity", "decode2", ["decode1"])],
    ),
    "reserve-before-prefill": (
        "Push mode, but P starts prefill before D reserved capacity.",
        "push", False,
        drop(push_handoff(), "reserve")[:2],
        [("reserve-before-prefill", "prefill_start", ["submit"])],
    ),
    "capacity": (
        "A reservation names a block outside D's declared pool of 8.",
        "push", False,
        push_handoff()[:1] + [("reserve", Reserve("r1", 0, "t-r1-0", "D0", (7, 8)))],
        [("capacity", "reserve", ["<header>"])],
    ),
    "leak": (
        "The abort is ignored after the handoff: D's blocks are never freed "
        "(vllm-project/vllm#29906).",
        "push", True,
        push_handoff()[:10] + [("cancel", Cancel("r1", 0))],
        [("leak", END, ["reserve", "cancel"])],
    ),
    "stuck": (
        "D waits for a completion that never comes and never times out "
        "(vllm-project/vllm#46283).",
        "push", True,
        push_handoff()[:5] + [("read_done", TransferReadDone("x-r1-0")), ("free_p", Free("P0", (0, 1), request="r1", gen=0))],
        [("leak", END, ["transfer_start"]), ("stuck", END, ["submit"])],
    ),
    # -- format 1.1 -----------------------------------------------------------
    "clean-shared-prefix": (
        "Prefix caching on P: r2 shares r1's prefix block and prefills only the rest; each "
        "frees its own reference. Clean.",
        "push", True, clean_shared_prefix(), [], {"features": ["share", "kv"], "kv": KVSpec(block_size=4)},
    ),
    "double-allocation-shared-prefix": (
        "The shared prefix freed early: r1's cancel frees the block r2 shares, the allocator "
        "hands it to r3, whose prefill overwrites the prefix r2 then transfers.",
        "push", False, shared_prefix_freed_early(),
        [("double-allocation", "r3_prefill_start", ["r2_share"])],
        {"features": ["share", "kv"], "kv": KVSpec(block_size=4), "replay": ["r2_commit"]},
    ),
    "foreign-block-access-shared-prefix": (
        "Prefix caching on D: r2 shares r1's prefix block there, but P pushes r2's whole prompt, "
        "writing over the shared prefix r1 is decoding from (vllm-project/vllm#48758).",
        "push", False, shared_prefix_written(),
        [("foreign-block-access", "x2_start", ["r2_share"])],
        {"features": ["share", "kv"], "kv": KVSpec(block_size=4), "replay": ["r1_decode2"]},
    ),
    "clean-chunked-transfer": (
        "A chunked transfer: two token ranges under one ticket, split inside a block, the last "
        "block partial. Clean.",
        "push", True, chunked(), [], {"features": ["ranges", "kv"], "kv": KV},
    ),
    "commit-before-ready-chunk": (
        "D commits after the first chunk landed and decodes before the second "
        "(sgl-project/sglang#30233, vllm-project/vllm#50754).",
        "push", True, chunked(commit_early=True),
        [("commit-before-ready", "commit", ["r1_reserve", "x1_start", "x2_start"])],
        {"features": ["ranges", "kv"], "kv": KV, "replay": ["decode1"]},
    ),
    "clean-layerwise-transfer": (
        "A layer-wise transfer: one transfer per layer under one ticket. Clean.",
        "push", True, layerwise(), [], {"features": ["ranges", "kv"], "kv": KV},
    ),
    "commit-before-ready-layer": (
        "D commits after layer 0 landed and decodes before layer 1 did.",
        "push", True, layerwise(commit_early=True),
        [("commit-before-ready", "commit", ["r1_reserve", "x1_start", "x2_start"])],
        {"features": ["ranges", "kv"], "kv": KV, "replay": ["decode1"]},
    ),
    "clean-fp8-kv": (
        "A clean handoff of fp8 (e4m3) KV with one scale per block.",
        "push", True, push_handoff(), [],
        {"features": ["kv"], "kv": KVSpec(layers=2, kv_heads=4, head_dim=8, block_size=4,
                                          dtype="float8_e4m3fn", scale="per-block")},
    ),
    "clean-mla-kv": (
        "A clean handoff of MLA KV (one latent vector per token and layer, no heads), replicated "
        "on both TP ranks of D.",
        "push", True, push_handoff(), [],
        {"features": ["kv", "parallel"], "kv": KVSpec(layers=2, head_dim=8, block_size=4, layout="mla"),
         "workers": {"P0": WorkerSpec("prefill", 8, tp=1), "D0": WorkerSpec("decode", 8, tp=2)}},
    ),
    "clean-per-worker-tp": (
        "A clean handoff from a prefill worker with 2 TP ranks to a decode worker with 1.",
        "push", True, push_handoff(), [],
        {"features": ["parallel"],
         "workers": {"P0": WorkerSpec("prefill", 8, tp=2), "D0": WorkerSpec("decode", 8, tp=1)}},
    ),
    "clean-split-transfer": (
        "Version 1: one ticket, two transfers each moving part of the blocks. Clean.",
        "push", True, split_transfer(), [],
    ),
    "clean-recompute": (
        "vLLM's first-token convention (boundary recompute): P's sampled token is discarded "
        "and D's first decode recomputes the last prompt token at position prompt_len - 1. Clean.",
        "pull", True, recompute_handoff(), [], {"features": ["boundary"], "boundary": "recompute"},
    ),
    "first-token-boundary-recompute": (
        "Under vLLM's convention (boundary recompute) D skips the recompute and feeds P's "
        "discarded sample at position prompt_len: the first generated token never reaches the "
        "client, and decoding runs one position ahead of the stream it reports.",
        "pull", False, recompute_handoff(first_at=6)[:10],
        [("first-token-boundary", "decode1", ["submit", "prefill_done"])],
        {"features": ["boundary"], "boundary": "recompute", "replay": ["decode1"]},
    ),
}

#: what replay reports on the version 1 examples (labels of kv-corruption lines)
V1_REPLAY = {
    "commit-before-ready": ["commit"],
    "decode-continuity": ["decode2", "decode2"],
    "early-source-free": [END],
    "early-target-reuse": [END],
    "first-token-boundary": [END],
    "foreign-block-access": ["decode1"],
}


def write_example(name, description, policy, complete, events, expect, options=None):
    lines = {"<header>": 1}
    for i, (label, _) in enumerate(events):
        assert label not in lines, f"{name}: duplicate label {label}"
        lines[label] = i + 2
    lines[END] = len(events) + 1
    expected = [
        {"invariant": inv, "line": lines[at], "witness": sorted(lines[w] for w in witness)}
        for inv, at, witness in expect
    ]
    options = options or {}
    replay = options.get("replay", V1_REPLAY.get(name, []))
    header = HistoryHeader(
        policy=policy,
        complete=complete,
        workers=options.get("workers", WORKERS),
        extra={
            "description": description,
            "expect": expected,
            "replay_expect": [{"invariant": "kv-corruption", "line": lines[at]} for at in replay],
        },
        features=options.get("features", ()),
        kv=options.get("kv"),
        boundary=options.get("boundary", "sampled"),
    )
    path = os.path.join(HERE, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(header.to_dict()) + "\n")
        for _, event in events:
            fh.write(json.dumps(event.to_dict()) + "\n")
    return path


def main() -> None:
    for name, spec in EXAMPLES.items():
        print(write_example(name, *spec))


if __name__ == "__main__":
    main()
