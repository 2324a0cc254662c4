"""Write the example histories of docs/examples/.

Each example is a list of labelled events plus, by hand, what ``pdproto
audit`` must report: for every expected violation its invariant, the label
of the event that makes it certain, and the labels of its witness lines.
The expectation goes into the header under the extra key ``"expect"``, and
tests/test_examples.py checks that the audit agrees.

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
    PrefillDone,
    PrefillStart,
    Reserve,
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


# name -> (description, policy, complete, labelled events, expected violations)
# an expected violation is (invariant, label of the event, [witness labels])
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
}


def write_example(name, description, policy, complete, events, expect):
    lines = {"<header>": 1}
    for i, (label, _) in enumerate(events):
        assert label not in lines, f"{name}: duplicate label {label}"
        lines[label] = i + 2
    lines[END] = len(events) + 1
    expected = [
        {"invariant": inv, "line": lines[at], "witness": sorted(lines[w] for w in witness)}
        for inv, at, witness in expect
    ]
    header = HistoryHeader(
        policy=policy,
        complete=complete,
        workers=WORKERS,
        extra={"description": description, "expect": expected},
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
