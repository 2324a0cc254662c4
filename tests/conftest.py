import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "docs", "examples")
sys.path.insert(0, EXAMPLES)  # make_examples: the labelled example histories


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def counterexamples(tmp_path_factory):
    """Each catalogue mutant's first counterexample, as a history file
    (explored once a session): ``{name: path}``, None where the mutant's
    finding is not a trace."""
    import glob

    from pdproto.drivers import explore, trace_header
    from pdproto.drivers import load_model
    from pdproto.spec import write_history

    folder = tmp_path_factory.mktemp("counterexamples")
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "models", "*.py"))):
        name = os.path.basename(path)[:-3]
        if name.startswith("_") or "EXPECTED = None" in open(path, encoding="utf-8").read():
            continue
        model, _info = load_model(path)
        res = explore(model, stop_on_first=True)
        found = list(res.failures)
        out[name] = None
        if found:
            out[name] = str(folder / f"{name}.jsonl")
            write_history(out[name], found[0].events, trace_header(res.header, found[0]))
    return out


#: the catalogue mutants (those with an expected finding), by file name
MUTANTS = sorted(
    os.path.basename(p)[:-3] for p in __import__("glob").glob(os.path.join(ROOT, "models", "*.py"))
    if not os.path.basename(p).startswith("_") and "EXPECTED = None" not in open(p, encoding="utf-8").read()
)


def verdicts(result):
    """A replay's violations as (invariant, line, message), to compare transports."""
    return [(v.invariant, v.line, v.message) for v in result.violations]


def delta(t, before, *keys):
    """How much each statistic of transport ``t`` grew since the snapshot ``before``."""
    now = t.statistics()
    return {k: getattr(now, k) - getattr(before, k) for k in keys}
