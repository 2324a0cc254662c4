"""The package's shape: what `import pdproto` pulls in, the CLI's commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
    )


def test_import_pdproto_pulls_in_no_heavy_dependency():
    proc = _python(
        "import sys, json, pdproto\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'rich', 'hypothesis', 'networkx', 'matplotlib'})))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_torch_names_load_lazily():
    proc = _python("import pdproto; print(pdproto.KV_CORRUPTION)")
    if "No module named 'torch'" in proc.stderr:
        return  # torch is optional
    assert proc.stdout.strip() == "kv-corruption"


def test_unknown_attribute_is_an_attribute_error():
    import pdproto

    try:
        pdproto.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_every_command_is_registered(capsys):
    from pdproto._cli import COMMANDS, build_parser

    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(choices) == list(COMMANDS)
    assert set(COMMANDS) == {"check", "fuzz", "audit", "conform", "import", "replay", "corpus", "cost", "simulate"}


def test_no_command_prints_help_and_exits_2(capsys):
    from pdproto._cli import main

    assert main([]) == 2
    assert "audit" in capsys.readouterr().out


def test_version(capsys):
    from pdproto import __version__
    from pdproto._cli import main

    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


#: The public API.  Adding a name is a decision: add it here too.  Removing or
#: renaming one breaks users.
PUBLIC = {
    # errors
    "PdprotoError", "HistoryFormatError", "FileFormatError", "UsageError", "LimitError", "MissingExtraError",
    "ModelLoadError", "TransportError",
    # the spec
    "Event", "EVENT_TYPES", "Submit", "Reserve", "PrefillStart", "PrefillDone", "Alloc",
    "TransferStart", "TransferReadDone", "TransferWriteDone", "TransferFailed", "TransferAbort",
    "Commit", "Decode", "Finish", "Cancel", "Fail", "Free", "Restart", "Share", "event_from_dict",
    "FORMAT_VERSION", "FORMAT_VERSIONS", "FEATURES", "KVSpec", "HistoryHeader", "HistoryReader", "HistoryWriter", "WorkerSpec",
    "open_history", "read_events", "write_history", "INVARIANTS", "END_INVARIANTS", "Monitor",
    "Violation", "INVARIANT_NEEDS", "PartialMonitor", "Observation",
    # the protocol
    "Action", "ActionNotEnabled", "Model", "Renaming", "FAULT_KINDS", "ModelConfig",
    "parse_faults", "Handoff", "HandoffModel", "transition_table",
    # the drivers
    "explore", "ExploreResult", "Counterexample", "Step", "audit", "AuditResult", "conform",
    "ConformanceResult", "replay",
    "ReplayResult", "fuzz", "FuzzResult", "load_model", "list_models", "ModelInfo",
    "Adapter", "ModelAdapter", "load_adapter", "fuzz_adapter", "replay_on_adapter",
    # the torch backend, loaded on first use
    "TorchBackend", "KVCorruption", "KV_CORRUPTION",
    # the model backend, loaded on first use
    "ModelBackend", "LogitDivergence", "LOGIT_DIVERGENCE",
}


def test_public_api_is_pinned():
    import pdproto

    assert len(pdproto.__all__) == len(set(pdproto.__all__)), "a name is listed twice"
    assert set(pdproto.__all__) == PUBLIC


def test_cost_names_live_under_pdproto_cost():
    import pdproto
    import pdproto.cost

    for name in ("CostModel", "KVShape", "Link", "Timing", "estimate", "DTYPE_BYTES"):
        assert name in pdproto.cost.__all__
        assert not hasattr(pdproto, name), name


def test_every_exported_name_resolves():
    """Every subpackage's ``__all__`` names something that exists (torch names
    of pdproto.backends only where torch is installed)."""
    import importlib
    import importlib.util

    has_torch = importlib.util.find_spec("torch") is not None
    for name in ("pdproto", "pdproto.spec", "pdproto.protocol", "pdproto.backends",
                 "pdproto.drivers", "pdproto.cost", "pdproto.testing"):
        module = importlib.import_module(name)
        assert module.__all__, name
        lazy = set(getattr(module, "_LAZY", ()))
        for attr in module.__all__:
            if attr in lazy and not has_torch:
                continue
            assert getattr(module, attr) is not None, f"{name}.{attr}"
