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
    assert set(COMMANDS) == {"check", "fuzz", "audit", "replay", "cost"}


def test_no_command_prints_help_and_exits_2(capsys):
    from pdproto._cli import main

    assert main([]) == 2
    assert "audit" in capsys.readouterr().out


def test_version(capsys):
    from pdproto import __version__
    from pdproto._cli import main

    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
