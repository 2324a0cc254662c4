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

from pdproto import HistoryHeader, TransportError, UsageError  # noqa: E402
from pdproto._cli import main  # noqa: E402
from pdproto.backends import (  # noqa: E402
    BlockMove,
    CopyTransport,
    Transfer,
    Transport,
    block_views,
    byte_runs,
    make_transport,
)
from pdproto.drivers import replay, torch_backend_factory  # noqa: E402


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


def expected_move(dst, src, m):
    """``dst`` after ``m``, element by element from BlockMove's formula
    (``dst[dst_ids[i], slots, dl, :, dheads] = src[src_ids[i], slots, sl, :, sheads]``),
    without block_views."""
    want = dst.view(torch.int16).clone()
    bits = src.view(torch.int16)
    (dh0, dh1), (sh0, sh1) = m.heads if m.heads is not None else ((0, dst.shape[4]), (0, src.shape[4]))
    t0, t1 = m.slots if m.slots is not None else (0, dst.shape[1])
    for d, s in zip(m.dst_ids, m.src_ids):
        for t in range(t0, t1):
            for k in range(m.dl[1] - m.dl[0]):
                for kv in range(dst.shape[3]):
                    for h in range(dh1 - dh0):
                        for e in range(dst.shape[5]):
                            want[d, t, m.dl[0] + k, kv, dh0 + h, e] = bits[s, t, m.sl[0] + k, kv, sh0 + h, e]
    return want.view(dst.dtype)


@pytest.mark.parametrize("spec", MOVES, ids=range(len(MOVES)))
def test_copy_transport_moves_exactly_the_selected_elements(spec):
    src, dst = pools()
    m = BlockMove(dst, spec["dst_ids"], src, spec["src_ids"], spec["dl"], spec["sl"], spec.get("heads"),
                  spec.get("slots"))
    want = expected_move(dst, src, m)
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
    want = expected_move(dst, src, m)
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


# -- the transport's contract, with scripted libraries (review findings of issue 13) ----------


class Scripted(Transport):
    """A library transport scripted by the test: ``state`` is what poll
    says; an aborted transfer lands only with ``lands``; fail() records the
    views it was given and (a library that does not fail) moves them."""

    name = "scripted"

    def __init__(self, state="DONE", lands=True, **options):
        super().__init__(**options)
        self.state, self.lands = state, lands
        self.pulls, self.failed_pairs = [], []

    def start(self, x):
        self.pulls.append(x.pull)
        if not self.lands:
            return x
        for m in x.moves:
            for d, s in block_views(m):
                d.copy_(s)
        for d, s in x.pairs:
            d.copy_(s)
        return x

    def poll(self, handle):
        return self.state

    def abort(self, handle):
        return True

    def fail(self, x):
        self.failed_pairs.extend(x.pairs)
        for d, s in x.pairs:
            d.copy_(s)
        return super().fail(x)


def one_move(blocks=4):
    src, dst = pools(blocks=blocks)
    return src, dst, Transfer("x", "P0", "D0", True, [BlockMove(dst, [0, 1], src, [2, 3], (0, 3), (0, 3))])


def test_a_transfer_stuck_in_progress_is_a_transport_error_after_the_timeout():
    t = Scripted(state="PROC", timeout=0.05)
    _src, _dst, x = one_move()
    with pytest.raises(TransportError, match=r"transfer 'x' from 'P0' to 'D0': still in progress after 0.05 s"):
        t.run(x)
    assert t.statistics().timeouts == 1
    with pytest.raises(UsageError, match="transport timeout"):
        Scripted(timeout=0)


def test_a_transfer_the_library_cancelled_is_counted_and_not_landed():
    t = Scripted(lands=False, abort_timeout=0.01)
    _src, dst, x = one_move()
    assert t.run(x, aborted=True) is False
    s = t.statistics()
    assert (s.aborts, s.aborts_cancelled, s.aborts_landed, s.aborts_unknown) == (1, 1, 0, 0)
    assert "cancelled by the library" in s.errors[-1] and not dst.view(torch.int16).any()
    landing = Scripted(abort_timeout=0.01)
    assert landing.run(one_move()[2], aborted=True) is True
    assert landing.statistics().aborts_landed == 1


def test_an_abort_whose_target_already_held_the_bytes_is_not_counted_as_landed():
    t = Scripted(lands=False, abort_timeout=0.01)
    src, dst, x = one_move()
    dst[0:2] = src[2:4]  # the target equals the source before the transfer: landing cannot be told
    assert t.run(x, aborted=True) is True
    s = t.statistics()
    assert (s.aborts_unknown, s.aborts_landed, s.aborts_cancelled) == (1, 0, 0)


def test_the_backend_does_not_stamp_a_cancelled_write_as_landed():
    """early-target-reuse: the history aborts x-r1-0; a library that cancels
    it leaves the target as it was, and the backend knows it (no
    kv-corruption from bytes that never landed)."""
    from pdproto.backends import TorchBackend
    from pdproto.spec import open_history

    path = os.path.join(EXAMPLES, "early-target-reuse.jsonl")
    t = Scripted(lands=False, abort_timeout=0.01)
    with open_history(path) as reader:
        b = TorchBackend(reader.header, transport=t)
        for line, ev in reader:
            b.apply(ev, line)
    b.finish()
    x = b._xfers["x-r1-0"]
    assert x.cancelled and x.write_stamp == 0
    assert t.statistics().aborts_cancelled == 1
    assert [(v.invariant, v.line) for v in replay(path, transport=Scripted(lands=False, abort_timeout=0.01)
                                                  ).violations] == [("early-target-reuse", 10)]


def test_replay_policy_reaches_the_transport():
    path = os.path.join(EXAMPLES, "clean-push.jsonl")
    for policy, pull in ((None, False), ("pull", True), ("push", False)):
        t = Scripted()
        replay(path, policy=policy, transport=t)
        assert t.pulls and set(t.pulls) == {pull}, policy


def test_an_injected_failure_never_writes_into_the_target_pool():
    """A library that moves the bytes of a transfer it was to fail: they
    land in a scratch block, not in D's pool."""
    from pdproto.backends import TorchBackend
    from pdproto.spec import open_history

    path = os.path.join(EXAMPLES, "retry-after-failure.jsonl")
    t = Scripted()
    with open_history(path) as reader:
        b = TorchBackend(reader.header, transport=t)
        for line, ev in reader:
            b.apply(ev, line)
    b.finish()
    assert t.failed_pairs
    pools_ = [p for w in b._workers.values() for p in w.pools]
    for d, _s in t.failed_pairs:
        base = d if d._base is None else d._base
        assert all(base.data_ptr() != p.data_ptr() for p in pools_)
    assert ([(v.invariant, v.line) for v in replay(path, transport=Scripted()).violations]
            == [(v.invariant, v.line) for v in replay(path).violations])


def test_transport_error_lives_in_layer_0_and_the_names_are_exported():
    import subprocess

    import pdproto
    import pdproto.backends as backends
    from pdproto import _errors

    assert pdproto.TransportError is _errors.TransportError is backends.TransportError
    for name in ("TRANSPORTS", "Transport", "TransportError", "TransportStatistics", "make_transport"):
        assert name in backends.__all__ and getattr(backends, name) is not None
    assert backends.TRANSPORTS == ("copy", "nixl", "mooncake")
    code = ("import sys; from pdproto.backends import TransportError, TRANSPORTS; "
            "from pdproto.drivers import load_transport; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_transport_choices_are_the_one_table(capsys):
    from pdproto.backends import TRANSPORTS

    for argv in (["replay", os.path.join(EXAMPLES, "clean-push.jsonl")], ["check", "p-frees-source-on-timer"],
                 ["fuzz", "p-frees-source-on-timer"]):
        assert main(argv + ["--transport", "rdma"]) == 2
        assert "choose from " + ", ".join(repr(n) for n in TRANSPORTS) in capsys.readouterr().err


def test_a_factory_closes_the_transport_it_made_and_not_one_given(monkeypatch):
    import pdproto.backends

    closed = []

    class Closing(Scripted):
        def close(self):
            closed.append(self)

    made = Closing()
    monkeypatch.setattr(pdproto.backends, "make_transport", lambda name, **options: made)
    f = torch_backend_factory(transport="nixl")
    assert f.transport is made and f(HistoryHeader()).transport is made
    f.close()
    assert closed == [made]
    given = Closing()
    g = torch_backend_factory(transport=given)
    g.close()
    assert closed == [made]


@pytest.mark.parametrize("argv", [
    ["check", "p-frees-source-on-timer", "--backend", "torch", "--transport", "nixl", "--max-states", "30"],
    ["fuzz", "p-frees-source-on-timer", "--backend", "torch", "--transport", "nixl", "--examples", "2",
     "--seed", "1", "--no-database"],
], ids=["check", "fuzz"])
def test_check_and_fuzz_close_their_transport(argv, monkeypatch, capsys):
    import pdproto.backends

    closed = []

    class Closing(CopyTransport):
        def close(self):
            closed.append(self)

    monkeypatch.setattr(pdproto.backends, "make_transport", lambda name, **options: Closing())
    main(argv + ["--json"])
    capsys.readouterr()
    assert len(closed) == 1
