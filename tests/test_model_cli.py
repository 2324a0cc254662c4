"""The real transformer from the command line: ``replay --model``, and
``check`` / ``fuzz --backend torch --transformer`` (docs/replay.md)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from pdproto._cli import main  # noqa: E402

from conftest import ROOT  # noqa: E402

EXAMPLES = f"{ROOT}/docs/examples"


def run_json(argv, capsys):
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def test_replay_model_clean_and_boundary(capsys):
    code, d = run_json(["replay", f"{EXAMPLES}/clean-push.jsonl", "--model", "tiny-llama"], capsys)
    assert code == 0 and d["backend"]["model"]["name"] == "tiny-llama" and d["backend"]["model"]["decodes"] == 2
    code, d = run_json(["replay", f"{EXAMPLES}/first-token-boundary.jsonl", "--model", "tiny-llama"], capsys)
    assert code == 1
    found = {(v["invariant"], v["line"]) for v in d["violations"]}
    assert ("logit-divergence", 11) in found and ("first-token-boundary", 11) in found
    # vLLM's convention, declared: clean to the last bit
    code, d = run_json(["replay", f"{EXAMPLES}/clean-recompute.jsonl", "--model", "tiny-llama"], capsys)
    assert code == 0 and d["backend"]["model"]["boundary"] == "recompute"


def test_check_and_fuzz_with_a_transformer_backend(capsys):
    code, d = run_json(["check", "decode-from-last-prompt-token", "--backend", "torch", "--transformer",
                        "tiny-llama"], capsys)
    assert code == 1 and "logit-divergence" in {v["invariant"] for v in d["violations"]}
    assert d["backend"]["model"] == "tiny-llama"
    code, d = run_json(["fuzz", "--backend", "torch", "--transformer", "tiny-llama", "--examples", "3",
                        "--steps", "20", "--seed", "1", "--no-database"], capsys)
    assert code == 0 and d["examples"] == 3


@pytest.mark.parametrize("argv, flag", [
    (["replay", f"{EXAMPLES}/clean-push.jsonl", "--model", "no-such-model"], "--model"),
    (["check", "--transformer", "tiny-llama"], "--transformer"),
    (["fuzz", "--transformer", "tiny-llama"], "--transformer"),
    (["replay", f"{EXAMPLES}/clean-push.jsonl", "--model", "tiny-llama", "--adapter", "model:reference"], "--model"),
])
def test_model_flag_errors(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
