"""The transport layer of the torch backend (pdproto.backends._transport):
the copy transport, the byte runs a library transport moves, the
--transport flag, and the missing-extra errors (none of these needs a
transport library)."""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import EXAMPLES  # noqa: E402

from pdproto import UsageError  # noqa: E402
from pdproto._cli import main  # noqa: E402
from pdproto.backends._transport import (  # noqa: E402
    BlockMove,
    CopyTransport,
    Transfer,
    block_views,
    byte_runs,
    make_transport,
)
from pdproto.drivers._replay import replay  # noqa: E402


def pools(seed=0, blocks=6, bs=4, layers=3, kv=2, heads=4, dim=8):
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, bs, layers, kv, heads, dim)
    src = torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    return src, dst


MOVES = [
    dict(dst_ids=[0, 1, 2], src_ids=[3, 4, 5], dl=(0, 3), sl=(0, 3)),  # whole blocks, one run
    dict(dst_ids=[5, 0, 2], src_ids=[1, 4, 0], dl=(0, 3), sl=(0, 3)),  # permuted
    dict(dst_ids=[1, 2], src_ids=[2, 3], dl=(1, 2), sl=(1, 2)),  # one layer
    dict(dst_ids=[4], src_ids=[0], dl=(0, 3), sl=(0, 3), slots=(1, 3)),  # a token range
    dict(dst_ids=[0, 1], src_ids=[0, 1], dl=(0, 2), sl=(1, 3), heads=((0, 2), (2, 4))),  # heads, shifted layers
]


@pytest.mark.parametrize("spec", MOVES, ids=range(len(MOVES)))
def test_copy_transport_moves_exactly_the_selected_elements(spec):
    src, dst = pools()
    m = BlockMove(dst, spec["dst_ids"], src, spec["src_ids"], spec["dl"], spec["sl"], spec.get("heads"),
                  spec.get("slots"))
    want = dst.clone()
    for d, s in block_views(BlockMove(want, m.dst_ids, src, m.src_ids, m.dl, m.sl, m.heads, m.slots)):
        d.copy_(s)
    CopyTransport().run(Transfer("x", "P0", "D0", False, [m]))
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(dst.view(torch.int16), torch.zeros_like(dst.view(torch.int16)))


def test_copy_transport_many_scattered_blocks_take_the_gather_path():
    src, dst = pools(blocks=64)
    ids = list(range(0, 64, 2))
    m = BlockMove(dst, ids, src, ids[::-1], (0, 3), (0, 3))
    CopyTransport().run(Transfer("x", "P0", "D0", True, [m]))
    for d, s in zip(ids, ids[::-1]):
        assert torch.equal(dst[d].view(torch.int16), src[s].view(torch.int16))
    assert torch.equal(dst[1].view(torch.int16), torch.zeros_like(dst[1].view(torch.int16)))


@pytest.mark.parametrize("spec", MOVES, ids=range(len(MOVES)))
def test_byte_runs_move_what_copy_moves(spec):
    """The (target, source, length) runs a library transport posts, applied
    with memmove, give the bytes the copy transport gives."""
    src, dst = pools(seed=1)
    m = BlockMove(dst, spec["dst_ids"], src, spec["src_ids"], spec["dl"], spec["sl"], spec.get("heads"),
                  spec.get("slots"))
    want = dst.clone()
    CopyTransport().run(Transfer("x", "P0", "D0", False,
                                 [BlockMove(want, m.dst_ids, src, m.src_ids, m.dl, m.sl, m.heads, m.slots)]))
    runs = 0
    for d, s in block_views(m):
        da, sa, n = byte_runs(d, s)
        for a, b in zip(da.tolist(), sa.tolist()):
            ctypes.memmove(a, b, n)
            runs += 1
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    if spec.get("heads") is None and spec.get("slots") is None and spec["dl"] == (0, 3):
        assert runs == len(list(block_views(m)))  # whole blocks: one run per run of blocks


def test_make_transport_names():
    assert make_transport(None).name == "copy"
    assert make_transport("copy").name == "copy"
    t = CopyTransport()
    assert make_transport(t) is t
    with pytest.raises(UsageError, match="copy, nixl, mooncake"):
        make_transport("rdma")


def test_replay_with_the_copy_transport_is_the_default(tmp_path):
    path = os.path.join(EXAMPLES, "early-source-free.jsonl")
    a, b = replay(path), replay(path, transport="copy")
    assert a.backend["transport"] == "copy" == b.backend["transport"]
    assert [(v.invariant, v.line) for v in a.violations] == [(v.invariant, v.line) for v in b.violations]
    assert a.data_violations > 0


def test_transport_flag_needs_the_torch_backend(capsys):
    assert main(["check", "p-frees-source-on-timer", "--transport", "nixl"]) == 2
    assert "--backend torch along with it" in capsys.readouterr().err
    assert main(["fuzz", "p-frees-source-on-timer", "--transport", "nixl"]) == 2
    assert "--backend torch along with it" in capsys.readouterr().err
    path = os.path.join(EXAMPLES, "clean-push.jsonl")
    assert main(["replay", path, "--transport", "nixl", "--adapter", "vllm"]) == 2
    assert main(["replay", path, "--transport", "rdma"]) == 2


def test_transport_with_the_model_backend_is_refused():
    with pytest.raises(UsageError, match="--transport with --model"):
        replay(os.path.join(EXAMPLES, "clean-push.jsonl"), model="tiny-llama", transport="nixl")


@pytest.mark.parametrize("name,blocked,extra", [
    ("nixl", ("nixl_cu12", "nixl_cu12._api", "nixl", "nixl._api"), "nixl"),
    ("mooncake", ("mooncake", "mooncake.engine"), "mooncake"),
])
def test_without_the_library_the_extra_is_named(name, blocked, extra, monkeypatch, capsys):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)
    code = main(["replay", os.path.join(EXAMPLES, "clean-push.jsonl"), "--transport", name])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    assert len(err) == 1 and f"pip install 'pdproto[{extra}]'" in err[0], err


def test_mooncake_without_libibverbs_says_so_in_one_line(monkeypatch, capsys):
    """The wheel links libibverbs.so.1 even for TCP: without the system
    package its import fails, and --transport mooncake says why (exit 2)."""
    import importlib

    from pdproto.backends import _mooncake

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return real(name, *a, **k)

    monkeypatch.setattr(_mooncake.importlib, "import_module", fake)
    code = main(["replay", os.path.join(EXAMPLES, "clean-push.jsonl"), "--transport", "mooncake"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    assert len(err) == 1 and "libibverbs.so.1" in err[0] and "libibverbs1" in err[0], err


#: the examples whose kv-corruption needs a slow transfer: under eager timing
#: (the bytes move at transfer_start, as a transfer library on an idle host
#: moves them) the race window closes and only the protocol violation is left
EAGER_CLOSES = {"commit-before-ready", "commit-before-ready-chunk", "commit-before-ready-layer",
                "double-allocation-shared-prefix", "early-source-free", "early-target-reuse",
                "vllm-lease-early-source-free"}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.jsonl"))), ids=os.path.basename)
def test_eager_timing_closes_exactly_the_race_windows(path):
    adversarial, eager = replay(path), replay(path, timing="eager")
    assert eager.backend["timing"] == "eager"

    def protocol(r):
        return [(v.invariant, v.line) for v in r.violations if v.invariant != "kv-corruption"]

    def data(r):
        return [v.line for v in r.violations if v.invariant == "kv-corruption"]

    assert protocol(eager) == protocol(adversarial)
    if os.path.basename(path)[:-6] in EAGER_CLOSES:
        assert data(adversarial) and not data(eager)
    else:
        assert data(eager) == data(adversarial)


def test_transfer_timing_is_checked():
    with pytest.raises(UsageError, match="adversarial, eager"):
        replay(os.path.join(EXAMPLES, "clean-push.jsonl"), timing="late")
