"""The vLLM adapter: vLLM's real scheduler and NIXL connector (pull and push)
driven by pdproto actions, judged by the monitor (docs/adapters/vllm.md).

Skips only when vLLM is absent.  The engine is built once per family for
the module (about a minute the first time in a process), then reset per
test.
"""

from __future__ import annotations

import json
import os
import random

import pytest

pytest.importorskip("vllm")

from conftest import EXAMPLES  # noqa: E402

from pdproto import Monitor  # noqa: E402
from pdproto.adapters.vllm import KNOWN, VllmAdapter  # noqa: E402
from pdproto.adapters.vllm import SCENARIOS, expected, run_scenario  # noqa: E402
from pdproto.adapters.vllm._support import _parse, require_vllm  # noqa: E402
from pdproto.protocol import Action, ActionNotEnabled  # noqa: E402


@pytest.fixture(scope="module")
def pull():
    adapter = VllmAdapter("pull")
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def push():
    adapter = VllmAdapter("push")
    yield adapter
    adapter.close()


def family(request, name):
    return request.getfixturevalue(name)


def judge(adapter, events):
    monitor = Monitor.from_header(adapter.header, complete=True)
    for line, event in enumerate(events, start=2):
        monitor.feed(event, line)
    monitor.finish()
    return [v.invariant for v in monitor.violations]


def act(adapter, kind, actor, *args):
    for action in adapter.actions():
        if (action.kind, action.actor, action.args) == (kind, actor, args):
            return adapter.apply(action)
    raise AssertionError(f"{kind}{args} by {actor} not offered: {[str(a) for a in adapter.actions()]}")


def reading(adapter):
    """Reset, then r1 prefilled at P (lease shipped) and D's READ started."""
    adapter.reset()
    act(adapter, "submit", "client", "r1")
    act(adapter, "step", "P0", "P0")
    act(adapter, "step", "P0", "P0")
    act(adapter, "step", "D0", "D0")


def drain(adapter):
    events = []
    for _ in range(500):
        progress = [a for a in adapter.actions() if not a.fault]
        if not progress:
            return events
        events.extend(adapter.apply(progress[0]))
    raise AssertionError("no quiescence")


# -- clean handoffs, one per family (fast tier) --------------------------------------


@pytest.mark.parametrize("name", ["pull", "push"])
def test_clean_handoff_audits_clean(request, name):
    adapter = family(request, name)
    assert adapter.name == f"vllm:{name}"
    assert adapter.header.policy == name and adapter.header.boundary == "recompute"
    events = run_scenario(adapter, f"vllm-clean-{name}")
    assert judge(adapter, events) == []
    kinds = [e.EV for e in events]
    order = (["submit", "prefill_start", "prefill_done", "reserve"] if name == "pull"
             else ["submit", "reserve", "prefill_start", "prefill_done"])
    assert [k for k in kinds if k in order] == order
    assert kinds.count("decode") == 3 and kinds[-2:] == ["finish", "free"]
    # vLLM's boundary: D recomputes the last prompt token at prompt_len - 1
    first = next(e for e in events if e.EV == "decode")
    submit = events[0]
    assert first.position == submit.prompt_len - 1
    assert first.input_token == 10 + submit.prompt_len - 1  # r1's prompt is 10, 11, ...
    # every block went back to the real pools
    h = adapter.h
    assert h.block_ids("P") == {} and h.block_ids("D") == {}
    assert h.free_blocks("P") == h.free_blocks("D") == h.num_blocks - 1  # block 0 is vLLM's null block


def test_reset_brings_back_the_initial_state(pull):
    pull.reset()
    initial = pull.signature()
    act(pull, "submit", "client", "r1")
    act(pull, "step", "P0", "P0")
    assert pull.signature() != initial and pull.h.block_ids("P")
    pull.reset()
    assert pull.signature() == initial and pull.h.block_ids("P") == {}


def test_an_action_not_offered_raises_and_changes_nothing(pull):
    pull.reset()
    act(pull, "submit", "client", "r1")
    before = pull.signature()
    with pytest.raises(ActionNotEnabled):
        pull.apply(Action("complete", "net", ("r1", 0)))  # no transfer yet
    with pytest.raises(ActionNotEnabled):
        pull.apply(Action("step", "D0", ("D0",)))  # D has nothing to do
    assert pull.signature() == before


def test_faults_are_marked(pull):
    reading(pull)
    offered = {a.kind: a.fault for a in pull.actions()}
    assert offered["complete"] is False and offered["submit"] is False and "step" not in offered
    for kind in ("abort", "fail_transfer", "restart", "expire"):
        assert offered[kind] is True, kind  # expire: D's READ is in flight


# -- the known behaviours, reproduced -----------------------------------------------


def test_cancel_at_d_while_waiting_keeps_blocks_until_the_late_notification(pull):
    reading(pull)
    held = pull.h.block_ids("D")["r1.0-d"]
    events = act(pull, "abort", "client", "r1")
    assert [e.EV for e in events] == ["cancel"]  # no free: the READ may still write them
    assert pull.h.block_ids("D")["r1.0-d"] == held
    assert pull.h.sched["D"].requests["r1.0-d"].status.name == "FINISHED_ABORTED"
    act(pull, "complete", "net", "r1", 0)
    assert pull.h.block_ids("D")["r1.0-d"] == held
    events = act(pull, "step", "D0", "D0")  # the late finished_recving frees them
    assert [(e.EV, e.worker, tuple(e.blocks)) for e in events] == [("free", "D0", tuple(held))]
    assert "r1.0-d" not in pull.h.block_ids("D")


def test_cancel_at_d_while_waiting_leaks_when_the_notification_never_comes(pull):
    events = run_scenario(pull, "vllm-cancel-waiting-leak")
    assert judge(pull, events) == ["leak"]
    assert pull.h.block_ids("D") == {"r1.0-d": [1, 2]}  # really held by vLLM at quiescence


def test_lease_expiry_while_d_reads_is_early_source_free(pull):
    events = run_scenario(pull, "vllm-lease-early-source-free")
    assert judge(pull, events) == ["early-source-free"]
    kinds = [e.EV for e in events]
    assert kinds.index("free") < kinds.index("transfer_read_done")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_examples_are_what_the_engine_does(request, name):
    """Each docs/examples/vllm-*.jsonl is what the real engine produces now,
    and its header's expect is the monitor's verdict."""
    scenario = SCENARIOS[name]
    adapter = family(request, scenario.family)
    events = run_scenario(adapter, name)
    path = os.path.join(EXAMPLES, f"{name}.jsonl")
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    header = json.loads(lines[0])
    assert [json.loads(line) for line in lines[1:]] == [e.to_dict() for e in events], (
        f"{path} is stale: run python -m pdproto.adapters.vllm._scenarios docs/examples")
    assert header["expect"] == expected(adapter, events)
    assert header["policy"] == scenario.family and header["boundary"] == "recompute"
    assert "replay_expect" in header
    for v in header["expect"]:
        assert v["invariant"] in KNOWN[scenario.family], v  # every violation is triaged


# -- driving it as the fuzzer does ------------------------------------------------


@pytest.mark.parametrize("name", ["pull", "push"])
def test_random_runs_report_only_known_behaviours(request, name):
    adapter = family(request, name)
    for seed in range(12):
        rng = random.Random(seed)
        adapter.reset()
        events = []
        for _ in range(10):
            offered = adapter.actions()
            if not offered:
                break
            events.extend(adapter.apply(rng.choice(offered)))
        events.extend(drain(adapter))
        for invariant in judge(adapter, events):
            assert invariant in adapter.known, (seed, invariant)


def test_decisions_reenact_a_history(pull):
    """decision(event) names the actions that make the engine produce each
    decided event (silent steps first); applying them in order reproduces
    the history."""
    for name in ("vllm-clean-pull", "vllm-cancel-waiting-late-recving", "vllm-lease-early-source-free",
                 "vllm-failed-read-fails-request"):
        want = list(run_scenario(pull, name))
        pull.requests = tuple(f"r{i + 1}" for i in range(SCENARIOS[name].requests))  # as the scenario ran
        pull.reset()
        got: list = []
        for event in want:
            if event in got:
                continue
            decided = pull.decision(event)
            if decided is None:
                continue
            for action in (decided,) if isinstance(decided, Action) else decided:
                got.extend(pull.apply(action))
            assert event in got, (name, event)
        got.extend(drain(pull))
        pull.requests = ("r1", "r2")
        assert got == want, name


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_pdproto_replay_reenacts_every_example(request, name):
    """``pdproto replay HISTORY --adapter vllm``: the engine does exactly what
    each example records (no event missing, extra or refused), and the
    monitor finds the example's violations (a complete example's leak and
    stuck too: the re-enactment runs to the same end)."""
    from pdproto.drivers import replay_on_adapter

    scenario = SCENARIOS[name]
    adapter = family(request, scenario.family)
    path = os.path.join(EXAMPLES, f"{name}.jsonl")
    with open(path, encoding="utf-8") as fh:
        expect = json.loads(fh.readline())["expect"]
    adapter.requests = tuple(f"r{i + 1}" for i in range(scenario.requests))
    try:
        result = replay_on_adapter(path, adapter)
    finally:
        adapter.requests = ("r1", "r2")
    assert result.divergences == () and result.matched == result.events
    assert [(v.invariant, v.line) for v in result.violations] == [(v["invariant"], v["line"]) for v in expect]


# -- the supported version range -----------------------------------------------------


def test_supported_range(monkeypatch):
    from pdproto import MissingExtraError, UsageError
    from pdproto.adapters.vllm import _support

    assert _parse("0.32.0") == (0, 32, 0) and _parse("0.32.1+cpu") == (0, 32, 1) and _parse("1.0") == (1, 0, 0)
    require_vllm()  # the installed one is supported
    monkeypatch.setattr(_support, "vllm_version", lambda: "0.31.2")
    with pytest.raises(UsageError, match="0.31.2"):
        _support.require_vllm()
    monkeypatch.setattr(_support, "vllm_version", lambda: None)
    with pytest.raises(MissingExtraError, match=r"pdproto\[vllm\]"):
        _support.require_vllm()


def test_a_media_package_built_for_another_torch_is_one_clear_error(monkeypatch):
    import importlib

    from pdproto import UsageError
    from pdproto.adapters.vllm import _support

    def broken(name):
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(UsageError, match=r"torchvision failed.*pip uninstall -y torchvision torchaudio torchcodec"):
        _support.import_vllm()

    def other(name):
        raise RuntimeError("something else")

    monkeypatch.setattr(importlib, "import_module", other)
    with pytest.raises(RuntimeError, match="something else"):
        _support.import_vllm()
