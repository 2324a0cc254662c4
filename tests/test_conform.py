"""pdproto conform: trace validation of (partial) histories against a model."""

from __future__ import annotations

import json
import os
import random
import sys

import attrs
import pytest

from pdproto import ConformanceResult, conform
from pdproto._cli import main
from pdproto.protocol import Handoff, ModelConfig
from pdproto.spec import HistoryHeader, TransferStart, write_history
from pdproto.spec import EVENT_TYPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "docs", "examples")
_COMPLETIONS = ("transfer_read_done", "transfer_write_done", "transfer_failed", "transfer_abort")


def walk(config: ModelConfig, seed: int, steps: int = 300) -> tuple[HistoryHeader, list]:
    """One random run of the reference model (every enabled action, faults
    included, is as likely)."""
    rng = random.Random(seed)
    run = Handoff(config)
    return run.model.header, run.run(choose=rng.choice, limit=steps)


def config_for(seed: int, policy: str) -> ModelConfig:
    return ModelConfig.all_faults(
        1 + seed % 2, policy=policy, requests=1 + seed % 4, blocks=4, prefill_workers=1 + seed % 2,
        decode_workers=1 + (seed // 2) % 2, prompt_len=3 + seed % 5, max_new_tokens=1 + seed % 3,
    )


def erase(events: list, kinds: frozenset) -> list:
    """The history a source observing only ``kinds`` records: other kinds
    left out; a transfer completion whose start was not observed names its
    request instead (as a log that names requests, not transfers, does)."""
    out = []
    for e in events:
        if e.EV not in kinds:
            continue
        if e.EV in _COMPLETIONS and "transfer_start" not in kinds:
            e = attrs.evolve(e, request=e.transfer.split(":")[1])
        out.append(e)
    return out


# -- property: every history of the reference conforms --------------------------------


@pytest.mark.parametrize("policy", ["push", "pull"])
def test_every_reference_history_conforms(policy):
    total = 0
    for seed in range(60):
        header, events = walk(config_for(seed, policy), seed)
        total += len(events)
        result = conform([header, *events])
        assert result.ok, (seed, result.line, result.reason, result.expected)
        assert result.monitor_ok
    assert total > 800


def _check_any_kinds(policy: str, seeds: range) -> None:
    rng = random.Random(7 + seeds.start)
    kinds_all = [k for k in EVENT_TYPES if k != "share"]
    for seed in seeds:
        header, events = walk(config_for(seed, policy), seed)
        kinds = frozenset(k for k in kinds_all if rng.random() < 0.5)
        result = conform([header, *erase(events, kinds)], observed=kinds)
        assert result.ok, (seed, sorted(kinds), result.line, result.reason, result.expected)
        assert result.observed == tuple(k for k in EVENT_TYPES if k in kinds)


@pytest.mark.parametrize("policy", ["push", "pull"])
def test_reference_history_conforms_with_any_kinds_observed(policy):
    _check_any_kinds(policy, range(30))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["push", "pull"])
def test_reference_history_conforms_with_any_kinds_observed_many(policy):
    _check_any_kinds(policy, range(30, 330))


def test_chunked_and_layerwise_reference_histories_conform():
    for seed in range(20):
        for extra in ({"chunks": 2}, {"chunks": 3, "layerwise": True}):
            config = attrs.evolve(config_for(seed, "push" if seed % 2 else "pull"), prompt_len=5, **extra)
            header, events = walk(config, seed)
            result = conform([header, *events])
            assert result.ok, (seed, extra, result.line, result.reason, result.expected)


def test_interleaved_renamed_history_of_many_requests_conforms():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import conform_speed

    for policy in ("push", "pull"):
        header, events = conform_speed.history(1500, 50, seed=3, policy=policy)
        events = list(events)
        result = conform([header, *events])
        assert result.ok, (result.line, result.reason, result.expected)
        assert result.requests > 50
        # the same history with two requests' blocks swapped at one allocation does not conform
        first = next(i for i, e in enumerate(events) if e.EV == "reserve")
        taken = set(events[first].blocks)
        other = next(i for i, e in enumerate(events[first + 1:], first + 1)
                     if e.EV == "reserve" and e.worker == events[first].worker and e.request != events[first].request)
        # while the first request holds its blocks, a second reserve of one of them is a double allocation
        freed = next((i for i, e in enumerate(events) if e.EV == "free" and set(e.blocks) & taken), len(events))
        if other < freed:
            bad = list(events)
            bad[other] = attrs.evolve(bad[other], blocks=(min(taken),) + tuple(bad[other].blocks[1:]))
            result = conform([header, *bad])
            assert not result.ok
            assert result.line == other + 2  # the header is line 1
            assert "still held by request" in result.reason


# -- rejections ---------------------------------------------------------------------


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_a_monitor_clean_history_can_fail_conformance():
    # clean-pull.jsonl: P frees its source (line 9) before D commits (line 10); the monitor
    # accepts it, but the reference commits when the read lands and frees on the release after
    result = conform(os.path.join(EXAMPLES, "clean-pull.jsonl"))
    assert not result.ok and result.monitor_ok
    assert result.line == 9 and result.request == "r1"
    assert result.event == _lines(os.path.join(EXAMPLES, "clean-pull.jsonl"))[8]
    assert any(e.startswith("commit('r1', gen 0, ticket t-r1-0, worker D0)") for e in result.expected)
    assert result.states and "committed" in result.states[0]


def test_clean_push_example_conforms_with_renamed_ids():
    # tickets t-r1-0, transfers x-r1-0, gens: none is the model's own name
    result = conform(os.path.join(EXAMPLES, "clean-push.jsonl"))
    assert result.ok and result.monitor_ok and result.line is None


def test_rejects_early_source_free_at_its_line():
    result = conform(os.path.join(EXAMPLES, "early-source-free.jsonl"))
    assert not result.ok
    assert result.line == 8 == result.violations[0].line
    assert result.event["ev"] == "free"


def test_double_allocation_is_a_shared_pool_deviation():
    result = conform(os.path.join(EXAMPLES, "double-allocation.jsonl"))
    assert not result.ok and result.line == 5
    assert "still held by request 'r1' (line 3)" in result.reason


def test_end_of_a_complete_history_with_a_step_half_seen():
    result = conform(os.path.join(EXAMPLES, "leak.jsonl"))
    assert not result.ok and result.event is None
    assert result.reason.startswith("end of history")
    assert result.line == len(_lines(os.path.join(EXAMPLES, "leak.jsonl")))
    # not complete: the rest of the step may come later
    assert conform(os.path.join(EXAMPLES, "leak.jsonl"), complete=False).ok


MUTANTS = [
    # (mutant, the line conform rejects its shortest counterexample at)
    ("p-frees-source-on-timer", None),
    ("prefill-before-reserve", None),
    ("duplicate-completion-double-commit", None),
    ("decode-from-last-prompt-token", None),
    ("ticket-reused-by-retry", None),
    ("commit-on-failed-transfer", 8),  # the free of P's source after a failure with no fail before it
    ("restart-without-fencing", None),
]


@pytest.mark.parametrize("name,line", MUTANTS)
def test_rejects_mutant_counterexample(name, line):
    from pdproto.drivers import explore, load_model
    from pdproto.drivers import trace_header

    model, _ = load_model(name)
    found = explore(model, max_states=200_000)
    cx = found.failures[0]
    result = conform([trace_header(found.header, cx), *cx.events])
    assert not result.ok
    # at the monitor's line (the first event the mutant's bug shows in), or where given, earlier
    assert result.line == (line if line is not None else cx.line), (result.line, cx.line, result.reason)
    assert result.expected


# -- the API and the CLI ------------------------------------------------------------


def test_result_to_dict_is_json():
    result = conform(os.path.join(EXAMPLES, "clean-pull.jsonl"))
    obj = json.loads(json.dumps(result.to_dict()))
    assert obj["ok"] is False and obj["line"] == 9
    assert obj["monitor"] == {"ok": True, "violations": [], "not_judged": []}
    assert set(obj) >= {"ok", "line", "request", "event", "reason", "states", "expected", "renaming", "monitor",
                        "observed", "bounded"}
    assert obj["renaming"]["t:r0:0"] == "t-r1-0"
    assert isinstance(result, ConformanceResult)


def test_observed_unknown_kind_is_a_usage_error():
    from pdproto import UsageError

    with pytest.raises(UsageError, match="bogus"):
        conform(os.path.join(EXAMPLES, "clean-push.jsonl"), observed=["free", "bogus"])


def test_write_history_round_trip(tmp_path):
    header, events = walk(config_for(5, "pull"), 5)
    path = tmp_path / "h.jsonl"
    write_history(path, events, header)
    assert conform(path).ok
    assert conform(str(path), "reference", policy="pull").ok


def test_cli_exit_codes(tmp_path, capsys):
    assert main(["conform", os.path.join(EXAMPLES, "clean-push.jsonl")]) == 0
    assert "conforms" in capsys.readouterr().out
    assert main(["conform", os.path.join(EXAMPLES, "clean-pull.jsonl"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["line"] == 9 and out["ok"] is False
    assert main(["conform", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "Traceback" not in err
    assert main(["conform", os.path.join(EXAMPLES, "clean-push.jsonl"), "--observed", "free,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["conform", os.path.join(EXAMPLES, "clean-push.jsonl"), "--observed", "submit,commit,free"]) == 0
    capsys.readouterr()


def test_cli_report_names_line_states_and_monitor(capsys):
    assert main(["conform", os.path.join(EXAMPLES, "early-source-free.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "line 8" in out and "events the model could have produced there" in out
    assert "early-source-free" in out  # the monitor's verdict too


def test_transfer_start_is_needed_to_route_a_bare_completion():
    # a completion naming only an unknown transfer, with no request that can take it
    header = HistoryHeader(policy="push")
    events = [TransferStart("x1", "t1", "r1", 0, "P0", (0,), "D0", (0,))]
    result = conform([header, *events])
    assert not result.ok and result.line == 2


def test_an_erased_counterexample_the_reference_can_also_produce():
    # without the read and write completions and the commit, P's early free is explained by a
    # reference run in which the read landed unobserved first: conformance cannot object
    from pdproto.drivers import explore, load_model
    from pdproto.drivers import trace_header

    model, _ = load_model("p-frees-source-on-timer")
    found = explore(model, max_states=200_000)
    cx = found.failures[0]
    kinds = set(EVENT_TYPES) - {"transfer_read_done", "transfer_write_done", "commit"}
    history = [trace_header(found.header, cx), *(e for e in cx.events if e.EV in kinds)]
    assert conform(history, observed=kinds).ok
    assert not conform([trace_header(found.header, cx), *cx.events]).ok


def test_partial_history_declared_in_its_header(tmp_path):
    # a vLLM-like log: the request is named, not the transfer; blocks of a free unknown
    from pdproto.spec import Finish, Free, Observation, Submit, TransferReadDone

    obs = Observation(kinds={"submit", "finish", "free", "transfer_read_done"},
                      fields={"free": {"worker", "request"}, "transfer_read_done": {"request", "src"},
                              "submit": {"request"}})
    header = HistoryHeader(policy="pull", features={"observed"}, observed=obs)
    submit = Submit("X", None, None)
    read = TransferReadDone(None, request="X", src="P")
    free = Free("P", None, request="X")
    write_history(tmp_path / "ok.jsonl", [submit, read, free, Finish("X", 0)], header)
    result = conform(tmp_path / "ok.jsonl")
    assert result.ok and result.observed == ("submit", "transfer_read_done", "finish", "free")
    assert "double-allocation" in result.not_judged
    # the lease expired (free) before the read: the read is where no behaviour explains it
    write_history(tmp_path / "bad.jsonl", [submit, free, read], header)
    result = conform(tmp_path / "bad.jsonl")
    assert not result.ok and result.line == 4 and result.event["ev"] == "transfer_read_done"
    assert [v.invariant for v in result.violations] == ["early-source-free"]


def test_docs_examples_run(tmp_path, monkeypatch):
    import re

    with open(os.path.join(ROOT, "docs", "conformance.md"), encoding="utf-8") as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(ROOT)
    for block in blocks:
        exec(compile(block.replace("/tmp/", f"{tmp_path}/"), "docs/conformance.md", "exec"), {})
