"""The mooncake transport (Mooncake's transfer engine over TCP on loopback):
every example history replays to the same verdicts as through copy_, and a
failed transfer is an error status of the engine.  Skipped when the engine
is not installed or cannot load here (it needs libibverbs.so.1 even for
TCP)."""

from __future__ import annotations

import glob
import os

import pytest

torch = pytest.importorskip("torch")
try:
    import mooncake.engine  # noqa: F401
except ImportError as exc:  # not installed, or installed without libibverbs.so.1
    pytest.skip(f"the mooncake engine does not load here: {exc}", allow_module_level=True)

from conftest import EXAMPLES, ROOT  # noqa: E402

from pdproto.backends._mooncake import MooncakeTransport  # noqa: E402
from pdproto.backends._transport import BlockMove, Transfer  # noqa: E402
from pdproto.drivers._replay import replay  # noqa: E402
from pdproto.spec._history import write_history  # noqa: E402

EXAMPLE_FILES = sorted(glob.glob(os.path.join(EXAMPLES, "*.jsonl")))
MUTANTS = sorted(
    os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "models", "*.py"))
    if not os.path.basename(p).startswith("_") and "EXPECTED = None" not in open(p, encoding="utf-8").read()
)


@pytest.fixture(scope="module")
def mooncake():
    t = MooncakeTransport()
    yield t
    t.close()


def verdicts(result):
    return [(v.invariant, v.line, v.message) for v in result.violations]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=os.path.basename)
def test_example_has_the_same_verdicts_under_mooncake(path, mooncake):
    before = mooncake.statistics()
    plain, real = replay(path), replay(path, transport=mooncake)
    assert verdicts(real) == verdicts(plain)
    assert real.backend["transport"] == "mooncake"
    now = mooncake.statistics()
    if plain.backend["bytes_copied"]:
        assert now.transfers + now.aborts > before.transfers + before.aborts


@pytest.mark.parametrize("name", MUTANTS)
def test_counterexample_has_the_same_verdicts_under_mooncake(name, mooncake, tmp_path):
    from pdproto.drivers._explore import explore, trace_header
    from pdproto.drivers._loader import load_model

    model, _info = load_model(os.path.join(ROOT, "models", name + ".py"))
    res = explore(model, stop_on_first=True)
    if not res.failures:
        pytest.skip(f"{name}: no counterexample history")
    path = str(tmp_path / f"{name}.jsonl")
    write_history(path, res.failures[0].events, trace_header(res.header, res.failures[0]))
    assert verdicts(replay(path, transport=mooncake)) == verdicts(replay(path))


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
def test_pull_and_push_move_the_blocks(mooncake, pull):
    src = torch.randint(0, 255, (16, 1, 1, 1, 1, 512), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    mooncake.run(Transfer("m-dir", "P0", "D0", pull, [BlockMove(dst, [3, 0], src, [7, 8], (0, 1), (0, 1))]))
    assert torch.equal(dst[[3, 0]], src[[7, 8]]) and not dst[1].any()


def test_failed_transfer_is_an_error_status_of_the_engine(mooncake):
    path = os.path.join(EXAMPLES, "retry-after-failure.jsonl")
    before = mooncake.statistics().failures
    assert verdicts(replay(path, transport=mooncake)) == verdicts(replay(path))
    s = mooncake.statistics()
    assert s.failures == before + 1 and s.errors[-1].startswith("status -1")
