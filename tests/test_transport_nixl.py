"""The nixl transport (NIXL agents over UCX, host memory): the library's
own signals and faults: pull is a READ by decode and push a WRITE by
prefill, each notified to the peer; an abort releases an active handle, a
restart removes and re-adds the agent.  The verdicts every library
transport shares are in test_transport_libraries.py.  Skipped only without
NIXL."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
try:
    import nixl_cu12._api  # noqa: F401
except ImportError:
    pytest.importorskip("nixl._api")

from conftest import EXAMPLES, delta, verdicts  # noqa: E402

from pdproto import (  # noqa: E402
    Commit,
    Decode,
    Finish,
    Free,
    HistoryHeader,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
    write_history,
)
from pdproto._cli import main  # noqa: E402
from pdproto.backends import NixlTransport  # noqa: E402
from pdproto.backends import BlockMove, Transfer  # noqa: E402
from pdproto.drivers import replay, torch_backend_factory  # noqa: E402


@pytest.fixture(scope="module")
def nixl():
    """One transport (two agents, P0 and D0, made on first use) for the module."""
    t = NixlTransport()
    yield t
    t.close()



# -- the library's signals -------------------------------------------------------------------


def _pools(rows=64, width=256):
    src = torch.randint(0, 255, (rows, 1, 1, 1, 1, width), dtype=torch.uint8)
    return src, torch.zeros_like(src)


@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
def test_pull_is_a_read_by_decode_and_push_a_write_by_prefill(nixl, pull):
    src, dst = _pools()
    x = Transfer("x-dir", "P0", "D0", pull, [BlockMove(dst, [5, 1, 2], src, [0, 9, 10], (0, 1), (0, 1))])
    handle = nixl.start(x)
    assert (handle["init"], handle["peer"]) == (("D0", "P0") if pull else ("P0", "D0"))
    assert nixl.wait(handle) == "DONE"
    assert nixl.notified(handle, 5.0)  # the peer (P on a pull, D on a push) is told by the library
    nixl.finish(handle)
    assert torch.equal(dst[[5, 1, 2]], src[[0, 9, 10]])
    assert not dst[0].any()


def test_abort_releases_an_active_handle_and_the_bytes_land_unnotified():
    """Finding (docs/replay.md): release_xfer_handle on a transfer still in
    progress returns without error, the bytes land all the same, and the
    peer never gets the notification."""
    t = NixlTransport()
    try:
        for attempt, rows in enumerate((1024, 4096, 8192)):  # larger until the release finds it in progress
            src, dst = _pools(rows=rows, width=8192)  # 8 MiB and up, in rows/2 descriptors
            ids = list(range(0, rows, 2))
            t.run(Transfer(f"x-abort{attempt}", f"Pa{attempt}", f"Da{attempt}", True,
                           [BlockMove(dst, ids, src, ids, (0, 1), (0, 1))]), aborted=True)
            s = t.statistics()
            assert s.aborts == attempt + 1 and s.aborts_landed == attempt + 1 and s.aborts_cancelled == 0
            assert torch.equal(dst[ids], src[ids])
            if s.aborts_active:
                break
        else:
            pytest.skip("every transfer finished before its handle was released (no active release to test)")
        assert s.aborts_active == 1  # released while in progress: no notification ever comes
        assert s.aborts_notified == 0
    finally:
        t.close()


def test_aborted_history_transfer_lands_as_the_copy_model_says(nixl):
    """early-target-reuse: D aborts the transfer, frees its target and hands
    the blocks on; the write, released while in flight, lands at the end
    over the next owner's KV (kv-corruption under both transports)."""
    path = os.path.join(EXAMPLES, "early-target-reuse.jsonl")
    before = nixl.statistics()
    assert verdicts(replay(path, transport=nixl)) == verdicts(replay(path))
    d = delta(nixl, before, "aborts", "aborts_landed")
    assert d == {"aborts": 1, "aborts_landed": 1}


def test_restart_removes_and_readds_the_agent(nixl):
    src, dst = _pools()
    x = Transfer("x-restart", "P0", "D0", True, [BlockMove(dst, [3], src, [4], (0, 1), (0, 1))])
    agent, handle, _init, _peer = nixl._handle(x, b"stale")
    nixl.restart("P0")
    # a handle made before the restart names the removed agent: the library refuses to post it
    with pytest.raises(Exception, match="NIXL_ERR"):
        agent.transfer(handle, b"stale")
    nixl.run(x)  # the re-added agent serves new transfers
    assert torch.equal(dst[3], src[4])


def test_restart_history_has_the_same_verdicts(nixl, tmp_path):
    header = HistoryHeader(policy="pull", workers={"P0": WorkerSpec("prefill", 8), "D0": WorkerSpec("decode", 8)})
    events = [
        Submit("r1", 0, prompt_len=6, max_new_tokens=3),
        PrefillStart("r1", 0, "P0", (0, 1)),
        PrefillDone("r1", 0, "P0", first_token=101, processed_len=6),
        Reserve("r1", 0, "t1", "D0", (0, 1)),
        TransferStart("x1", "t1", "r1", 0, "P0", (0, 1), "D0", (0, 1)),
        Restart("P0", 1),
        TransferReadDone("x1"),
        TransferWriteDone("x1"),
        Commit("r1", 0, "t1", "D0"),
        Decode("r1", 0, "D0", 6, 101, 102, (0, 1)),
        Finish("r1", 0),
        Free("D0", (0, 1), "r1", 0),
    ]
    path = str(tmp_path / "restart.jsonl")
    write_history(path, events, header)
    before = nixl.statistics()
    plain, real = replay(path), replay(path, transport=nixl)
    assert verdicts(real) == verdicts(plain)
    assert any(v.invariant == "kv-corruption" for v in plain.violations)  # the read came after the restart
    assert delta(nixl, before, "restarts", "transfers") == {"restarts": 1, "transfers": 1}


def test_a_deregistered_source_is_still_read(nixl):
    """Finding (docs/replay.md): with UCX on host memory, a peer that loaded
    the metadata before the source was deregistered still reads it (DONE,
    the bytes intact): deregistration fences nothing; the protocol must keep
    the source until the read is done."""
    p, d = nixl.agent("P0"), nixl.agent("D0")
    src, dst = _pools(rows=4)
    reg = p.register_memory(p.get_reg_descs([(src.data_ptr(), src.numel(), 0, "")], "DRAM"))
    dreg = d.register_memory(d.get_reg_descs([(dst.data_ptr(), dst.numel(), 0, "")], "DRAM"))
    d.add_remote_agent(p.get_agent_metadata())
    p.deregister_memory(reg)
    h = d.initialize_xfer("READ", d.get_xfer_descs([(dst.data_ptr(), dst.numel(), 0)], "DRAM"),
                          d.get_xfer_descs([(src.data_ptr(), src.numel(), 0)], "DRAM"), nixl._prefix + "P0")
    state = d.transfer(h)
    while state == "PROC":
        state = d.check_xfer_state(h)
    d.release_xfer_handle(h)
    d.deregister_memory(dreg)
    nixl._loaded.pop(("D0", "P0"), None)
    assert state == "DONE" and torch.equal(dst, src)


# -- the CLI and the factories ---------------------------------------------------------------


def test_replay_cli_transport_nixl(capsys):
    import json

    path = os.path.join(EXAMPLES, "clean-pull.jsonl")
    assert main(["replay", "--json", "--transport", "nixl", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["backend"]["transport"] == "nixl"
    ts = out["backend"]["transport_statistics"]
    assert ts["transfers"] > 0 and ts["notifications"] == ts["transfers"]


def test_a_replay_through_nixl_exits_cleanly():
    """The process that loaded NIXL exits 0 (not SIGSEGV in a library's
    destructor at exit): UCX loads no module that brings the system's
    libibverbs and libnl beside the wheel's copies (its EFA module, where
    libefa is installed); a UCX_MODULES of the user's own is kept."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    code = ("import os, sys; from pdproto._cli import main; rc = main(sys.argv[1:]); "
            "print(os.environ['UCX_MODULES']); sys.exit(rc)")
    for extra in ({}, {"UCX_MODULES": "^efa,cma"}):
        p = subprocess.run([sys.executable, "-c", code, "replay", "--transport", "nixl",
                            os.path.join(EXAMPLES, "clean-push.jsonl")],
                           capture_output=True, text=True, env={**env, **extra}, timeout=120)
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
        assert p.stdout.splitlines()[-1] == extra.get("UCX_MODULES", "^efa")


def test_backend_factory_shares_one_transport():
    make = torch_backend_factory(transport="nixl")
    a, b = make(HistoryHeader()), make(HistoryHeader())
    assert a.transport is b.transport and a.transport.name == "nixl"
    assert a.copy().transport is a.transport and make.transport is a.transport
    make.close()  # the factory made it: it closes it
    assert not a.transport._agents


def test_a_lost_peer_refuses_a_prepared_handle(nixl):
    src, dst = _pools(rows=2)
    x = Transfer("x-lost", "P0", "D0", True, [BlockMove(dst, [0], src, [1], (0, 1), (0, 1))])
    agent, handle, _i, _p = nixl._handle(x, b"lost")
    nixl.lose("P0")
    with pytest.raises(Exception, match="NIXL_ERR"):
        agent.transfer(handle, b"lost")
    nixl.run(x)  # reloaded on the next transfer
    assert torch.equal(dst[0], src[1])


@pytest.mark.slow
def test_check_and_fuzz_with_the_nixl_transport_find_the_corruption(capsys):
    import json

    assert main(["check", "p-frees-source-on-timer", "--backend", "torch", "--transport", "nixl", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["backend"]["transport"] == "nixl"
    assert any(v["invariant"] == "kv-corruption" for v in out["violations"])
    assert main(["fuzz", "p-frees-source-on-timer", "--backend", "torch", "--transport", "nixl", "--examples", "30",
                 "--seed", "1", "--no-database", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["ok"]


@pytest.mark.parametrize("name", ["early-source-free", "commit-before-ready", "early-target-reuse", "clean-pull"])
def test_eager_timing_under_nixl_matches_copy(name, nixl):
    """Posted at transfer_start and waited for: the library lands what copy_
    lands, and the race windows close as they do under copy (docs/replay.md)."""
    path = os.path.join(EXAMPLES, name + ".jsonl")
    assert verdicts(replay(path, transport=nixl, timing="eager")) == verdicts(replay(path, timing="eager"))


def test_a_bug_of_pdproto_in_start_is_not_reported_as_the_library_s(nixl, monkeypatch):
    """Only NIXL's own exceptions are a TransportError (the library failed);
    anything else propagates as itself."""
    src, dst = _pools(rows=2)
    x = Transfer("x-bug", "P0", "D0", True, [BlockMove(dst, [0], src, [1], (0, 1), (0, 1))])

    def broken(_x):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(nixl, "descriptors", broken)
    with pytest.raises(ZeroDivisionError):
        nixl.start(x)


def test_late_notifications_are_bounded(nixl, monkeypatch):
    from pdproto.backends import _nixl

    monkeypatch.setattr(_nixl, "_MAX_NOTES", 2)
    src, dst = _pools(rows=8)
    handles = []
    for i in range(4):  # completed, never waited for: their notifications arrive late
        h = nixl.start(Transfer(f"x-late{i}", "P0", "D0", False, [BlockMove(dst, [i], src, [i], (0, 1), (0, 1))]))
        assert nixl.wait(h) == "DONE"
        nixl.finish(h)
        handles.append(h)
    last = nixl.start(Transfer("x-last", "P0", "D0", False, [BlockMove(dst, [5], src, [5], (0, 1), (0, 1))]))
    assert nixl.wait(last) == "DONE" and nixl.notified(last, 5.0)
    nixl.finish(last)
    assert len(nixl._notes["D0"]) <= 2
