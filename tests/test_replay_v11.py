"""Replay of format 1.1 (issue 10): several transfers per ticket, token and
layer ranges (partial blocks), shared prefixes, per-worker TP and PP, MLA,
fp8 with scales; lazy pools, staging reuse, linear verification, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT  # noqa: E402
from test_torch_backend import kv  # noqa: E402
from test_torch_backend import run_backend as run  # noqa: E402

from pdproto import Commit, Decode, Finish, Free, HistoryHeader, PrefillDone, PrefillStart  # noqa: E402
from pdproto import Reserve, Restart, Submit, TransferReadDone, TransferStart, TransferWriteDone  # noqa: E402
from pdproto import WorkerSpec, write_history  # noqa: E402
from pdproto.backends import TorchBackend  # noqa: E402
from pdproto.spec import KVSpec, Share  # noqa: E402


def header(features=(), kv=None, workers=None, version="1.1"):
    workers = workers or {"P0": WorkerSpec("prefill", 16), "D0": WorkerSpec("decode", 16)}
    if version == 1:
        return HistoryHeader(policy="push", workers=workers)
    return HistoryHeader(policy="push", version="1.1", features=frozenset(features), kv=kv, workers=workers)


def prefill(r, prompt, p, first=101, d=None):
    """Submit, reserve ``d`` on D0 (push reserves first), prefill into ``p`` on P0."""
    out = [Submit(r, 0, prompt_len=prompt, max_new_tokens=3)]
    if d is not None:
        out.append(Reserve(r, 0, f"t-{r}", "D0", d))
    return out + [PrefillStart(r, 0, "P0", p), PrefillDone(r, 0, "P0", first_token=first, processed_len=prompt)]


def move(tid, r, p, d, ticket=None, **ranges):
    return [TransferStart(tid, ticket or f"t-{r}", r, 0, "P0", p, "D0", d, **ranges),
            TransferReadDone(tid), TransferWriteDone(tid)]


def tail(r, d, prompt, first=101, n=2, p=None):
    out = [Free("P0", p, r, 0)] if p is not None else []
    out.append(Commit(r, 0, f"t-{r}", "D0"))
    tok = first
    for i in range(n):
        out.append(Decode(r, 0, "D0", prompt + i, tok, tok + 1, d))
        tok += 1
    return out + [Finish(r, 0), Free("D0", d, r, 0)]


# -- several transfers under one ticket (version 1: the held-out case) ---------


def split_handoff(second_dst=(2,)):
    """Prompt 10 (3 blocks of 4) moved by two transfers under one ticket."""
    return (prefill("r1", 10, (0, 1, 2), d=(0, 1, 2))
            + move("x1", "r1", (0, 1), (0, 1)) + move("x2", "r1", (2,), second_dst)
            + tail("r1", (0, 1, 2), 10, p=(0, 1, 2)))


def test_v1_two_transfers_under_one_ticket_replay_clean():
    monitor, backend = run(split_handoff(), header(version=1))
    assert monitor.ok, monitor.violations
    assert backend.ok, backend.violations
    assert backend.bytes_copied == 3 * backend.layout.block_bytes


def test_v1_second_transfer_into_the_wrong_block_is_caught_at_commit():
    events = split_handoff(second_dst=(1,))  # overwrites positions 4..7 with 8..11
    _, backend = run(events, header(version=1))
    v = kv(backend)[0]
    assert v.line == events.index(Commit("r1", 0, "t-r1", "D0")) + 2
    assert v.block == 1 and v.position == 4 and v.found["request"] == "r1"


# -- token ranges: chunked transfers, partial blocks -------------------------


KV2 = KVSpec(layers=2, block_size=4)


def chunked(second=(6, 10), src2=(1, 2)):
    """Prompt 10: chunk a moves positions 0..5 (block 1 half), chunk b 6..9."""
    return (prefill("r1", 10, (0, 1, 2), d=(4, 5, 6))
            + move("a", "r1", (0, 1), (4, 5), tokens=(0, 6))
            + move("b", "r1", src2, (5, 6), tokens=second)
            + tail("r1", (4, 5, 6), 10, p=(0, 1, 2)))


def test_chunked_transfers_with_partial_blocks_replay_clean():
    monitor, backend = run(chunked(), header({"ranges", "kv"}, KV2))
    assert monitor.ok and backend.ok, (monitor.violations, backend.violations)
    # only the slots of the ranges moved: 10 positions, not 4 whole blocks
    assert backend.bytes_copied == 10 * backend.layout.block_bytes // 4


def test_a_chunk_moves_only_its_slots():
    events = prefill("r1", 10, (0, 1, 2), d=(4, 5, 6)) + move(
        "a", "r1", (0, 1), (4, 5), tokens=(0, 6))
    _, backend = run(events, header({"ranges", "kv"}, KV2))
    pool = backend.pool("D0")
    assert not torch.isnan(pool[5, :2].float()).any()  # positions 4, 5 landed
    assert torch.isnan(pool[5, 2:].float()).all()  # positions 6, 7 did not move


def test_a_chunk_read_from_the_wrong_blocks_is_caught():
    events = chunked(src2=(1, 1))  # positions 8, 9 read from the block of 4..7
    _, backend = run(events, header({"ranges", "kv"}, KV2))
    v = kv(backend)[0]
    assert v.position == 8 and v.transfer == "b" and v.found["position_mod"] == 4


def test_commit_after_the_first_chunk_is_caught_when_decode_reads():
    events = (prefill("r1", 10, (0, 1, 2), d=(4, 5, 6))
              + move("a", "r1", (0, 1), (4, 5), tokens=(0, 6)) + [Commit("r1", 0, "t-r1", "D0"),
                                                                   Decode("r1", 0, "D0", 10, 101, 102, (4, 5, 6))])
    monitor, backend = run(events, header({"ranges", "kv"}, KV2))
    assert "commit-before-ready" in {v.invariant for v in monitor.violations}
    (v, *_) = kv(backend)
    # commit verifies what landed (clean); the decode reads position 6, never moved
    assert v.line == len(events) + 1 and v.position == 6 and v.found == "poison"


# -- layer ranges ------------------------------------------------------------


def test_layerwise_transfers_replay_clean_and_a_missing_layer_is_caught():
    base = prefill("r1", 6, (0, 1), d=(2, 3))
    both = base + move("l0", "r1", (0, 1), (2, 3), layers=(0, 1)) + move("l1", "r1", (0, 1), (2, 3), layers=(1, 2))
    monitor, backend = run(both + tail("r1", (2, 3), 6, p=(0, 1)), header({"ranges", "kv"}, KV2))
    assert monitor.ok and backend.ok, (monitor.violations, backend.violations)
    one = base + move("l0", "r1", (0, 1), (2, 3), layers=(0, 1)) + tail("r1", (2, 3), 6, p=(0, 1))
    _, backend = run(one, header({"ranges", "kv"}, KV2))
    v = kv(backend)[0]
    assert v.layer == 1 and v.position == 0 and v.found == "poison"


# -- shared prefixes ---------------------------------------------------------


def shared_prefix(extra=()):
    """r1 computes an 8-token prompt in P blocks 0, 1; r2 (prompt 12) shares
    block 0 (tokens 0..3) and prefills 4..11 into its own blocks 2, 3."""
    r1 = prefill("r1", 8, (0, 1), first=50, d=(0, 1, 2)) + move("x1", "r1", (0, 1), (0, 1)) + [
        Commit("r1", 0, "t-r1", "D0")]
    r2 = [Submit("r2", 0, prompt_len=12, max_new_tokens=3), Reserve("r2", 0, "t-r2", "D0", (4, 5, 6, 7)),
          Share("r2", 0, "P0", (0,), 4), PrefillStart("r2", 0, "P0", (2, 3))] + list(extra) + [
          PrefillDone("r2", 0, "P0", first_token=70, processed_len=8)] + move("x2", "r2", (0, 2, 3), (4, 5, 6))
    return r1, r2 + tail("r2", (4, 5, 6, 7), 12, first=70, p=(0, 2, 3))


def test_shared_prefix_replays_clean():
    r1, r2 = shared_prefix()
    monitor, backend = run(r1 + r2 + tail("r1", (0, 1, 2), 8, first=50)[1:] + [Free("P0", (0, 1), "r1", 0)],
                           header({"share", "kv"}, KVSpec(block_size=4)))
    assert monitor.ok and backend.ok, (monitor.violations, backend.violations)
    # r2's positions 0..3 hold r1's KV (the origin of the shared prefix), on P and on D
    r1, r2 = backend._gens[("r1", 0)], backend._gens[("r2", 0)]
    assert r2.orig == {"P0": {p: r1.tag for p in range(4)}, "D0": {p: r1.tag for p in range(4)}}


def test_shared_prefix_freed_and_overwritten_is_caught():
    r1, _ = shared_prefix()
    # r1's abort frees the shared block entirely (no request named: every reference)
    # and r3 reuses it before r2's transfer reads it
    _, r2 = shared_prefix(extra=[Free("P0", (0,)), Submit("r3", 0, prompt_len=4),
                                 Reserve("r3", 0, "t-r3", "D0", (9,)), PrefillStart("r3", 0, "P0", (0,)),
                                 PrefillDone("r3", 0, "P0", first_token=9, processed_len=4)])
    monitor, backend = run(r1 + r2, header({"share", "kv"}, KVSpec(block_size=4)))
    assert monitor.violations
    v = kv(backend)[0]
    assert v.request == "r2" and v.position == 0 and v.found["request"] == "r3"
    assert "shared prompt KV computed by request 'r1'" in v.message


def test_a_transfer_into_a_shared_block_is_caught_when_its_owner_reads():
    # r2 shares r1's D block 0 (a prefix hit on D) and its transfer writes into it
    r1 = prefill("r1", 8, (0, 1), first=50, d=(0, 1, 2)) + move("x1", "r1", (0, 1), (0, 1)) + [
        Commit("r1", 0, "t-r1", "D0")]
    r2 = [Submit("r2", 0, prompt_len=8), Share("r2", 0, "D0", (0,), 4), Reserve("r2", 0, "t-r2", "D0", (5,)),
          PrefillStart("r2", 0, "P0", (2, 3)), PrefillDone("r2", 0, "P0", first_token=70, processed_len=8)] + move(
        "x2", "r2", (3, 2), (0, 5))  # block 3 (positions 4..7) lands in the shared block
    events = r1 + r2 + [Decode("r1", 0, "D0", 8, 50, 51, (0, 1, 2))]
    monitor, backend = run(events, header({"share", "kv"}, KVSpec(block_size=4)))
    assert "foreign-block-access" in {v.invariant for v in monitor.violations}
    v = kv(backend)[0]
    assert v.request == "r1" and v.line == len(events) + 1 and v.found["request"] == "r2"


def test_a_free_but_cached_prefix_is_revived_by_a_share():
    r1 = prefill("r1", 4, (0,), first=50, d=(5,)) + [Free("P0", (0,), "r1", 0)]
    r2 = [Submit("r2", 0, prompt_len=8), Reserve("r2", 0, "t-r2", "D0", (2, 3)), Share("r2", 0, "P0", (0,), 4),
          PrefillStart("r2", 0, "P0", (1,)), PrefillDone("r2", 0, "P0", first_token=70, processed_len=4)] + move(
        "x2", "r2", (0, 1), (2, 3))
    hdr = header({"share", "kv"}, KVSpec(block_size=4))
    _, backend = run(r1 + r2 + [Commit("r2", 0, "t-r2", "D0")], hdr)
    assert backend.ok, backend.violations
    # the cache is gone between the free and the share (a restart): the hit reads poison
    _, backend = run(r1 + [Restart("P0", 1)] + r2 + [Commit("r2", 0, "t-r2", "D0")], hdr)
    v = kv(backend)[0]
    assert v.request == "r2" and v.position == 0 and v.found == "poison"


# -- per-worker TP, PP, MLA ----------------------------------------------------


def plain(prompt=6, p=(0, 1), d=(0, 1)):
    return prefill("r1", prompt, p, d=d) + move("x", "r1", p, d) + tail("r1", d, prompt, p=p)


PAR = {"P0": WorkerSpec("prefill", 16, tp=2, pp=2), "D0": WorkerSpec("decode", 16, tp=4)}


def test_per_worker_tp_and_pp_replay_clean():
    _, backend = run(plain(), header({"parallel"}, workers=PAR), kv_heads=4)
    assert backend.ok, backend.violations
    p, d = backend._workers["P0"], backend._workers["D0"]
    assert (p.tp, p.pp, len(p.pools)) == (2, 2, 4) and (d.tp, d.pp, len(d.pools)) == (4, 1, 4)
    assert p.pools[0].shape[2] == 1 and d.pools[0].shape[2] == 2  # a stage holds half the layers
    assert d.pools[3].shape[4] == 1  # one head per D rank


def test_the_tp_flag_overrides_the_header():
    _, backend = run(plain(), header({"parallel"}, workers=PAR), kv_heads=4, tp=(1, 2))
    assert backend.ok and backend._workers["P0"].tp == 1 and backend._workers["D0"].tp == 2
    assert backend._workers["P0"].pp == 2  # no pp flag: the header's


def test_misrouted_heads_across_stages_are_caught():
    _, backend = run(plain(), header({"parallel"}, workers=PAR), kv_heads=4, head_map=[1, 0, 2, 3])
    v = kv(backend)[0]
    assert v.head in (0, 1) and v.found["head"] != v.head


def test_a_layer_range_across_pipeline_stages():
    events = (prefill("r1", 3, (0,), d=(0,)) + move("x", "r1", (0,), (0,), layers=(0, 1))
              + tail("r1", (0,), 3, n=1, p=(0,)))
    workers = {"P0": WorkerSpec("prefill", 16, pp=2), "D0": WorkerSpec("decode", 16, pp=2)}
    _, backend = run(events, header({"parallel", "ranges", "kv"}, KV2, workers))
    v = kv(backend)[0]
    assert v.layer == 1 and v.rank == 1 and v.found == "poison"  # stage 1 of D never got layer 1


def test_mla_latent_replicated_on_every_rank():
    hdr = header({"kv", "parallel"}, KVSpec(layers=2, head_dim=8, block_size=4, layout="mla"),
                 {"P0": WorkerSpec("prefill", 16), "D0": WorkerSpec("decode", 16, tp=2)})
    _, backend = run(plain(), hdr)
    assert backend.ok and backend.layout.layout == "mla"
    events = plain()
    _, backend = run(events[: events.index(Commit("r1", 0, "t-r1", "D0")) + 1], hdr)
    d = backend._workers["D0"]
    assert len(d.pools) == 2 and d.pools[0].shape[3:5] == (1, 1)  # no K/V pair, no heads
    landed = d.pools[0][:2, :].view(torch.int16)
    assert torch.equal(landed, d.pools[1][:2].view(torch.int16))  # the latent replicated
    assert not torch.isnan(d.pools[0][:2, :2].float()).any()
    # an early source free under MLA: poison at the commit
    events = plain()
    events.insert(events.index(TransferReadDone("x")), Free("P0", (0, 1), "r1", 0))
    _, backend = run(events, hdr)
    assert kv(backend)[0].found == "poison"


# -- fp8 with scales ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scale", ["per-block", "per-tensor", "per-head"])
def test_fp8_replays_clean(dtype, scale):
    hdr = header({"kv"}, KVSpec(layers=2, kv_heads=4, head_dim=8, block_size=4, dtype=dtype, scale=scale))
    _, backend = run(plain(), hdr)
    assert backend.ok, backend.violations
    assert backend.pool("D0").dtype == getattr(torch, dtype)


def test_fp8_per_block_scales_travel_with_their_blocks():
    hdr = header({"kv"}, KVSpec(layers=2, block_size=4, dtype="float8_e4m3fn", scale="per-block"))
    events = plain()
    _, backend = run(events[: events.index(TransferWriteDone("x")) + 1], hdr)
    d, p = backend._workers["D0"].scales[0][:2], backend._workers["P0"].scales[0][:2]
    assert not torch.isnan(d).any() and torch.equal(d, p)
    _, backend = run(plain(), hdr, drop_scales=True)  # a transfer that forgets the scales
    v = kv(backend)[0]
    assert v.line == plain().index(Commit("r1", 0, "t-r1", "D0")) + 2
    assert "per-block scale is missing" in v.message


def test_fp8_a_scale_copied_to_the_wrong_layer_or_block_is_caught():
    """Per-block scales differ between neighbouring blocks, layers and K/V
    (powers of two), so a transfer that puts one block's or layer's scale on
    another reads back wrong values, even within one generation."""
    hdr = header({"kv"}, KVSpec(layers=2, block_size=4, dtype="float8_e4m3fn", scale="per-block"))
    events = plain()
    cut = events.index(TransferWriteDone("x")) + 1
    for swap in ("layers", "blocks"):
        backend = TorchBackend(hdr)
        for i, ev in enumerate(events[:cut]):
            backend.apply(ev, i + 2)
        sc = backend._workers["D0"].scales[0]
        assert not torch.equal(sc[0, :, 0], sc[0, :, 1]) and not torch.equal(sc[0], sc[1])
        if swap == "layers":
            sc[0] = sc[0].flip(1)  # block 0's scales of layer 0 and layer 1 exchanged
        else:
            sc[[0, 1]] = sc[[1, 0]]  # blocks 0 and 1 exchanged their scales
        for i, ev in enumerate(events[cut:], start=cut):
            backend.apply(ev, i + 2)
        backend.finish()
        found = kv(backend)
        assert found and found[0].line == events.index(Commit("r1", 0, "t-r1", "D0")) + 2, swap


def test_fp8_static_scales_must_match_between_p_and_d():
    hdr = header({"kv"}, KVSpec(layers=2, block_size=4, dtype="float8_e4m3fn", scale="per-tensor"))
    _, backend = run(plain(), hdr, static_scales={"D0": 2.0})
    v = kv(backend)[0]
    assert v.worker == "D0" and v.position == 0 and v.found["request"] == "r1"
    assert "read with scale 2 instead of the 1 it was written with" in v.message


def test_fp8_still_says_whose_kv_a_wrong_slot_holds():
    hdr = header({"kv"}, KVSpec(layers=2, block_size=4, dtype="float8_e4m3fn", scale="per-tensor"))
    events = prefill("r1", 8, (0, 1), d=(0, 1)) + [TransferStart(
        "x", "t-r1", "r1", 0, "P0", (0, 1), "D0", (0, 1)), Free("P0", (0, 1), "r1", 0)] + prefill(
        "r2", 8, (0, 1), first=5, d=(4, 5)) + [TransferReadDone("x"), TransferWriteDone("x"),
                                                 Commit("r1", 0, "t-r1", "D0")]
    _, backend = run(events, hdr)
    v = kv(backend)[0]
    assert v.found["request"] == "r2"


# -- memory, staging, linear verification, --json ---------------------------


def test_declared_pools_are_not_allocated_up_front():
    big = {"P0": WorkerSpec("prefill", 4096), "D0": WorkerSpec("decode", 4096)}
    backend = TorchBackend(header(workers=big), layers=8, kv_heads=8, head_dim=128, block_size=16)
    full = 2 * 4096 * backend.layout.block_bytes  # 8.6 GB at this layout
    for i, ev in enumerate(plain(), 2):
        backend.apply(ev, i)
    assert backend.ok and backend.memory < full // 100
    assert backend._workers["D0"].nblocks == 8


def test_the_staged_path_reuses_its_buffer():
    backend = TorchBackend(header())
    ptrs = []
    for k in range(3):
        r, p, d = f"r{k}", (2 * k, 2 * k + 1), (2 * k, 2 * k + 1)
        events = prefill(r, 8, p, d=d) + [TransferStart(
            "x", f"t-{r}", r, 0, "P0", p, "D0", d), TransferReadDone("x"), Free("P0", p, r, 0),
            TransferWriteDone("x"), Commit(r, 0, f"t-{r}", "D0")]
        for ev in events:
            backend.apply(ev)
        (buf,) = [b for bufs in backend._staging.values() for b in bufs]
        ptrs.append(buf.data_ptr())
    assert backend.ok and len(set(ptrs)) == 1


def test_verification_is_linear_in_the_kv_written():
    prompt, steps = 64, 400
    table = tuple(range((prompt + steps) // 4 + 1))
    events = prefill("r1", prompt, table[: prompt // 4], d=table) + move(
        "x", "r1", table[: prompt // 4], table[: prompt // 4]) + [Commit("r1", 0, "t-r1", "D0")]
    tok = 101
    for i in range(steps):
        events.append(Decode("r1", 0, "D0", prompt + i, tok, tok + 1, table))
        tok += 1
    _, backend = run(events, header(workers={"P0": WorkerSpec("prefill", 200), "D0": WorkerSpec("decode", 200)}))
    assert backend.ok
    per_position = backend.layout.block_bytes // backend.layout.block_size
    # each position is verified a bounded number of times, not once per later decode
    assert backend.bytes_verified <= 3 * (prompt + steps) * per_position


@pytest.mark.parametrize("grow", [False, True], ids=["same-table", "table-extended"])
def test_a_block_modified_long_after_it_was_verified_is_found(grow):
    """Decodes re-check only blocks modified since their last check (the
    worker's modification log): another request's transfer landing in block
    3 of a long table, after 20 decodes verified it, is found at the next
    decode, also when the table grew in between."""
    prompt = 64
    table = tuple(range(prompt // 4 + 6))
    events = prefill("r1", prompt, table[: prompt // 4], d=table) + move(
        "x", "r1", table[: prompt // 4], table[: prompt // 4]) + [Commit("r1", 0, "t-r1", "D0")]
    tok = 101
    for i in range(20):
        events.append(Decode("r1", 0, "D0", prompt + i, tok, tok + 1, table))
        tok += 1
    if grow:  # the next decodes name a longer table (as after an alloc)
        table = table + (40,)
    events += prefill("r2", 4, (30,), d=(50,)) + move("y", "r2", (30,), (3,), ticket="t-r2")
    events.append(Decode("r1", 0, "D0", prompt + 20, tok, tok + 1, table))
    _, backend = run(events, header(workers={"P0": WorkerSpec("prefill", 64), "D0": WorkerSpec("decode", 64)}))
    bad = kv(backend)
    assert bad and bad[0].line == len(events) + 1 and bad[0].block == 3 and 12 <= bad[0].position < 16
    assert bad[0].found["request"] == "r2"


@pytest.mark.parametrize("events", [plain(), plain()[:-5]], ids=["clean", "violation"])
def test_replay_json_prints_exactly_one_object(tmp_path, events):
    path = tmp_path / "h.jsonl"
    write_history(path, events, header(version=1))
    proc = subprocess.run([sys.executable, "-m", "pdproto", "replay", "--json", "--complete", str(path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stderr == ""
    out = json.loads(lines[0])
    assert out["ok"] is (events == plain()) and proc.returncode == (0 if out["ok"] else 1)


def test_rows_computed_by_python_and_by_torch_agree():
    backend = TorchBackend(header(), head_dim=128)
    codes = [0] * 5 + [7, 12345]
    narrow = torch.cat([backend._rows([3], p, [c]) for p, c in enumerate(codes)])
    assert torch.equal(narrow, backend._rows_wide([3], 0, codes))
    # several tags, one code, positions past 2**32 and token codes near 2**32
    start, tags, codes = 2**40 - 3, [5, 300, 70_000, 1, 2, 3, 4], [2**32 - 1, 0, 5, 2**32 - 2, 9, 9, 0]
    narrow = torch.cat([backend._rows([t], start + p, [c]) for p, (t, c) in enumerate(zip(tags, codes))])
    assert torch.equal(narrow, backend._rows_wide(tags, start, codes))
    narrow = torch.cat([backend._rows([9], start + p, [4]) for p in range(7)])
    assert torch.equal(narrow, backend._rows_wide([9], start, [4] * 7))
