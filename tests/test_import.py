"""pdproto import: engine logs -> partial histories (formats from the engines' source,
excerpts from public reports; see tests/data/logs/README.md)."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from pdproto import UsageError
from pdproto.importers import ENGINES, LOG_LINE_KEY, import_log
from pdproto.importers import LogImporter, run_import
from pdproto.importers import VllmImporter
from pdproto.spec import open_history

LOGS = pathlib.Path(__file__).parent / "data" / "logs"


def imported(engine: str, name: str | None = None, text: str | None = None, tmp_path=None):
    """(result, header, [event dicts]) of importing a log file or text."""
    if text is not None:
        path = tmp_path / "x.log"
        path.write_text(text)
    else:
        path = LOGS / name
    out = io.StringIO()
    result = import_log(engine, str(path), out)
    lines = out.getvalue().splitlines()
    return result, json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def strip(events, *keys):
    return [{k: v for k, v in e.items() if k not in keys} for e in events]


# -- vLLM -------------------------------------------------------------------


def test_vllm_25562_lease_expiries_are_frees_of_the_source_on_p():
    result, header, events = imported("vllm", "vllm-25562-lease-expired.log")
    assert result.recognised["lease_expired"] == 3 and result.unrecognised == 0
    assert [e["ev"] for e in events] == ["free"] * 3
    assert events[0] == {"ev": "free", "worker": "P0", "request": "cmpl-3da205a6-1c3c-41b5-aeaa-b8421e81fd5c-0",
                         "reason": "lease expired", "retrieved_by": 0, LOG_LINE_KEY: 1}
    assert [e[LOG_LINE_KEY] for e in events] == [1, 2, 3]
    # a WARNING-level log of a prefill instance: P's kinds at vLLM's default level (transfer_failed is
    # logged by D, whose lines are not in it)
    assert header["features"] == ["observed"] and header["complete"] is False and header["policy"] == "pull"
    assert sorted(header["observed"]["kinds"]) == ["free", "transfer_read_done"]
    assert header["observed"]["fields"]["free"] == ["worker", "request"]


def test_vllm_late_read_from_aibrix_1772_is_a_read_done_of_the_request():
    result, _, events = imported("vllm", "vllm-aibrix-1772-late-read.log")
    assert strip(events, "reason") == [{"ev": "transfer_read_done", "src": "P0",
                                        "request": "chatcmpl-129a69c8-cd1a-40e0-aa3e-94662fd8cc2b", LOG_LINE_KEY: 1}]


def test_vllm_lease_expiry_then_read_sequence():
    result, header, events = imported("vllm", "vllm-lease-expiry-then-read.log")
    request = "cmpl-7f3a9c1e-0-4b2d8e11"
    assert strip(events, "reason", "retrieved_by") == [
        {"ev": "free", "worker": "P0", "request": request, LOG_LINE_KEY: 5},
        {"ev": "transfer_read_done", "request": request, "src": "P0", LOG_LINE_KEY: 7},
    ]
    # "Finished sending" after the expiry is the same free: known, no second event
    assert result.recognised["finished_sending"] == 1
    # a prefill instance's DEBUG log: P's kinds; D's (transfer_write_done, finish) are not in it, so they
    # are not declared (conform treats an observed kind as complete)
    assert result.debug and sorted(header["observed"]["kinds"]) == ["cancel", "fail", "free", "transfer_read_done"]


def test_vllm_clean_handoff_p_and_d_in_one_log():
    result, header, events = imported("vllm", "vllm-clean-handoff.log")
    # D's request (...-77e3a0b5) is P's (...-9d01f6c2): remote_request_id in D's kv_transfer_params (line 9)
    # names it, and D's events, the one written before that line too, are P's request's
    p = "cmpl-51c0e2aa-0-9d01f6c2"
    assert events == [
        {"ev": "transfer_write_done", "request": p, "dst": "D0", LOG_LINE_KEY: 6},
        {"ev": "transfer_read_done", "request": p, "src": "P0", LOG_LINE_KEY: 7},
        {"ev": "free", "worker": "P0", "request": p, LOG_LINE_KEY: 7},
        {"ev": "finish", "request": p, "reason": "stop", LOG_LINE_KEY: 9},
        {"ev": "free", "worker": "D0", "request": p, LOG_LINE_KEY: 9},
    ]
    assert header["observed"]["kinds"] == ["transfer_read_done", "transfer_write_done", "transfer_failed", "finish",
                                           "cancel", "fail", "free"]
    assert result.unrecognised == 0
    assert result.recognised["get_num_new_matched_tokens"] == 1 and result.recognised["request_finished"] == 2


def _vllm(message: str, level: str = "DEBUG") -> str:
    return f"(EngineCore_DP0 pid=7) {level} 12-01 10:00:00 [x.py:1] {message}\n"


FINISHED = "NIXLConnector request_finished({r}), request_status=RequestStatus.{s}, kv_transfer_params={p}"
P_PARAMS = "{'do_remote_decode': True, 'do_remote_prefill': False}"
D_PARAMS = "{'do_remote_prefill': False, 'do_remote_decode': False, 'remote_request_id': 'p1'}"


def test_vllm_abort_on_p_frees_at_once(tmp_path):
    _, _, events = imported("vllm", text=_vllm(FINISHED.format(r="p1", s="FINISHED_ABORTED", p=P_PARAMS)),
                            tmp_path=tmp_path)
    assert strip(events, LOG_LINE_KEY) == [{"ev": "cancel", "request": "p1", "reason": "abort"},
                                           {"ev": "free", "worker": "P0", "request": "p1"}]


def test_vllm_abort_on_d_while_loading_frees_at_the_late_recving(tmp_path):
    # vllm#32255: D holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until its READ ends
    text = _vllm(FINISHED.format(r="d1", s="FINISHED_ABORTED", p=D_PARAMS)) + _vllm(
        "Finished recving KV transfer for request d1")
    _, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert strip(events, LOG_LINE_KEY) == [  # d1 is p1 on P (remote_request_id)
        {"ev": "cancel", "request": "p1", "reason": "abort"},
        {"ev": "transfer_write_done", "request": "p1", "dst": "D0"},
        {"ev": "free", "worker": "D0", "request": "p1"},
    ]
    assert [e[LOG_LINE_KEY] for e in events] == [1, 2, 2]


def test_vllm_abort_on_d_while_decoding_frees_at_once(tmp_path):
    text = _vllm("Finished recving KV transfer for request d1") + _vllm(
        FINISHED.format(r="d1", s="FINISHED_ABORTED", p=D_PARAMS))
    _, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert [e["ev"] for e in events] == ["transfer_write_done", "cancel", "free"]


def test_vllm_request_without_kv_transfer_params_is_no_handoff(tmp_path):
    result, _, events = imported("vllm", text=_vllm(FINISHED.format(r="x", s="FINISHED_STOPPED", p="None")),
                                 tmp_path=tmp_path)
    assert events == [] and result.recognised["request_finished"] == 1


def test_vllm_transfer_failure_context(tmp_path):
    context = ("{'failure_type': 'transfer_failed', 'request_id': 'd7', 'engine_id': 'e1', "
               "'remote_engine_id': 'e0', 'remote_request_id': 'p7', 'num_local_blocks': 3}")
    text = (_vllm(f"NIXL transfer failure: transfer_failed | Context: {context}", "ERROR")
            + _vllm(f"NIXL transfer failure: transfer_failed | Context: {context}", "ERROR")  # a 2nd TP rank
            + _vllm("NIXL transfer failure: notification_failed | Context: {'request_id': 'd8'}", "ERROR"))
    result, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    # d7 is p7 on P: the context's remote_request_id
    assert strip(events, LOG_LINE_KEY) == [{"ev": "transfer_failed", "request": "p7", "dst": "D0",
                                           "reason": "transfer_failed"}]
    assert result.recognised["transfer_failure"] == 3


def test_vllm_both_lease_wordings(tmp_path):
    new = "Releasing expired KV blocks for request r9 which were retrieved by 1 remote worker(s) before lease expired."
    old = "Releasing expired KV blocks for request r8 which were retrieved by 0 decode worker(s) within 120 seconds."
    _, _, events = imported("vllm", text=_vllm(new, "WARNING") + _vllm(old, "WARNING"), tmp_path=tmp_path)
    assert [(e["request"], e["retrieved_by"]) for e in events] == [("r9", 1), ("r8", 0)]


def test_vllm_per_rank_duplicates_give_one_event(tmp_path):
    line = "Potentially invalid KV blocks for unrecognized request r1 were retrieved by a decode worker. They may have expired."
    _, _, events = imported("vllm", text=_vllm(line, "ERROR") * 8, tmp_path=tmp_path)
    assert len(events) == 1


def test_vllm_colours_and_old_prefix(tmp_path):
    text = ("\x1b[33mWARNING\x1b[0m 09-24 16:35:21 [nixl_connector.py:1048] Releasing expired KV blocks for request "
            "r1 which were retrieved by 0 decode worker(s) within 120 seconds.\n")
    _, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert events[0]["request"] == "r1"


def test_unrecognised_handoff_lines_are_warned_with_line_numbers():
    result, _, events = imported("vllm", "vllm-unknown-handoff-line.log")
    assert result.unrecognised == 1
    assert [e.line for e in result.examples] == [2]
    assert "re-queued" in result.examples[0].text
    assert [e[LOG_LINE_KEY] for e in events] == [3]  # the known line still imports


def test_examples_are_capped_but_all_counted(tmp_path):
    text = _vllm("KV transfer for request r1 looks odd", "WARNING") * 9
    result, _, _ = imported("vllm", text=text, tmp_path=tmp_path)
    assert result.unrecognised == 9 and [e.line for e in result.examples] == [1, 2, 3, 4, 5]


def test_the_tracked_ids_are_bounded():
    from pdproto.importers import Bounded

    seen = Bounded(limit=3)
    for i in range(5):
        assert seen.add(i)
    assert 0 not in seen and 1 not in seen and 4 in seen
    assert not seen.add(4) and seen.discard(4) and not seen.discard(4)


# -- SGLang -----------------------------------------------------------------


def test_sglang_12688_decode_transfer_failed_aborted_once_per_request():
    result, header, events = imported("sglang", "sglang-12688-decode-transfer-failed.log")
    rid = "78fde411d57a4d7791b63963eac74968"
    # "Aborted by AbortReq": the client aborted (SGLang reports req.to_abort on the failure path), no
    # transfer failed: only the cancel
    assert events == [{"ev": "cancel", "request": rid, "reason": "abort", LOG_LINE_KEY: 2}]
    assert result.recognised["decode_transfer_failed"] == 2  # ranks 0 and 2
    assert header["policy"] == "push" and sorted(header["observed"]["kinds"]) == ["cancel", "fail", "transfer_failed"]


def test_sglang_11648_timeout_is_a_fail():
    result, _, events = imported("sglang", "sglang-11648-decode-timeout.log")
    assert [(e["ev"], e.get("reason")) for e in events] == [("transfer_failed", None), ("fail", "timeout")]
    assert result.recognised["transfer_timeout_notice"] == 1 and result.unrecognised == 0


def test_sglang_9266_bootstrap_failed_ends_the_request_without_a_transfer():
    _, _, events = imported("sglang", "sglang-9266-prefill-bootstrap-failed.log")
    assert strip(events, LOG_LINE_KEY) == [{"ev": "cancel", "request": "60d582b2010846a8b337cf88963116e7",
                                           "reason": "abort"}]


def test_sglang_prefill_transfer_failed_and_mooncake_851():
    _, _, events = imported("sglang", "sglang-prefill-transfer-failed.log")
    assert [(e["ev"], e.get("reason")) for e in events] == [("transfer_failed", None), ("fail", "transfer failed")]
    _, _, events = imported("sglang", "sglang-mooncake851-decode-transfer-failed.log")
    assert [e["ev"] for e in events] == ["transfer_failed", "fail"]


def test_sglang_newer_handshake_spelling(tmp_path):
    text = ("[2026-01-01 00:00:00 TP0] Decode handshake failed for request rank=0 rid=abc bootstrap_room=42: "
            "bootstrap timed out\n")
    _, _, events = imported("sglang", text=text, tmp_path=tmp_path)
    assert strip(events, LOG_LINE_KEY) == [{"ev": "fail", "request": "abc", "reason": "timeout"}]


# -- Dynamo -----------------------------------------------------------------


def test_dynamo_5095_router_warnings_are_known_and_write_no_event():
    result, header, events = imported("dynamo", "dynamo-5095-router.log")
    assert events == [] and result.unrecognised == 0
    assert result.recognised == {"mark_prefill_failed": 1, "free_failed": 2, "cancelled": 0}
    assert header["observed"]["kinds"] == []


def test_dynamo_structured_and_json_forms_and_debug_cancel(tmp_path):
    text = (
        "2026-01-01T00:00:00.000001Z  WARN dynamo_llm::kv_router: Failed to free request request_id=r1 error=gone\n"
        '{"time":"2026-01-01T00:00:00Z","level":"WARN","target":"dynamo_llm::kv_router",'
        '"message":"Failed to mark prefill completed","request_id":"r2"}\n'
        "2026-01-01T00:00:01.000001Z DEBUG dynamo_llm::kv_router: Request r3 cancelled, ending stream\n"
    )
    result, header, events = imported("dynamo", text=text, tmp_path=tmp_path)
    assert result.recognised == {"mark_prefill_failed": 1, "free_failed": 1, "cancelled": 1}
    assert strip(events, LOG_LINE_KEY) == [{"ev": "cancel", "request": "r3", "reason": "abort"}]
    assert header["observed"]["kinds"] == ["cancel"]


# -- the history and the CLI ------------------------------------------------


def test_the_history_reads_back_with_its_observation(tmp_path):
    out = tmp_path / "h.jsonl"
    import_log("vllm", str(LOGS / "vllm-lease-expiry-then-read.log"), str(out))
    with open_history(str(out)) as reader:
        assert reader.header.observed is not None
        assert reader.header.observed.observes("free") and not reader.header.observed.observes("alloc")
        events = [e for _, e in reader]
    assert [e.EV for e in events] == ["free", "transfer_read_done"]
    assert events[0].blocks is None and events[1].transfer is None
    assert events[1].extra[LOG_LINE_KEY] == 7


def test_every_engine_has_a_source_version():
    assert set(ENGINES) == {"vllm", "sglang", "dynamo"}
    assert all(any(ch.isdigit() for ch in src) for src in ENGINES.values())


class _Exploding(VllmImporter):
    def events(self, lines):
        yield from super().events(lines)
        raise OSError("disk gone")


def test_an_existing_output_is_never_left_half_written(tmp_path):
    out = tmp_path / "h.jsonl"
    out.write_text("precious\n")
    with pytest.raises(UsageError, match="disk gone"):
        run_import(_Exploding(), str(LOGS / "vllm-25562-lease-expired.log"), str(out))
    assert out.read_text() == "precious\n"
    assert os.listdir(tmp_path) == ["h.jsonl"]  # no temporary file left


def _subprocess(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "pdproto", *args], capture_output=True, text=True, input=stdin,
                          timeout=120)


class _Ran:
    def __init__(self, returncode: int, out: str, err: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, out, err


@pytest.fixture
def cli(capsys):
    """Run ``pdproto ARGS`` in this process (fast); returns code, stdout, stderr."""
    from pdproto._cli import main

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return _Ran(code, out, err)

    return run


def test_cli_writes_the_history_and_a_summary(tmp_path, cli):
    out = tmp_path / "h.jsonl"
    proc = cli("import", "vllm", str(LOGS / "vllm-unknown-handoff-line.log"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "1 line(s) look like handoff lines" in proc.stderr
    assert "vllm-unknown-handoff-line.log:2: (EngineCore_DP0" in proc.stderr
    assert len(out.read_text().splitlines()) == 2


def test_cli_stdin_to_stdout_and_json_summary():
    text = (LOGS / "sglang-12688-decode-transfer-failed.log").read_text()
    proc = _subprocess("import", "sglang", "-", "--json", stdin=text)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2
    summary = json.loads(proc.stderr)
    assert summary["events"] == 1 and summary["lines"] == 3 and summary["engine"] == "sglang"


@pytest.mark.parametrize("args, said", [
    (("import", "trtllm", "x.log"), "ENGINE: 'trtllm' is not allowed; expected one of vllm, sglang, dynamo"),
    (("import", "vllm", "/no/such.log"), "LOG: '/no/such.log' is not allowed; expected a readable log file"),
    (("import", "vllm", "/"), "not a directory"),
    (("import", "vllm", str(LOGS / "vllm-clean-handoff.log"), "-o", "/no/such/dir/h.jsonl"), "-o"),
])
def test_cli_bad_input_is_one_line_exit_2(args, said, cli):
    proc = cli(*args)
    assert proc.returncode == 2
    assert said in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


def test_importers_are_log_importers():
    from pdproto.importers._import import _IMPORTERS

    for cls in _IMPORTERS.values():
        assert issubclass(cls, LogImporter)
        assert set(cls.RECORDS) <= set(cls.KINDS) | set(cls.DEBUG_KINDS)
        assert all(p.level for p in cls.PATTERNS)


# -- judging an imported log end to end ---------------------------------------


def _audit_json(cli, history: pathlib.Path) -> tuple[int, dict]:
    proc = cli("audit", "--json", str(history))
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("level", ["debug", "warning"])
def test_lease_expiry_then_read_audits_as_early_source_free(tmp_path, level, cli):
    """The done-when of issue 14: P's lease ran out ("Releasing expired KV blocks") and D's READ of
    those blocks completed afterwards ("Potentially invalid KV blocks ... were retrieved by a decode
    worker"): early-source-free, naming the request and both log lines."""
    lines = (LOGS / "vllm-lease-expiry-then-read.log").read_text().splitlines(keepends=True)
    if level == "warning":  # vLLM's default level: only the WARNING and ERROR lines are there
        lines = [line for line in lines if " DEBUG " not in line]
    log = tmp_path / "p.log"
    log.write_text("".join(lines))
    history = tmp_path / "h.jsonl"
    import_log("vllm", str(log), str(history))
    code, result = _audit_json(cli, history)
    assert code == 1
    [violation] = result["violations"]
    read, expiry = (7, 5) if level == "debug" else (4, 3)  # log lines of the read and of the expiry
    assert violation["invariant"] == "early-source-free"
    assert violation["request"] == "cmpl-7f3a9c1e-0-4b2d8e11" and violation["gen"] is None
    assert violation["line"] == 3 and violation["witness"] == [2]  # history lines
    assert violation["log_line"] == read and violation["witness_log_lines"] == [expiry]
    assert "double-allocation" in {n["invariant"] for n in result["not_judged"]}


def test_clean_log_audits_clean_listing_what_was_not_judged(tmp_path, cli):
    history = tmp_path / "h.jsonl"
    import_log("vllm", str(LOGS / "vllm-clean-handoff.log"), str(history))
    code, result = _audit_json(cli, history)
    assert code == 0 and result["ok"] and result["violations"] == []
    not_judged = {n["invariant"] for n in result["not_judged"]}
    assert {"double-allocation", "leak", "stuck", "commit-before-ready"} <= not_judged
    assert "early-source-free" not in not_judged
    assert result["observed"] == sorted(result["observed"]) and "free" in result["observed"]
    proc = cli("audit", str(history))  # the text report lists them too
    assert proc.returncode == 0 and "not judged" in proc.stdout and "double-allocation" in proc.stdout


@pytest.mark.parametrize("engine, name", [
    ("vllm", "vllm-25562-lease-expired.log"),  # expiries with 0 reads: no read followed, nothing proven
    ("vllm", "vllm-aibrix-1772-late-read.log"),  # the read alone: its free is not in the excerpt
    ("sglang", "sglang-12688-decode-transfer-failed.log"),
    ("sglang", "sglang-11648-decode-timeout.log"),
    ("dynamo", "dynamo-5095-router.log"),
])
def test_public_excerpts_audit_clean(tmp_path, engine, name, cli):
    history = tmp_path / "h.jsonl"
    import_log(engine, str(LOGS / name), str(history))
    code, result = _audit_json(cli, history)
    assert code == 0, result["violations"]
    assert result["not_judged"]


def test_the_docs_example_does_what_docs_importers_md_shows(tmp_path, cli):
    root = pathlib.Path(__file__).parent.parent
    doc = (root / "docs" / "importers.md").read_text()
    history = tmp_path / "lease.jsonl"
    summary = import_log("vllm", str(root / "docs" / "examples" / "vllm-lease-expiry.log"), str(history))
    assert (summary.events, summary.unrecognised, [e.line for e in summary.examples]) == (4, 1, [11])
    for line in history.read_text().splitlines()[1:]:  # the events, as the doc prints them
        assert line in doc
    code, result = _audit_json(cli, history)
    assert code == 1
    assert [(v["invariant"], v["line"], v["log_line"], v["witness_log_lines"]) for v in result["violations"]] == [
        ("early-source-free", 5, 12, [9])]
    assert len(result["not_judged"]) == 17 and "not judged (17)" in doc


def test_the_summary_says_what_a_debug_log_would_add():
    result, _, _ = imported("vllm", "vllm-25562-lease-expired.log")
    assert not result.debug and result.more_at_debug == ("cancel", "fail")  # P's lines only
    result, _, _ = imported("vllm", "vllm-clean-handoff.log")
    assert result.debug and result.more_at_debug == ()
    result, _, _ = imported("sglang", "sglang-12688-decode-transfer-failed.log")
    assert result.more_at_debug == ()  # SGLang logs no more at DEBUG for these


@pytest.mark.parametrize("name", ["vllm-lease-expiry-then-read", "vllm-clean-handoff"])
def test_imported_reference_histories_are_current(tmp_path, name):
    out = tmp_path / "h.jsonl"
    import_log("vllm", str(LOGS / f"{name}.log"), str(out))
    assert out.read_text() == (LOGS / f"{name}.imported.jsonl").read_text(), (
        f"regenerate: pdproto import vllm tests/data/logs/{name}.log -o tests/data/logs/{name}.imported.jsonl")


def test_an_endless_line_is_cut_and_counted(tmp_path, monkeypatch):
    import pdproto.importers._base as base

    monkeypatch.setattr(base, "MAX_LOG_LINE", 64)
    expiry = _vllm("Releasing expired KV blocks for request r1 which were retrieved by 0 remote worker(s) "
                   "before lease expired.", "WARNING")
    text = "x" * 1000 + "\n" + "carriage\rreturn stays in its line\n" + expiry
    monkeypatch.setattr(base, "MAX_LOG_LINE", 1 << 20)
    result, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert result.overlong == 0 and result.lines == 3 and events[0][LOG_LINE_KEY] == 3
    monkeypatch.setattr(base, "MAX_LOG_LINE", 64)
    result, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert result.overlong == 2 and result.lines == 3  # the long lines count once each
    assert events == []  # the expiry line was longer than 64 characters too: its beginning has no id


def test_vllm_a_failed_read_reported_finished_writes_nothing(tmp_path):
    # vLLM reports a failed READ in finished_recving too (and its blocks as invalid): no write landed
    text = (_vllm("NIXL transfer failure: transfer_failed | Context: {'request_id': 'd1'}", "ERROR")
            + _vllm("Finished recving KV transfer for request d1")
            + _vllm(FINISHED.format(r="d1", s="FINISHED_ERROR", p=D_PARAMS)))
    _, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert [(e["ev"], e[LOG_LINE_KEY]) for e in events] == [("transfer_failed", 1), ("fail", 3), ("free", 3)]


def test_vllm_status_spellings_and_an_unknown_status_is_warned_not_guessed(tmp_path):
    def params(n):
        return D_PARAMS.replace("'p1'", f"'p{n}'")

    text = (_vllm(FINISHED.format(r="d1", s="FINISHED_STOPPED", p=params(1)).replace("RequestStatus.", ""))
            + _vllm(FINISHED.format(r="d2", s="FINISHED_REPETITION", p=params(2)))
            + _vllm(FINISHED.format(r="d3", s="FINISHED_SOMETHING_NEW", p=params(3)).replace("RequestStatus.", ""))
            + _vllm(FINISHED.format(r="d4", s="7", p=params(4)).replace("RequestStatus.", "")))
    result, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert [(e["ev"], e["request"], e.get("reason")) for e in events if e["ev"] != "free"] == [
        ("finish", "p1", "stop"), ("finish", "p2", "repetition")]
    assert result.unrecognised == 2 and [e.line for e in result.examples] == [3, 4]
    assert result.recognised["request_finished"] == 2


def test_vllm_json_log_format(tmp_path):
    # VLLM_LOGGING_CONFIG with vLLM's JSON_FORMAT (asctime levelname name processName process message)
    text = (
        '{"asctime": "2026-12-01 10:00:00,001", "levelname": "DEBUG", "name": "vllm.v1.core.sched.scheduler", '
        '"processName": "EngineCore_DP0", "process": 41, "message": "Finished sending KV transfer for request r1"}\n'
        '{"asctime": "2026-12-01 10:00:01,001", "levelname": "ERROR", "name": "vllm...pull_worker", '
        '"processName": "EngineCore_DP0", "process": 41, "message": "Potentially invalid KV blocks for '
        'unrecognized request r1 were retrieved by a decode worker. They may have expired."}\n'
    )
    result, header, events = imported("vllm", text=text, tmp_path=tmp_path)
    # a prefill instance's DEBUG log: P's kinds; D's (transfer_write_done, finish) are not in it, so they
    # are not declared (conform treats an observed kind as complete)
    assert result.debug and sorted(header["observed"]["kinds"]) == ["cancel", "fail", "free", "transfer_read_done"]
    assert [(e["ev"], e["request"]) for e in events] == [
        ("transfer_read_done", "r1"), ("free", "r1"), ("transfer_read_done", "r1")]


# -- review findings (issue 14 importers) --------------------------------------


def _cli_ok(cli, *args):
    proc = cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("name", ["vllm-clean-handoff.log", "vllm-lease-expiry-then-read.log"])
def test_a_clean_or_p_only_vllm_log_conforms_end_to_end(tmp_path, cli, name):
    """Review finding 3: D's request is P's (remote_request_id), so the clean log conforms; a prefill
    instance's log declares no D kind (none of D's events is in it), so its clean request conforms too
    (the lease-expiry log is rejected only at its expiry, a step the protocol does not have)."""
    history = tmp_path / "h.jsonl"
    import_log("vllm", str(LOGS / name), str(history))
    _cli_ok(cli, "audit", str(history)) if name == "vllm-clean-handoff.log" else None
    proc = cli("conform", str(history))
    if name == "vllm-clean-handoff.log":
        assert proc.returncode == 0, proc.stdout
    else:
        assert proc.returncode == 1 and "does not conform at line 2" in proc.stdout, proc.stdout


def test_the_docs_example_conforms_until_the_expiry(tmp_path, cli):
    history = tmp_path / "h.jsonl"
    import_log("vllm", str(pathlib.Path(__file__).parent.parent / "docs" / "examples" / "vllm-lease-expiry.log"),
               str(history))
    proc = cli("conform", str(history))
    # the clean request (lines 2-3) conforms; the first event none explains is the lease's expiry (line 4)
    assert proc.returncode == 1 and "does not conform at line 4" in proc.stdout, proc.stdout


def test_vllm_with_both_sides_a_request_seen_on_one_side_only_is_left_out(tmp_path):
    """Both sides in the log: p1/d1 is one request seen on both sides (kept, under P's name); p9 is seen
    on P only and d9 never names its P request (the excerpt ends before d9's request_finished); d2 is
    p2 on P, whose P lines are not in the log.  The history may name only requests of which every
    event of the declared kinds is in the log, so p9, d9 and p2 are left out (counted)."""
    text = (_vllm(FINISHED.format(r="p1", s="FINISHED_LENGTH_CAPPED", p=P_PARAMS))
            + _vllm(FINISHED.format(r="p9", s="FINISHED_LENGTH_CAPPED", p=P_PARAMS))
            + _vllm("Finished recving KV transfer for request d1")
            + _vllm("Finished recving KV transfer for request d9")
            + _vllm("Finished recving KV transfer for request d2")
            + _vllm("Finished sending KV transfer for request p1")
            + _vllm("Finished sending KV transfer for request p9")
            + _vllm(FINISHED.format(r="d2", s="FINISHED_STOPPED", p=D_PARAMS.replace("'p1'", "'p2'")))
            + _vllm(FINISHED.format(r="d1", s="FINISHED_STOPPED", p=D_PARAMS)))
    result, header, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert sorted(header["observed"]["kinds"]) == ["cancel", "fail", "finish", "free", "transfer_failed",
                                                   "transfer_read_done", "transfer_write_done"]
    assert [(e["ev"], e["request"], e[LOG_LINE_KEY]) for e in events] == [
        ("transfer_write_done", "p1", 3), ("transfer_read_done", "p1", 6), ("free", "p1", 6),
        ("finish", "p1", 9), ("free", "p1", 9)]
    # p9: read and free; d9: its write; p2: write, finish, free
    assert result.dropped == 6 and result.events == 5


def test_vllm_a_decode_only_log_declares_d_kinds_only(tmp_path):
    text = (_vllm("Finished recving KV transfer for request d1")
            + _vllm(FINISHED.format(r="d1", s="FINISHED_STOPPED", p=D_PARAMS)))
    result, header, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert sorted(header["observed"]["kinds"]) == ["cancel", "fail", "finish", "free", "transfer_failed",
                                                   "transfer_write_done"]
    assert {e["request"] for e in events} == {"p1"} and result.dropped == 0


def test_sglang_abort_req_is_a_cancel_not_a_transfer_failure(tmp_path):
    line = ("[2025-11-05 16:39:09 TP0] Prefill transfer failed for request rank=0 req.rid='r1' "
            "req.bootstrap_room=7 with exception KVTransferError(bootstrap_room=7): Aborted by AbortReq.\n")
    _, _, events = imported("sglang", text=line * 2, tmp_path=tmp_path)
    assert strip(events, LOG_LINE_KEY) == [{"ev": "cancel", "request": "r1", "reason": "abort"}]


def test_sglang_12688_conforms(tmp_path, cli):
    history = tmp_path / "h.jsonl"
    import_log("sglang", str(LOGS / "sglang-12688-decode-transfer-failed.log"), str(history))
    proc = cli("conform", str(history))
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("engine, text, kind", [
    ("vllm", "\x1b[36mDEBUG\x1b[0m 12-01 10:00:00 [s.py:1] Finished recving KV transfer for request d1\n",
     "transfer_write_done"),
    ("vllm", "[DEBUG] 12-01 10:00:00 [s.py:1] Finished recving KV transfer for request d1\n", "transfer_write_done"),
    ("vllm", "12-01 10:00:00 d Finished recving KV transfer for request d1\n", "transfer_write_done"),
    ("dynamo", "2026-01-01T00:00:01.000001Z \x1b[34mDEBUG\x1b[0m dynamo_llm::kv_router: Request r3 cancelled, "
               "ending stream\n", "cancel"),
    ("dynamo", "2026-01-01T00:00:01Z \x1b[34mDEBUG\x1b[0m\x1b[2mdynamo_llm::kv_router\x1b[0m: Request r3 "
               "cancelled, ending stream\n", "cancel"),
])
def test_debug_lines_in_any_format_declare_their_kinds(tmp_path, cli, engine, text, kind):
    """Review finding 1: coloured, [DEBUG]-prefixed or level-less DEBUG lines: a line of a format the
    engine logs at DEBUG declares the DEBUG kinds, and the history audits (no event of an undeclared kind)."""
    log = tmp_path / "a.log"
    log.write_text(text)
    history = tmp_path / "a.jsonl"
    result = import_log(engine, str(log), str(history))
    assert result.debug and kind in result.observed and result.events == 1
    _cli_ok(cli, "audit", str(history))


class _NoWrite(Exception):
    pass


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), FileNotFoundError(2, "No such file")])
def test_an_unwritable_output_is_one_line_exit_2(tmp_path, cli, monkeypatch, error):
    """Review finding 4: an -o that os.access allows but that cannot be written (/sys, /proc as root)."""
    import tempfile

    def mkstemp(*args, **kwargs):
        raise error

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    out = tmp_path / "h.jsonl"
    proc = cli("import", "vllm", str(LOGS / "vllm-clean-handoff.log"), "-o", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert f"-o: '{out}' is not allowed; expected a file you may write ({error.strerror})" in proc.stderr
    assert not out.exists()


def test_an_output_that_fails_at_the_rename_leaves_nothing(tmp_path, monkeypatch):
    def replace(src, dst):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(UsageError, match="Read-only file system"):
        import_log("vllm", str(LOGS / "vllm-clean-handoff.log"), str(tmp_path / "h.jsonl"))
    assert os.listdir(tmp_path) == []


def test_the_output_gets_the_mode_of_a_new_file_or_of_the_file_it_replaces(tmp_path):
    """Review finding 5: not mkstemp's 0600."""
    out = tmp_path / "h.jsonl"
    old = os.umask(0o022)
    try:
        import_log("vllm", str(LOGS / "vllm-clean-handoff.log"), str(out))
        assert out.stat().st_mode & 0o777 == 0o644
        out.chmod(0o640)
        import_log("vllm", str(LOGS / "vllm-clean-handoff.log"), str(out))
        assert out.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("data, said", [
    (b"\x1f\x8b\x08\x00" + bytes(40), "gzip-compressed: gunzip it first"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(100), "binary file"),
])
def test_a_binary_or_gzip_log_is_refused(tmp_path, cli, data, said):
    """Review finding 6: not an empty history with exit 0."""
    log = tmp_path / "x.log"
    log.write_bytes(data)
    proc = cli("import", "vllm", str(log))
    assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert proc.stdout == ""


def test_an_empty_log_is_warned(tmp_path, cli):
    log = tmp_path / "x.log"
    log.write_text("")
    proc = cli("import", "vllm", str(log))
    assert proc.returncode == 0 and "is empty" in proc.stderr


@pytest.mark.parametrize("line", [
    '2026-01-01T00:00:01Z DEBUG dynamo_llm::kv_router::push_router: Request cancelled, ending stream '
    'request_id="abc"',
    "2026-01-01T00:00:01Z DEBUG dynamo_llm::kv_router::push_router: Request cancelled, ending stream "
    "request_id=abc",
    '{"time":"2026-01-01T00:00:01Z","level":"DEBUG","target":"dynamo_llm::kv_router::push_router",'
    '"message":"Request cancelled, ending stream","request_id":"abc"}',
    '{"time":"2026-01-01T00:00:01Z","level":"DEBUG","request_id":"abc",'
    '"message":"Request cancelled, ending stream"}',
])
def test_dynamo_current_cancel_line_with_a_request_id_field(tmp_path, line):
    """Review finding 7: tracing::debug!(request_id = context.id(), "Request cancelled, ending stream")."""
    result, header, events = imported("dynamo", text=line + "\n", tmp_path=tmp_path)
    assert strip(events, LOG_LINE_KEY) == [{"ev": "cancel", "request": "abc", "reason": "abort"}]
    assert result.unrecognised == 0 and header["observed"]["kinds"] == ["cancel"]


def test_dynamo_a_cancel_naming_no_request_is_warned(tmp_path):
    result, _, events = imported("dynamo", text="x DEBUG y: Request cancelled, ending stream\n", tmp_path=tmp_path)
    assert events == [] and result.unrecognised == 1


@pytest.mark.parametrize("failure, context, known", [
    ("notification_failed", "{'request_id': 'd1'}", True),
    ("transfer_release_failed. Retaining handle and blocks until release succeeds", "{'request_id': 'd1'}", True),
    ("handshake_setup_failed", "{'failure_type': 'handshake_setup_failed', 'request_id': None}", True),
    ("push_handshake_failed", "{'request_id': 'd1'}", False),
    ("some_new_failure", "{'request_id': 'd1'}", False),
    ("transfer_failed", "{'failure_type': 'transfer_failed', 'request_id': None}", False),
])
def test_vllm_failure_types_outside_the_known_ones_are_warned(tmp_path, failure, context, known):
    """Review finding 8: only the listed no-event types are known; anything else is warned."""
    text = _vllm(f"NIXL transfer failure: {failure} | Context: {context}", "ERROR")
    result, _, events = imported("vllm", text=text, tmp_path=tmp_path)
    assert events == []
    assert (result.recognised["transfer_failure"], result.unrecognised) == ((1, 0) if known else (0, 1))


def test_cli_output_dash_is_standard_output(tmp_path, cli, monkeypatch):
    """Review finding 20: -o - writes to standard output, not a file named '-'."""
    monkeypatch.chdir(tmp_path)
    proc = cli("import", "vllm", str(LOGS / "vllm-clean-handoff.log"), "-o", "-")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 6
    assert os.listdir(tmp_path) == []


def test_vllm_both_sides_at_info_keep_p_requests_without_a_failure(tmp_path, cli):
    """At INFO level P and D pair only through a failure's context: the P request with a lease expiry
    and a late read (no failure) is kept, and still audits as early-source-free; a failure naming no
    P request is left out."""
    expiry = "Releasing expired KV blocks for request p1 which were retrieved by 0 remote worker(s) before lease expired."
    late = "Potentially invalid KV blocks for unrecognized request p1 were retrieved by a decode worker. They may have expired."
    context = "{'failure_type': 'transfer_failed', 'request_id': 'd5', 'remote_request_id': 'p5'}"
    text = (_vllm(expiry, "WARNING") + _vllm(f"NIXL transfer failure: transfer_failed | Context: {context}", "ERROR")
            + _vllm("NIXL transfer failure: transfer_failed | Context: {'request_id': 'd6'}", "ERROR")
            + _vllm(late, "ERROR"))
    log, history = tmp_path / "x.log", tmp_path / "h.jsonl"
    log.write_text(text)
    result = import_log("vllm", str(log), str(history))
    assert result.observed == ("free", "transfer_failed", "transfer_read_done") and result.dropped == 1
    events = [json.loads(line) for line in history.read_text().splitlines()[1:]]
    assert [(e["ev"], e["request"]) for e in events] == [
        ("free", "p1"), ("transfer_failed", "p5"), ("transfer_read_done", "p1")]
    code, audited = _audit_json(cli, history)
    assert code == 1 and [v["invariant"] for v in audited["violations"]] == ["early-source-free"]


def test_the_spool_copy_renames_ids_with_escapes_and_leaves_out_requests():
    from pdproto.importers._base import _copy_events

    spool = io.StringIO('{"ev": "free", "worker": "D0", "request": "a\\"b", "log_line": 1}\n'
                        '{"ev": "free", "worker": "D0", "request": "x", "log_line": 2}\n'
                        '{"ev": "finish", "request": "y", "log_line": 3}\n'
                        '{"ev": "free", "worker": "D0", "request": "z", "log_line": 4}\n')
    out = io.StringIO()
    assert _copy_events(spool, 4, out, {'a"b': "P\u00e9", "x": 'q"'}, frozenset({"free"}), frozenset({"z"})) == (2, 2)
    assert [json.loads(line)["request"] for line in out.getvalue().splitlines()] == ["P\u00e9", 'q"']


def test_names_to_rename_are_applied_to_the_spool_when_they_pile_up(tmp_path, monkeypatch):
    """The table of D names still to rename stays bounded: beyond MAX_TRACKED entries the events
    spooled so far are renamed at once; the history is the same."""
    import pdproto.importers._base as base

    text = ""
    for i in range(5):
        text += (_vllm(FINISHED.format(r=f"p{i}", s="FINISHED_LENGTH_CAPPED", p=P_PARAMS))
                 + _vllm(f"Finished recving KV transfer for request d{i}")
                 + _vllm(f"Finished sending KV transfer for request p{i}"))
    for i in range(5):
        text += _vllm(FINISHED.format(r=f"d{i}", s="FINISHED_STOPPED", p=D_PARAMS.replace("'p1'", f"'p{i}'")))
    whole = imported("vllm", text=text, tmp_path=tmp_path)
    monkeypatch.setattr(base, "MAX_TRACKED", 1)
    renamed = []
    spool_rename = base._Spool.rename
    monkeypatch.setattr(base._Spool, "rename", lambda self, names: renamed.append(dict(names))
                        or spool_rename(self, names))
    piecewise = imported("vllm", text=text, tmp_path=tmp_path)
    assert piecewise[1:] == whole[1:] and piecewise[0].events == whole[0].events == 25
    assert len(renamed) == 2 and {e["request"] for e in piecewise[2]} == {f"p{i}" for i in range(5)}
