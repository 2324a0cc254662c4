"""The recording connector (pdproto.adapters.vllm.recording), tested inside
the vLLM adapter's harness: real P and D vLLM schedulers whose connector is
the recording wrapper around NIXL's, loaded by vLLM through
``kv_connector_module_path``; fake workers below them.  What the two
recorders write, merged, must audit as the scenario really went: clean when
it was, and with the invariant the real behaviour breaks when it was not."""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest

pytest.importorskip("vllm")

from pdproto.drivers import audit  # noqa: E402
from pdproto.protocol import Action  # noqa: E402
from pdproto.spec import write_history  # noqa: E402

import pdproto.adapters.vllm.recording as recording  # noqa: E402
from pdproto.adapters.vllm import VllmAdapter, VllmHarness  # noqa: E402

MODULE = "pdproto.adapters.vllm.recording"
PROMPT = list(range(10, 20))  # 10 tokens: 3 blocks of 4


# -- fast: no engine --------------------------------------------------------------


def test_every_connector_method_goes_to_the_wrapped_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cls = recording.RecordingConnector
    names = [n for n, v in vars(KVConnectorBase_V1).items()
             if callable(v) and not (n.startswith("__") and n.endswith("__"))]
    assert "update_state_after_alloc" in names and "start_load_kv" in names
    inherited = [n for n in names if n not in vars(cls)]
    assert not inherited, f"left to the base class, not forwarded: {inherited}"
    assert not cls.__abstractmethods__
    # the names vLLM resolves through kv_connector_module_path
    assert recording.NixlConnector is cls
    assert issubclass(recording.NixlPullConnector, cls)


def test_the_push_family_is_refused_with_one_clear_error():
    with pytest.raises(recording.UsageError, match="pdproto_inner.*NixlPushConnector.*pull"):
        recording._inner_class({"pdproto_inner": "NixlPushConnector"}, "NixlConnector")
    with pytest.raises(recording.UsageError, match="pdproto_inner.*'Nope'.*NixlConnector"):
        recording._inner_class({"pdproto_inner": "Nope"}, "NixlConnector")


def _write(path, header, events):
    with open(path, "w") as fh:
        fh.write(json.dumps(header) + "\n")
        for e in events:
            fh.write(json.dumps(e) + "\n")


def _header(engine, role):
    return {"pdproto": "history", "version": "1.1", "features": ["boundary"], "policy": "pull",
            "complete": False, "boundary": "recompute",
            "vllm": {"engine_id": engine, "role": role, "num_blocks": 8}}


def test_merge_orders_by_time_and_declares_the_workers(tmp_path):
    p, d, out = tmp_path / "p.jsonl", tmp_path / "d.jsonl", tmp_path / "m.jsonl"
    _write(p, _header("P", "prefill"), [
        {"ev": "submit", "request": "r", "gen": 0, "prompt_len": 4, "t": 1},
        {"ev": "prefill_start", "request": "r", "gen": 0, "worker": "P", "blocks": [1], "t": 2},
        {"ev": "prefill_done", "request": "r", "gen": 0, "worker": "P", "first_token": 9,
         "processed_len": 4, "t": 3},
        {"ev": "free", "worker": "P", "blocks": [1], "request": "r", "gen": 0, "t": 6.5},
    ])
    _write(d, _header("D", "decode"), [
        {"ev": "reserve", "request": "r", "gen": 0, "ticket": "k", "worker": "D", "blocks": [2], "t": 4},
        {"ev": "transfer_start", "transfer": "x", "ticket": "k", "request": "r", "gen": 0, "src": "P",
         "src_blocks": [1], "dst": "D", "dst_blocks": [2], "t": 5},
        {"ev": "transfer_read_done", "transfer": "x", "t": 7},
        {"ev": "transfer_write_done", "transfer": "x", "t": 7},
    ])
    assert recording.merge_histories([p, d], out) == 9
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["workers"] == {"P": {"role": "prefill", "blocks": 8}, "D": {"role": "decode", "blocks": 8}}
    assert lines[0]["complete"] is False and lines[0]["boundary"] == "recompute"
    assert [e["t"] for e in lines[1:]] == [1, 2, 3, 4, 5, 6.5, 7, 7]
    # P freed its source (6.5) before D's read finished (7)
    assert [v.invariant for v in audit(out).violations] == ["early-source-free"]


def test_merge_refuses_files_of_two_deployments(tmp_path):
    p, d = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    _write(p, _header("P", "prefill"), [])
    _write(d, {**_header("D", "decode"), "policy": "push"}, [])
    with pytest.raises(recording.UsageError, match="policy.*'push'.*'pull'"):
        recording.merge_histories([p, d], tmp_path / "m.jsonl")


def test_merge_needs_each_events_time(tmp_path):
    p = tmp_path / "p.jsonl"
    _write(p, _header("P", "prefill"), [{"ev": "submit", "request": "r", "gen": 0, "prompt_len": 4}])
    with pytest.raises(recording.HistoryFormatError, match=r"p\.jsonl:2: field 't'"):
        recording.merge_histories([p], tmp_path / "m.jsonl")


# -- inside the harness: real schedulers ---------------------------------------------


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    where = tmp_path_factory.mktemp("recorded")
    mp = pytest.MonkeyPatch()
    mp.setenv(recording.ENV_HISTORY, str(where / "{role}.jsonl"))
    ticks = itertools.count(1)
    mp.setattr(recording, "clock", lambda: next(ticks) * 1_000_000)  # one shared, exact order
    h = VllmHarness("pull", connector=("NixlConnector", MODULE), lease=30)
    yield h
    h.close()
    mp.undo()


def step(h, side):
    so = h.schedule(side)
    h.start_load(side, so)
    out, _ = h.execute(side, so)
    return h.update(side, so, out)


def params_from(outputs):
    for eco in outputs.values():
        for o in eco.outputs:
            if o.kv_transfer_params:
                return o.kv_transfer_params
    raise AssertionError("P returned no kv_transfer_params")


def handoff(h, max_tokens=3):
    """P prefills r1; D takes it as d1 and starts reading (WAITING_FOR_REMOTE_KVS)."""
    h.reset()
    h.add_request("P", "r1", PROMPT, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    params = params_from(step(h, "P"))
    h.pair("r1", "d1")
    h.add_request("D", "d1", PROMPT, max_tokens, params)
    step(h, "D")
    assert h.sched["D"].requests["d1"].status.name == "WAITING_FOR_REMOTE_KVS"
    assert h.running_transfers()


def drain(h, steps=6):
    for _ in range(steps):
        step(h, "D")
        step(h, "P")


def recorded(h, tmp_path, complete=True):
    """The merged history of both recorders, and its audit."""
    paths = [h.sched[s].connector.history_path for s in ("P", "D")]
    assert all(paths), "the recording connector did not record"
    out = tmp_path / "merged.jsonl"
    recording.merge_histories(paths, out, complete=complete)
    events = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    return events, sorted({v.invariant for v in audit(out).violations})


def kinds(events):
    return [e["ev"] for e in events]


@pytest.mark.slow
def test_vllm_resolves_the_recording_class_by_module_path(harness):
    for side in ("P", "D"):
        connector = harness.sched[side].connector
        assert type(connector) is recording.RecordingConnector
        assert type(connector.inner).__name__ == "NixlPullConnector"
        assert connector.history_path and os.path.exists(connector.history_path)
        with open(connector.history_path) as fh:
            header = json.loads(fh.readline())  # the header is the first line, written at start
        assert header["vllm"]["role"] == ("prefill" if side == "P" else "decode")
        assert header["complete"] is False and header["boundary"] == "recompute"


@pytest.mark.slow
def test_clean_handoff_records_a_clean_history(harness, tmp_path):
    h = harness
    handoff(h)
    h.complete("d1")
    drain(h)
    assert not h.sched["D"].requests and not h.sched["P"].requests
    events, violations = recorded(h, tmp_path)
    assert violations == []
    assert kinds(events) == [
        "submit", "prefill_start", "prefill_done", "reserve", "transfer_start",
        "transfer_read_done", "transfer_write_done",  # D: finished_recving
        "transfer_read_done", "free",  # P: finished_sending before the lease's end (D's notification)
        "commit", "decode", "decode", "decode", "finish", "free",
    ]
    assert events[7].get("if_started") is True and events[7]["transfer"] == events[4]["transfer"]
    start = events[4]
    assert start["src"] == h.P_ENGINE and start["dst"] == h.D_ENGINE
    assert start["src_blocks"] == events[1]["blocks"] and start["dst_blocks"] == events[3]["blocks"]
    first = events[10]
    assert first["position"] == len(PROMPT) - 1 and first["input_token"] == PROMPT[-1]  # recompute


@pytest.mark.slow
def test_cancel_at_d_while_waiting_holds_blocks_until_the_late_notification(harness, tmp_path):
    h = harness
    handoff(h)
    from vllm.v1.request import RequestStatus

    h.sched["D"].finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    drain(h, 2)
    assert h.block_ids("D"), "vLLM keeps D's blocks while the read may still land"
    events, violations = recorded(h, tmp_path)
    assert "cancel" in kinds(events) and kinds(events).count("free") == 0
    assert violations == ["leak"]  # if the notification never comes

    h.complete("d1")  # the late notification
    drain(h)
    events, violations = recorded(h, tmp_path)
    assert violations == []
    d_end = next(i for i, e in enumerate(events) if e["ev"] == "transfer_write_done")
    d_free = next(i for i, e in enumerate(events) if e["ev"] == "free" and e["worker"] == h.D_ENGINE)
    assert d_end < d_free, "D's blocks go back only after the late notification"
    assert kinds(events).count("free") == 2


@pytest.mark.slow
def test_p_lease_expiring_while_d_reads_is_an_early_source_free(harness, tmp_path):
    h = harness
    handoff(h)
    h.clock.advance(h.lease + 1)
    step(h, "P")  # P's worker reports the expired lease as finished_sending: P frees
    step(h, "P")
    assert not h.block_ids("P")
    h.complete("d1")  # D's read, still running, completes after the free
    drain(h)
    events, violations = recorded(h, tmp_path)
    assert violations == ["early-source-free"]
    assert kinds(events).index("free") < kinds(events).index("transfer_read_done")


@pytest.mark.slow
def test_failed_read_records_transfer_failed_and_no_commit(harness, tmp_path):
    h = harness
    handoff(h)
    h.fail("d1")
    drain(h, 2)
    h.clock.advance(h.lease + 1)  # no notification reaches P: its lease frees the blocks
    drain(h)
    events, violations = recorded(h, tmp_path)
    assert "transfer_failed" in kinds(events) and "commit" not in kinds(events)
    assert kinds(events).count("free") == 2
    assert violations == []


# -- the same actions through the adapter: both audit the same ---------------------------


@pytest.fixture(scope="module")
def adapter(harness):
    return VllmAdapter("pull", harness=harness)  # closed with the harness


def act(kind, *args, actor=None):
    actors = {"submit": "client", "abort": "client", "retry": "client", "complete": "net",
              "fail_transfer": "net", "expire": "clock"}
    fault = kind in ("abort", "fail_transfer", "retry", "expire")
    return Action(kind, actor or actors[kind], args, fault=fault)


STEP_P, STEP_D = Action("step", "P0", ("P0",)), Action("step", "D0", ("D0",))


def enabled_as(a, action):
    """``action`` as the adapter offers it now (whether letting a lease
    pass is a fault depends on the state)."""
    if action.kind == "expire":
        return next((x for x in a.actions() if x.kind == "expire"), action)
    return action


def both_audits(a, tmp_path, actions, *, drain=True, rng=None, steps=0, exclude=("restart",)):
    """Apply ``actions`` (then, with ``rng``, ``steps`` random ones; then, with
    ``drain``, the non-fault ones until none is left) to the adapter, whose
    engines' connector is the recorder.  Returns the invariant ids of the
    adapter's own history and of the recorders' merged one, and the trace."""
    a.reset()
    files = [a.h.sched[s].connector.history_path for s in ("P", "D")]
    events, trace = [], []

    def apply(action):
        action = enabled_as(a, action)
        trace.append(str(action))
        events.extend(a.apply(action))
        if action.kind in ("complete", "fail_transfer") and STEP_D in a.actions():
            # D's worker reports a finished read in the step that saw it: D's
            # scheduler learns it before P's next step (see the race test below)
            trace.append(str(STEP_D))
            events.extend(a.apply(STEP_D))

    for action in actions:
        apply(action)
    for _ in range(steps):
        enabled = [x for x in a.actions() if x.kind not in exclude]
        if not enabled:
            break
        apply(rng.choice(enabled))
    for _ in range(200 if drain else 0):
        enabled = [x for x in a.actions() if not x.fault]
        if not enabled:
            break
        apply(enabled[0])
    for side in ("P", "D"):
        a.h.sched[side].connector.shutdown()  # the end of each engine's history
    mine = tmp_path / "adapter.jsonl"
    write_history(mine, events, a.header)
    merged = tmp_path / "recorded.jsonl"
    recording.merge_histories(files, merged, complete=True)
    ids = [sorted({v.invariant for v in audit(p).violations}) for p in (mine, merged)]
    return ids[0], ids[1], trace


@pytest.mark.slow
@pytest.mark.parametrize("name, actions, drain, expected", [
    ("clean", [act("submit", "r1"), STEP_P, STEP_D, act("complete", "r1", 0)], True, []),
    ("cancel at D while waiting, no late notification",
     [act("submit", "r1"), STEP_P, STEP_D, act("abort", "r1"), STEP_P], False, ["leak"]),
    ("cancel at D while waiting, late notification",
     [act("submit", "r1"), STEP_P, STEP_D, act("abort", "r1"), act("complete", "r1", 0)], True, []),
    ("P's lease expires while D reads",
     [act("submit", "r1"), STEP_P, STEP_D, STEP_P, act("expire"), STEP_P, act("complete", "r1", 0)], True,
     ["early-source-free"]),
    ("failed read", [act("submit", "r1"), STEP_P, STEP_D, act("fail_transfer", "r1", 0)], True, []),
])
def test_recorder_audits_as_the_adapter_observed(adapter, tmp_path, name, actions, drain, expected):
    observed, recorded_ids, trace = both_audits(adapter, tmp_path, actions, drain=drain)
    assert observed == expected, trace
    assert recorded_ids == observed, trace


@pytest.mark.slow
def test_recorder_audits_as_the_adapter_observed_on_random_walks(adapter, tmp_path):
    rng = random.Random(11)
    verdicts = []
    for example in range(40):
        observed, recorded_ids, trace = both_audits(adapter, tmp_path, [], rng=rng, steps=25)
        assert recorded_ids == observed, f"example {example}: {' '.join(trace)}"
        verdicts.append(tuple(observed))
    assert () in verdicts and any(verdicts), verdicts  # clean runs and violating ones


@pytest.mark.slow
def test_a_read_ending_within_a_step_of_the_lease_is_the_recorders_known_false_alarm(adapter, tmp_path):
    # D's read completes, then P's lease deadline passes and P steps before D
    # does: P's scheduler sees finished_sending after the deadline (it cannot
    # tell D's notification from the lease), D's scheduler has not yet heard of
    # the read's end.  The adapter saw the data plane finish first.
    a = adapter
    a.reset()
    files = [a.h.sched[s].connector.history_path for s in ("P", "D")]
    events = []
    for action in [act("submit", "r1"), STEP_P, STEP_D, STEP_P, act("complete", "r1", 0), act("expire"),
                   STEP_P]:
        events.extend(a.apply(enabled_as(a, action)))
    for _ in range(50):
        enabled = [x for x in a.actions() if not x.fault]
        if not enabled:
            break
        events.extend(a.apply(enabled[0]))
    for side in ("P", "D"):
        a.h.sched[side].connector.shutdown()
    write_history(tmp_path / "a.jsonl", events, a.header)
    recording.merge_histories(files, tmp_path / "r.jsonl", complete=True)
    assert [v.invariant for v in audit(tmp_path / "a.jsonl").violations] == []
    assert [v.invariant for v in audit(tmp_path / "r.jsonl").violations] == ["early-source-free"]


@pytest.mark.slow
def test_decodes_first_records_only_the_first_token_boundary(harness, tmp_path, monkeypatch):
    monkeypatch.setenv(recording.ENV_DECODES, "first")
    h = harness
    handoff(h)  # the reset builds connectors that read PDPROTO_DECODES
    h.complete("d1")
    drain(h)
    events, violations = recorded(h, tmp_path)
    assert violations == []
    decodes = [e for e in events if e["ev"] == "decode"]
    assert [d["position"] for d in decodes] == [len(PROMPT) - 1]
    monkeypatch.setenv(recording.ENV_DECODES, "every")
    with pytest.raises(recording.UsageError, match="pdproto_decodes: 'every'.*all or first or none"):
        h.reset()
    monkeypatch.delenv(recording.ENV_DECODES)
    h.reset()
