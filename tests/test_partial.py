"""Partial histories (format 1.1 feature ``observed``): what the monitor may
judge when only some event kinds (and fields) were observed."""

from __future__ import annotations

import io
import json
import os
import random
import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import HistoryFormatError, UsageError
from pdproto._cli import main
from pdproto.drivers import audit
from pdproto.protocol import HandoffModel, ModelConfig
from pdproto.spec import (
    EVENT_TYPES,
    INVARIANT_NEEDS,
    INVARIANTS,
    Alloc,
    Free,
    HistoryHeader,
    HistoryReader,
    HistoryWriter,
    Monitor,
    Observation,
    PartialMonitor,
    Submit,
    TransferReadDone,
    TransferStart,
    write_history,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = tuple(EVENT_TYPES)
_COMPLETIONS = ("transfer_read_done", "transfer_write_done", "transfer_failed", "transfer_abort")


# -- the reference model's histories, with kinds erased ---------------------------------


def walk(config: ModelConfig, seed: int, steps: int = 400) -> tuple[HistoryHeader, list, bool]:
    """One random run of the reference model, faults included but taken
    less often than progress (at a rate drawn per run, so that requests get
    far before a fault ends them); whether it ran until no action was left
    (then the history is complete)."""
    rng = random.Random(seed)
    fault_rate = rng.choice([0.05, 0.2, 0.5])
    model = HandoffModel(config)
    state = model.initial_states()[0]
    events: list = []
    for _ in range(steps):
        acts = model.actions(state)
        if not acts:
            return model.header, events, True
        calm = [a for a in acts if not a.fault]
        state, evs = model.step(state, rng.choice(calm if calm and rng.random() > fault_rate else acts))
        events.extend(evs)
    return model.header, events, False


def config_for(seed: int, policy: str) -> ModelConfig:
    return ModelConfig.all_faults(
        1 + seed % 2, policy=policy, requests=1 + seed % 4, blocks=4, prefill_workers=1 + seed % 2,
        decode_workers=1 + (seed // 2) % 2, prompt_len=3 + seed % 4, max_new_tokens=1 + seed % 3,
    )


def verdict(monitor: Monitor, events: list[tuple[int, object]]) -> set[tuple[str, int]]:
    for line, e in events:
        monitor.feed(e, line)
    monitor.finish()
    return {(v.invariant, v.line) for v in monitor.violations}


def erased(events: list, kinds: frozenset, by_request: bool) -> list[tuple[int, object]]:
    """The numbered events a source observing only ``kinds`` records (each
    keeps its line in the complete history).  ``by_request``: a completion
    whose start was not observed names its request, gen and workers instead
    of its transfer, and a free whose allocations were not observed leaves
    out its blocks (as a log that names requests does)."""
    starts = {e.transfer: e for e in events if e.EV == "transfer_start"}
    out = []
    for line, e in enumerate(events, start=2):
        if e.EV not in kinds:
            continue
        if by_request and e.EV in _COMPLETIONS and "transfer_start" not in kinds:
            s = starts[e.transfer]
            e = attrs.evolve(e, transfer=None, request=s.request, gen=s.gen, src=s.src, dst=s.dst)
        elif by_request and e.EV == "free" and e.request is not None and "alloc" not in kinds:
            e = attrs.evolve(e, blocks=None)
        out.append((line, e))
    return out


def _check_partial_within_complete(policy: str, seed: int, kinds: frozenset, by_request: bool) -> None:
    header, events, quiet = walk(config_for(seed, policy), seed)
    header = attrs.evolve(header, complete=quiet)
    if "share" not in header.features:
        kinds = kinds - {"share"}  # a kind of an undeclared feature: there is none to observe
    full = verdict(Monitor.from_header(header), list(enumerate(events, start=2)))
    assert not full, (seed, full)  # the reference model is correct: its histories are clean
    fields = {}
    if by_request:
        fields = {k: {"request", "gen", "src", "dst"} for k in _COMPLETIONS if k in kinds}
        if "free" in kinds:
            fields["free"] = {"worker", "request", "gen"}
    partial_header = attrs.evolve(header, features=header.features | {"observed"},
                                  observed=Observation(kinds, fields), version="1.1")
    monitor = Monitor.from_header(partial_header)
    assert isinstance(monitor, PartialMonitor)
    part = verdict(monitor, erased(events, kinds, by_request))
    assert part <= full, (seed, sorted(kinds), part - full)


@pytest.mark.parametrize("policy", ["push", "pull"])
@given(seed=st.integers(0, 10_000), kinds=st.frozensets(st.sampled_from(KINDS)))
@settings(max_examples=60, deadline=None)
def test_partial_verdict_never_adds_a_violation(policy, seed, kinds):
    """Complete histories of the reference model, with a random subset of
    kinds erased: the partial verdict has no violation the complete one
    lacks (and the complete one has none)."""
    _check_partial_within_complete(policy, seed, kinds, by_request=False)


@pytest.mark.parametrize("policy", ["push", "pull"])
@given(seed=st.integers(0, 10_000), kinds=st.frozensets(st.sampled_from(KINDS)))
@settings(max_examples=60, deadline=None)
def test_partial_verdict_by_request_never_adds_a_violation(policy, seed, kinds):
    """The same with completions that name their request (not their
    transfer) and frees that leave out their blocks, as real logs do."""
    _check_partial_within_complete(policy, seed, kinds, by_request=True)


def test_partial_verdict_with_every_kind_is_the_complete_verdict():
    """Observing every kind judges every invariant: a mutant's violations
    are found on the partial history too."""
    header, events, _ = walk(config_for(3, "pull"), 3)
    # a history with violations: the second half's events again, renumbered
    bad = events + events[len(events) // 2:]
    full = verdict(Monitor.from_header(header), list(enumerate(bad, start=2)))
    obs = Observation(frozenset(KINDS) - {"share"})
    partial = Monitor.from_header(attrs.evolve(header, features=header.features | {"observed"}, observed=obs,
                                               version="1.1"))
    assert partial.not_judged == ()
    assert verdict(partial, list(enumerate(bad, start=2))) == full and full


# -- the vLLM case: lease expiry, then a late read ----------------------------------

VLLM_OBSERVED = Observation(
    {"free", "transfer_read_done", "transfer_write_done", "transfer_failed", "finish"},
    {"free": {"worker", "request"}, "transfer_read_done": {"request", "src"},
     "transfer_write_done": {"request", "dst"}, "transfer_failed": {"request"}, "finish": {"request"}},
)
VLLM_HEADER = HistoryHeader(policy="pull", features={"observed"}, observed=VLLM_OBSERVED)


def _write(tmp_path, events, header=VLLM_HEADER) -> str:
    path = str(tmp_path / "h.jsonl")
    write_history(path, events, header)
    return path


def test_lease_expiry_then_late_read_is_early_source_free(tmp_path, capsys):
    """vLLM: P logs "Releasing expired KV blocks for request X" (a free of
    X's blocks on P), later "Potentially invalid KV blocks for unrecognized
    request X were retrieved by a decode worker" (D's read of X completed)."""
    path = _write(tmp_path, [
        TransferReadDone(None, request="A", src="P", extra={"log_line": 3}),  # a normal handoff first
        Free("P", None, request="A", extra={"log_line": 4}),
        Free("P", None, request="X", extra={"log_line": 17}),
        TransferReadDone(None, request="X", src="P", extra={"log_line": 42}),
    ])
    assert main(["audit", "--json", path]) == 1
    out = json.loads(capsys.readouterr().out)
    (v,) = out["violations"]
    assert v["invariant"] == "early-source-free" and v["line"] == 5 and v["witness"] == [4]
    assert v["request"] == "X" and v["gen"] is None
    assert v["log_line"] == 42 and v["witness_log_lines"] == [17]
    assert "request 'X'" in v["message"]
    assert out["observed"] == sorted(VLLM_OBSERVED.kinds)
    judged = {e["invariant"] for e in out["not_judged"]}
    assert "early-source-free" not in judged and "double-allocation" in judged
    # the table names the log line beside the history line
    assert main(["audit", path]) == 1
    text = capsys.readouterr().out
    assert "log line" in text and "42" in text and "not judged" in text


def test_clean_partial_log_exits_0_listing_what_was_not_judged(tmp_path, capsys):
    path = _write(tmp_path, [
        TransferReadDone(None, request="A", src="P"),
        Free("P", None, request="A"),
        Free("D", None, request="A"),
    ])
    assert main(["audit", "--json", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["violations"] == [] and out["requests"] == 1
    entry = next(e for e in out["not_judged"] if e["invariant"] == "bad-free")
    assert entry["needs"] == sorted(INVARIANT_NEEDS["bad-free"][0])
    assert set(entry["missing"]) == {"alloc", "prefill_start", "reserve", "restart"}
    assert main(["audit", path]) == 0
    text = capsys.readouterr().out
    assert "no invariant violated" in text and "bad-free: needs alloc" in text


def test_a_read_after_a_new_allocation_is_not_judged_early(tmp_path):
    """The free of X's blocks, then X allocates again (a re-prefill), then a
    read of X: the read may be of the new blocks, so nothing is certain."""
    obs = Observation({"free", "alloc", "transfer_read_done"},
                      {"free": {"worker", "request"}, "transfer_read_done": {"request", "src"}})
    header = HistoryHeader(features={"observed"}, observed=obs)
    path = _write(tmp_path, [Free("P", None, request="X"), Alloc("X", 0, "P", (1,)),
                             TransferReadDone(None, request="X", src="P")], header)
    assert audit(path).ok


def test_a_read_of_another_worker_or_gen_is_not_early(tmp_path):
    obs = Observation({"free", "transfer_read_done"},
                      {"free": {"worker", "request", "gen"}, "transfer_read_done": {"request", "src", "gen"}})
    header = HistoryHeader(features={"observed"}, observed=obs)
    path = _write(tmp_path, [Free("P0", None, request="X", gen=0),
                             TransferReadDone(None, request="X", gen=0, src="P1"),
                             TransferReadDone(None, request="X", gen=1, src="P0")], header)
    assert audit(path).ok


def test_free_without_blocks_frees_what_the_request_holds(tmp_path):
    """Ownership observed: a free that leaves out its blocks frees the
    request's blocks on that worker, and is checked block by block."""
    obs = Observation(set(KINDS) - {"share"}, {"free": {"worker", "request"}})
    header = HistoryHeader(policy="pull", features={"observed"}, observed=obs)
    m = Monitor.from_header(header)
    m.feed(Submit("X", 0, 4), 2)
    m.feed(Alloc("X", 0, "P", (1, 2)), 3)
    m.feed(Alloc("X", 0, "D", (5, 6)), 4)
    m.feed(TransferStart("t", "k", "X", 0, "P", (1, 2), "D", (5, 6)), 5)
    (v,) = m.feed(Free("P", None, request="X"), 6)
    assert v.invariant == "early-source-free" and v.block == 1 and v.request == "X" and v.witness == (5,)
    assert m.not_judged == ()
    assert m._held("X", None, "D") == (5, 6) and m._held("X", None, "P") == ()


def test_left_out_gen_is_the_latest_and_reported_as_unknown():
    obs = Observation({"submit", "decode", "commit", "finish"}, {"decode": {"request", "worker", "position",
                      "input_token", "output_token", "blocks"}})
    m = Monitor.from_header(HistoryHeader(features={"observed"}, observed=obs))
    m.feed(Submit("X", 3, 4), 2)
    from pdproto.spec import Decode

    (v,) = m.feed(Decode("X", None, "D", 4, 7, 8, (0,)), 3)
    assert v.invariant == "decode-before-commit" and v.gen is None and "gen 3" in v.message


def test_a_partial_monitor_copies_as_a_partial_monitor():
    m = Monitor.from_header(VLLM_HEADER)
    m.feed(Free("P", None, request="X"), 2)
    c = m.copy()
    assert type(c) is PartialMonitor and c.not_judged == m.not_judged
    assert [v.invariant for v in c.feed(TransferReadDone(None, request="X", src="P"), 3)] == ["early-source-free"]
    assert m.violations == []


def test_freed_memory_is_bounded(monkeypatch):
    from pdproto.spec import _partial

    monkeypatch.setattr(_partial, "FREED_MEMORY", 3)
    m = Monitor.from_header(VLLM_HEADER)
    for i in range(10):
        m.feed(Free("P", None, request=f"r{i}"))
    assert len(m._freed) == 3 and set(m._freed) == {"r7", "r8", "r9"}


# -- audit --observed ------------------------------------------------------------------


def test_observed_flag_overrides_a_complete_history(capsys):
    path = os.path.join(ROOT, "docs", "examples", "early-source-free.jsonl")
    assert main(["audit", "--json", path]) == 1
    capsys.readouterr()
    # without transfer_start nothing shows the free was early
    assert main(["audit", "--json", "--observed", "submit,alloc,free,reserve,prefill_start", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["observed"] == sorted(["submit", "alloc", "free", "reserve", "prefill_start"])
    assert "early-source-free" in {e["invariant"] for e in out["not_judged"]}
    every = ",".join(KINDS)
    assert main(["audit", "--json", "--observed", every, path]) == 1
    assert json.loads(capsys.readouterr().out)["not_judged"] == []


def test_observed_flag_rejects_an_unknown_kind(capsys):
    path = os.path.join(ROOT, "docs", "examples", "clean-push.jsonl")
    assert main(["audit", "--observed", "free,frees", path]) == 2
    err = capsys.readouterr().err
    assert "'frees'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_complete_history_json_says_so(capsys):
    path = os.path.join(ROOT, "docs", "examples", "clean-push.jsonl")
    assert main(["audit", "--json", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["observed"] is None and out["not_judged"] == []


# -- the format ------------------------------------------------------------------------


def _header(observed: object, features=("observed",)) -> str:
    return json.dumps({"pdproto": "history", "version": "1.1", "features": list(features), "observed": observed})


@pytest.mark.parametrize("observed, features, message", [
    ({"kinds": ["free"]}, (), "belongs to feature 'observed'"),
    ({"kinds": "free"}, ("observed",), "observed.kinds must be a list"),
    ({"kinds": ["frees"]}, ("observed",), "unknown event kind(s) ['frees']"),
    ({"kinds": ["free", "free"]}, ("observed",), "more than once"),
    ({"kinds": ["free"], "fields": {"alloc": ["worker"]}}, ("observed",), "kinds does not list"),
    ({"kinds": ["free"], "fields": {"free": ["worker", "block"]}}, ("observed",), "not field(s) of 'free'"),
    ({"kinds": ["alloc"], "fields": {"alloc": ["request"]}}, ("observed",), "it may leave out only gen"),
    ({"kinds": ["free"], "fields": {"free": ["worker"]}}, ("observed",), "at least one of blocks, request"),
    ({"kinds": ["share"]}, ("observed",), "belongs to feature 'share'"),
    ({"kinds": ["free"], "extra": 1}, ("observed",), "observed.extra is not an observed key"),
    ([], ("observed",), "observed must be an object"),
])
def test_bad_observed_header_is_one_clear_error(tmp_path, capsys, observed, features, message):
    path = tmp_path / "h.jsonl"
    path.write_text(_header(observed, features) + "\n")
    assert main(["audit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and ":1:" in err and len(err.splitlines()) == 1


def test_events_must_fit_the_observation(tmp_path):
    head = _header({"kinds": ["free", "transfer_read_done"],
                    "fields": {"free": ["worker", "request"], "transfer_read_done": ["request"]}})
    for line, message in [
        ({"ev": "alloc", "request": "r", "gen": 0, "worker": "P", "blocks": [1]}, "not one the header's observed"),
        ({"ev": "free", "worker": "P", "blocks": [1]}, "which the header's observed.fields says"),
        ({"ev": "transfer_read_done", "transfer": "t"}, "which the header's observed.fields says"),
        ({"ev": "free", "request": "r"}, "field 'worker'"),
    ]:
        with pytest.raises(HistoryFormatError) as info:
            list(HistoryReader(io.StringIO(head + "\n" + json.dumps(line) + "\n")))
        assert message in str(info.value) and info.value.line == 2


def test_round_trip_keeps_left_out_fields_out():
    buf = io.StringIO()
    writer = HistoryWriter(buf, VLLM_HEADER)
    events = [Free("P", None, request="X", extra={"log_line": 9}),
              TransferReadDone(None, request="X", src="P"),
              TransferReadDone("t1", request="X", src="P")]
    for e in events:
        writer.write(e)
    text = buf.getvalue()
    assert '"blocks"' not in text and '"transfer": null' not in text
    reader = HistoryReader(io.StringIO(text))
    assert reader.header == VLLM_HEADER and reader.header.observed == VLLM_OBSERVED
    assert [e for _, e in reader] == events


def test_writer_refuses_what_the_header_cannot_say():
    writer = HistoryWriter(io.StringIO(), VLLM_HEADER)
    with pytest.raises(UsageError, match="observed.kinds"):
        writer.write(Alloc("X", 0, "P", (1,)))
    with pytest.raises(UsageError, match="'request'"):
        writer.write(Free("P", (1,)))
    assert writer.line == 1  # the header alone


def test_observation_api():
    obs = VLLM_OBSERVED
    assert obs.observes("free") and not obs.observes("alloc")
    assert not obs.records("free", "blocks") and obs.records("free", "request")
    assert obs.omits("free") == {"blocks", "gen"} and obs.omits("submit") == frozenset()
    assert Observation.from_dict(obs.to_dict()) == obs
    assert eval(repr(obs), {"Observation": Observation}) == obs
    assert Observation.parse_kinds("free, alloc").kinds == {"free", "alloc"}
    with pytest.raises(UsageError):
        Observation.parse_kinds("free,nope")
    with pytest.raises(ValueError):
        Observation("free")
    assert "transfer_read_done.request" in obs.terms() and "free.blocks" not in obs.terms()
    assert "share" in obs.terms() and "share" not in obs.terms({"share"})


# -- docs/invariants.md says what each invariant needs ----------------------------------


def test_invariants_doc_table_is_the_needs_table():
    with open(os.path.join(ROOT, "docs", "invariants.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## What each invariant needs observed", 1)[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([a-z-]+)` \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = [
                frozenset(t.strip().strip("`").replace("\\|", "|") for t in alt.split(", "))
                for alt in m.group(2).split(" **or** ")
            ]
    assert set(rows) == set(INVARIANTS)
    for inv, alternatives in INVARIANT_NEEDS.items():
        assert rows[inv] == list(alternatives), inv


def _examples():
    import glob

    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "examples", "*.jsonl"))):
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        head = json.loads(lines[0])
        for exp in head["expect"]:
            if exp["invariant"] in INVARIANT_NEEDS:
                yield pytest.param(path, exp, lines, id=f"{os.path.basename(path)}:{exp['line']}")


@pytest.mark.parametrize("path, exp, lines", list(_examples()))
def test_judged_means_found(path, exp, lines):
    """Each example's violation is still found when only the kinds its
    invariant needs (and the kind of the violating event) are observed."""
    inv = exp["invariant"]
    kinds = {k for t in INVARIANT_NEEDS[inv][0] for k in t.split("|") if "." not in k}
    header = json.loads(lines[0])
    if "share" not in header.get("features", []):
        kinds.discard("share")
    if exp["line"] <= len(lines):
        kinds.add(json.loads(lines[exp["line"] - 1])["ev"])
    result = audit(path, observed=",".join(sorted(kinds)))
    assert inv not in {i for i, _, _ in result.not_judged}
    assert (inv, exp["line"]) in {(v.invariant, v.line) for v in result.violations}
