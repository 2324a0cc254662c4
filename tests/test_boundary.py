"""The header's first-token convention (``boundary``, format 1.1): the seed's
``sampled`` and vLLM's ``recompute``, read, written and judged."""

from __future__ import annotations

import json

import pytest

from pdproto import HistoryFormatError, HistoryHeader, Monitor, UsageError
from pdproto.spec import (
    Commit,
    Decode,
    PrefillDone,
    PrefillStart,
    Reserve,
    Submit,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    open_history,
)

RECOMPUTE = {"pdproto": "history", "version": "1.1", "features": ["boundary"], "policy": "pull",
             "boundary": "recompute"}


def read_header(tmp_path, obj):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    with open_history(str(path)) as reader:
        return reader.header


def test_header_round_trip_and_default(tmp_path):
    header = read_header(tmp_path, RECOMPUTE)
    assert header.boundary == "recompute" and header.version == "1.1"
    assert HistoryHeader.from_dict(header.to_dict()) == header
    assert HistoryHeader().boundary == "sampled" and "boundary" not in HistoryHeader().to_dict()


def test_recompute_needs_the_feature_and_a_known_value(tmp_path):
    with pytest.raises(HistoryFormatError, match="feature 'boundary'") as err:
        read_header(tmp_path, {**RECOMPUTE, "features": []})
    assert err.value.field == "boundary"
    with pytest.raises(HistoryFormatError, match="sampled, recompute") as err:
        read_header(tmp_path, {**RECOMPUTE, "boundary": "last"})
    assert err.value.value == "last"
    with pytest.raises(ValueError, match="without declaring"):
        HistoryHeader(boundary="recompute")
    with pytest.raises(UsageError):
        Monitor(boundary="first")


def test_version_1_keeps_boundary_as_an_unknown_key(tmp_path):
    header = read_header(tmp_path, {"pdproto": "history", "version": 1, "boundary": "recompute"})
    assert header.boundary == "sampled" and header.extra == {"boundary": "recompute"}


def handoff(prompt=6, ranges=None):
    events = [
        Submit("r", 0, prompt_len=prompt, max_new_tokens=2),
        PrefillStart("r", 0, "P0", (0, 1)),
        PrefillDone("r", 0, "P0", first_token=7, processed_len=prompt),
        Reserve("r", 0, "t", "D0", (0, 1)),
        TransferStart("x", "t", "r", 0, "P0", (0, 1), "D0", (0, 1), **(ranges or {})),
        TransferReadDone("x"),
        TransferWriteDone("x"),
        Commit("r", 0, "t", "D0"),
    ]
    return events


def judge(events, boundary, **kw):
    monitor = Monitor("pull", boundary=boundary, **kw)
    for e in events:
        monitor.feed(e)
    return [v.invariant for v in monitor.violations]


@pytest.mark.parametrize("boundary, position, token, ok", [
    ("recompute", 5, 55, True),      # vLLM: the last prompt token, recomputed
    ("recompute", 6, 7, False),      # the seed's convention in a vLLM history
    ("recompute", 4, 55, False),     # two tokens back
    ("sampled", 6, 7, True),         # the seed's
    ("sampled", 5, 55, False),       # vLLM's, where the seed's is declared (vllm#50558)
    ("sampled", 6, 8, False),        # the right position, another token
])
def test_first_decode_position_under_each_convention(boundary, position, token, ok):
    events = handoff() + [Decode("r", 0, "D0", position=position, input_token=token, output_token=8,
                                 blocks=(0, 1))]
    assert judge(events, boundary) == ([] if ok else ["first-token-boundary"])


def test_recompute_budget_counts_no_token_of_p():
    # max_new_tokens=2: recompute allows two decodes; the seed's, one (P sampled the first)
    two = handoff() + [Decode("r", 0, "D0", position=5, input_token=55, output_token=8, blocks=(0, 1)),
                       Decode("r", 0, "D0", position=6, input_token=8, output_token=9, blocks=(0, 1))]
    assert judge(two, "recompute") == []
    three = two + [Decode("r", 0, "D0", position=7, input_token=9, output_token=10, blocks=(0, 1))]
    assert judge(three, "recompute") == ["decode-continuity"]


def test_recompute_readiness_needs_all_but_the_last_prompt_position():
    # a ranged transfer of positions [0, 5) of a 6-token prompt: enough for
    # recompute (D computes position 5 itself), not for the seed's convention
    events = handoff(ranges={"tokens": (0, 5)})
    assert judge(events, "recompute", block_size=4) == []
    assert judge(events, "sampled", block_size=4) == ["commit-before-ready"]
    short = handoff(ranges={"tokens": (0, 4)})
    assert judge(short, "recompute", block_size=4) == ["commit-before-ready"]


def test_from_header_carries_the_convention(tmp_path):
    header = read_header(tmp_path, RECOMPUTE)
    assert Monitor.from_header(header).boundary == "recompute"
    assert Monitor.from_header(header).copy().boundary == "recompute"
