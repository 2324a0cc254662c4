"""Every model in models/: the correct ones check clean, and each mutant is
caught by its intended invariant, fast, with a shortest counterexample that
`pdproto audit` reports the same way."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = sorted(
    f[:-3] for f in os.listdir(os.path.join(ROOT, "models"))
    if f.endswith(".py") and not f.startswith("_")
)


def _module(name):
    from pdproto.drivers import load_model

    _, info = load_model(name)
    return info.module


def _params():
    out = []
    for name in MODELS:
        text = open(os.path.join(ROOT, "models", name + ".py"), encoding="utf-8").read()
        correct = "EXPECTED = None" in text
        # exploring a correct model's whole default space takes minutes
        marks = [pytest.mark.slow] if correct else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _cli(argv, capsys):
    from pdproto._cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out


def _audit(path, capsys):
    rc, out = _cli(["audit", str(path), "--json"], capsys)
    return [(v["invariant"], v["line"]) for v in json.loads(out)["violations"]]


@pytest.mark.parametrize("name", _params())
def test_model(name, capsys, tmp_path):
    module = _module(name)
    expected = module.EXPECTED
    trace = tmp_path / f"{name}.jsonl"
    rc, out = _cli(["check", name.replace("_", "-"), "--json", "--out", str(trace)], capsys)
    obj = json.loads(out)
    if expected is None:
        assert rc == 0, obj
        assert obj["ok"] and obj["violations"] == [] and obj["deadlocks"] == []
        assert obj["unmet_sometimes"] == [] and obj["complete"]
        return
    assert rc == 1, obj
    found = obj["violations"] + obj["deadlocks"]
    assert [f["invariant"] for f in found] == [expected], found
    assert obj["seconds"] < 10, f"{name} took {obj['seconds']} s"
    (cx,) = found
    # shortest: symmetry reduction must not lengthen it
    if obj["symmetry"] not in ("off", "none offered"):
        rc2, out2 = _cli(["check", name.replace("_", "-"), "--json", "--no-symmetry"], capsys)
        plain = json.loads(out2)
        (cx2,) = plain["violations"] + plain["deadlocks"]
        assert len(cx["trace"]) == len(cx2["trace"])
    audited = _audit(trace, capsys)
    assert audited and audited[0] == (expected, cx["line"]), audited
