"""The torch replay backend and ``pdproto replay``: clean histories replay
clean, protocol bugs show up as kv-corruption, TP layouts, CUDA semantics."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import EXAMPLES, ROOT  # noqa: E402

from pdproto import (  # noqa: E402
    Alloc,
    Cancel,
    Commit,
    Decode,
    Finish,
    Free,
    HistoryHeader,
    Monitor,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
    write_history,
)
from pdproto._cli import main  # noqa: E402
from pdproto.backends import KVCorruption, TorchBackend, rank_heads  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
EXAMPLE_FILES = sorted(glob.glob(os.path.join(EXAMPLES, "*.jsonl")))

PUSH = HistoryHeader(policy="push", workers={"P0": WorkerSpec("prefill", 8), "D0": WorkerSpec("decode", 8)})
PULL = HistoryHeader(policy="pull", workers={"P0": WorkerSpec("prefill", 8), "D0": WorkerSpec("decode", 8)})


# -- helpers -----------------------------------------------------------------


def handoff(r="r1", gen=0, p=(0, 1), d=(0, 1), first=101, prompt=6, tid=None, ticket=None):
    """The events of one clean push handoff up to the commit."""
    tid = tid or f"x-{r}-{gen}"
    ticket = ticket or f"t-{r}-{gen}"
    return [
        Submit(r, gen, prompt_len=prompt, max_new_tokens=3),
        Reserve(r, gen, ticket, "D0", d),
        PrefillStart(r, gen, "P0", p),
        PrefillDone(r, gen, "P0", first_token=first, processed_len=prompt),
        TransferStart(tid, ticket, r, gen, "P0", p, "D0", d),
        TransferReadDone(tid),
        TransferWriteDone(tid),
        Free("P0", p, r, gen),
        Commit(r, gen, ticket, "D0"),
    ]


def decodes(r="r1", gen=0, d=(0, 1), first=101, prompt=6, n=2):
    out, tok = [], first
    for i in range(n):
        out.append(Decode(r, gen, "D0", prompt + i, tok, tok + 1, d))
        tok += 1
    return out + [Finish(r, gen), Free("D0", d, r, gen)]


def run_backend(events, header=PUSH, **kw):
    """Monitor and backend over ``events`` (lines numbered from 2, after the header)."""
    backend = TorchBackend(header, **kw)
    monitor = Monitor.from_header(header)
    for i, ev in enumerate(events):
        monitor.feed(ev, i + 2)
        backend.apply(ev, i + 2)
    monitor.finish()
    backend.finish()
    return monitor, backend


def kv(backend):
    return [v for v in backend.violations if v.invariant == "kv-corruption"]


def replay_json(path, *extra, capsys):
    code = main(["replay", "--json", *extra, str(path)])
    out = json.loads(capsys.readouterr().out)
    return code, out


# -- clean histories ---------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=os.path.basename)
def test_examples_replay_as_documented(path, capsys):
    """Every example replays to the monitor's verdict (its header's
    ``expect``) plus exactly the kv-corruption its ``replay_expect`` lists
    (none when the key is missing)."""
    with open(path, encoding="utf-8") as fh:
        header = json.loads(fh.readline())
    expect = header["expect"]
    want = sorted(v["line"] for v in header.get("replay_expect", []) if v["invariant"] == "kv-corruption")
    code, out = replay_json(path, capsys=capsys)
    data = sorted(v["line"] for v in out["violations"] if v["invariant"] == "kv-corruption")
    protocol = [(v["invariant"], v["line"]) for v in out["violations"] if v["invariant"] != "kv-corruption"]
    assert data == want, [v["message"] for v in out["violations"] if v["invariant"] == "kv-corruption"]
    assert sorted(protocol) == sorted((v["invariant"], v["line"]) for v in expect)
    assert code == (0 if not expect and not want else 1) and out["ok"] is (not expect and not want)
    assert set(out) >= {"ok", "events", "violations"}
    for v in out["violations"]:
        assert set(v) >= {"invariant", "line", "message", "witness"}


@pytest.mark.parametrize(
    "name", ["early-source-free", "early-target-reuse", "commit-before-ready", "first-token-boundary"]
)
def test_buggy_examples_show_kv_corruption(name, capsys):
    code, out = replay_json(os.path.join(EXAMPLES, name + ".jsonl"), capsys=capsys)
    assert code == 1
    assert any(v["invariant"] == "kv-corruption" for v in out["violations"])
    assert any(v["invariant"] == name for v in out["violations"])
    lines = [v["line"] for v in out["violations"]]
    assert lines == sorted(lines)


def test_clean_push_and_pull_handwritten():
    events = handoff() + decodes()
    monitor, backend = run_backend(events)
    assert monitor.ok and backend.ok and backend.bytes_copied > 0
    pull = [
        Submit("r1", 0, prompt_len=6, max_new_tokens=3),
        PrefillStart("r1", 0, "P0", (2, 3)),
        PrefillDone("r1", 0, "P0", first_token=7, processed_len=6),
        Reserve("r1", 0, "t", "D0", (5, 4)),
        TransferStart("x", "t", "r1", 0, "P0", (2, 3), "D0", (5, 4)),
        TransferReadDone("x"),
        Free("P0", (2, 3), "r1", 0),
        TransferWriteDone("x"),
        Commit("r1", 0, "t", "D0"),
        Decode("r1", 0, "D0", 6, 7, 8, (5, 4)),
        Decode("r1", 0, "D0", 7, 8, 9, (5, 4)),
        Finish("r1", 0),
        Free("D0", (5, 4), "r1", 0),
    ]
    monitor, backend = run_backend(pull, PULL)
    assert monitor.ok and backend.ok


def test_statistics_count_the_data_work_with_the_given_clock():
    """statistics(): bytes of each kind of data work (one handoff of 6
    positions in 2 blocks, two decodes) and seconds from the clock given."""
    ticks = iter(range(10**6))
    monitor, backend = run_backend(handoff() + decodes(), clock=lambda: float(next(ticks)))
    st = backend.statistics()
    pos = backend.layout.block_bytes // backend.layout.block_size
    assert monitor.ok and backend.ok
    assert st.write_bytes == (6 + 2) * pos  # prefill's 6 positions, one per decode
    assert st.copy_bytes == backend.bytes_copied == 2 * backend.layout.block_bytes
    assert st.verify_bytes == backend.bytes_verified >= (6 + 2) * pos
    assert st.poison_bytes == 4 * backend.layout.block_bytes  # the frees on P and D
    assert st.write_seconds > 0 and st.copy_seconds > 0 and st.verify_seconds > 0 and st.poison_seconds > 0
    assert st.verify_bytes_per_s == st.verify_bytes / st.verify_seconds
    twin = backend.copy()
    twin.apply(Submit("r2", 0, prompt_len=4, max_new_tokens=1), 99)
    assert twin.statistics() == st and backend.statistics() == st


def test_source_freed_after_read_done_and_reused_is_fine():
    # the read is over at read_done: a reuse afterwards must not change what lands
    events = handoff()[:6] + [
        Free("P0", (0, 1), "r1", 0),
        Submit("r2", 0, prompt_len=4),
        Reserve("r2", 0, "t2", "D0", (4,)),
        PrefillStart("r2", 0, "P0", (0, 1)),
        PrefillDone("r2", 0, "P0", first_token=5, processed_len=4),
        TransferWriteDone("x-r1-0"),
        Commit("r1", 0, "t-r1-0", "D0"),
    ] + decodes()
    monitor, backend = run_backend(events)
    assert monitor.ok or {v.invariant for v in monitor.violations} <= {"stuck"}
    assert backend.ok


# -- protocol bugs become visible as kv-corruption ---------------------------


def test_early_source_free_and_reuse_copies_another_requests_kv():
    events = handoff()[:5] + [
        Free("P0", (0, 1), "r1", 0),  # early: the transfer has not read yet
        Submit("r2", 0, prompt_len=8),
        Reserve("r2", 0, "t2", "D0", (4, 5)),
        PrefillStart("r2", 0, "P0", (0, 1)),
        PrefillDone("r2", 0, "P0", first_token=5, processed_len=8),
        TransferReadDone("x-r1-0"),  # reads r2's KV
        TransferWriteDone("x-r1-0"),
        Commit("r1", 0, "t-r1-0", "D0"),
        Decode("r1", 0, "D0", 6, 101, 102, (0, 1)),
    ]
    monitor, backend = run_backend(events)
    assert "early-source-free" in {v.invariant for v in monitor.violations}
    (v, *_) = kv(backend)
    assert isinstance(v, KVCorruption)
    assert v.line == 14 and v.request == "r1" and v.gen == 0 and v.worker == "D0"
    assert v.block == 0 and v.position == 0 and v.layer == 0
    assert v.found["request"] == "r2" and v.found["gen"] == 0
    assert "request 'r2' gen 0" in v.message
    d = v.to_dict()
    assert d["invariant"] == "kv-corruption" and d["position"] == 0 and d["layer"] == 0


def test_early_source_free_without_reuse_copies_poison():
    events = handoff()[:5] + [Free("P0", (0, 1), "r1", 0)] + handoff()[5:7] + [Commit("r1", 0, "t-r1-0", "D0")]
    _, backend = run_backend(events)
    (v,) = kv(backend)
    assert v.found == "poison" and v.line == 10


def test_early_target_reuse_overwrites_the_next_owner():
    events = handoff()[:6] + [
        Cancel("r1", 0),
        Free("D0", (0, 1), "r1", 0),  # early: the write is still in flight
        Free("P0", (0, 1), "r1", 0),
    ] + handoff("r2", p=(2, 3), d=(0, 1), first=55) + [
        TransferWriteDone("x-r1-0"),  # r1's late write lands in r2's blocks
        Decode("r2", 0, "D0", 6, 55, 56, (0, 1)),
    ]
    monitor, backend = run_backend(events)
    assert "early-target-reuse" in {v.invariant for v in monitor.violations}
    (v, *_) = kv(backend)
    assert v.request == "r2" and v.found["request"] == "r1" and v.line == len(events) + 1


def test_early_target_free_at_end_of_history_is_probed():
    events = handoff()[:6] + [Cancel("r1", 0), Free("D0", (0, 1), "r1", 0)]
    _, backend = run_backend(events)
    (v,) = kv(backend)
    assert v.transfer == "x-r1-0" and "probe" in v.message


def test_commit_before_write_landed():
    events = handoff()[:6] + [Commit("r1", 0, "t-r1-0", "D0"), Decode("r1", 0, "D0", 6, 101, 102, (0, 1))]
    monitor, backend = run_backend(events)
    assert "commit-before-ready" in {v.invariant for v in monitor.violations}
    v = kv(backend)[0]
    assert v.line == 8 and v.found == "poison"


def test_commit_after_failed_transfer():
    events = handoff()[:6] + [TransferFailed("x-r1-0"), Commit("r1", 0, "t-r1-0", "D0")]
    _, backend = run_backend(events)
    assert kv(backend) and kv(backend)[0].line == 9


def test_first_token_boundary_crossed():
    # decode at prompt_len - 1 overwrites the last prompt position
    events = handoff() + [Decode("r1", 0, "D0", 5, 55, 101, (0, 1)), Finish("r1", 0)]
    _, backend = run_backend(events)
    (v,) = kv(backend)
    assert v.position == 5 and v.line == 12 and "another input token" in v.message


def test_first_decode_fed_the_wrong_token():
    # mutant: the last prompt token fed at prompt_len instead of the first token
    events = handoff() + [Decode("r1", 0, "D0", 6, 55, 102, (0, 1)), Decode("r1", 0, "D0", 7, 102, 103, (0, 1))]
    _, backend = run_backend(events)
    (v,) = kv(backend)
    assert v.position == 6 and v.line == 12


def test_decode_skipping_a_position_reads_unwritten_kv():
    events = handoff() + [Decode("r1", 0, "D0", 7, 101, 102, (0, 1))]
    _, backend = run_backend(events)
    assert kv(backend)[0].position == 6


def test_restart_poisons_the_pool():
    events = handoff() + [Restart("D0", 1), Decode("r1", 0, "D0", 6, 101, 102, (0, 1))]
    _, backend = run_backend(events)
    assert kv(backend)[0].found == "poison"


def test_clean_restart_and_retry_stays_clean():
    events = handoff()[:5] + [
        Restart("P0", 1),
        TransferFailed("x-r1-0"),
        Cancel("r1", 0),
        Free("D0", (0, 1), "r1", 0),
    ] + handoff("r1", 1, p=(0, 1), d=(0, 1), tid="x2", ticket="t2") + decodes("r1", 1)
    monitor, backend = run_backend(events)
    assert backend.ok, backend.violations


# -- tensor parallelism --------------------------------------------------------


def test_rank_heads():
    assert rank_heads(2, 4) == [[0, 1], [2, 3]]
    assert rank_heads(4, 2) == [[0], [0], [1], [1]]
    assert rank_heads(1, 2) == [[0, 1]]
    from pdproto import UsageError

    with pytest.raises(UsageError):
        rank_heads(3, 4)


@pytest.mark.parametrize("tp,heads", [((2, 1), 2), ((1, 4), 2), ((2, 4), 4), ((4, 2), 4), ((1, 8), 2), ((8, 1), 8)])
def test_tp_mismatch_clean(tp, heads):
    events = handoff() + decodes()[:1]
    monitor, backend = run_backend(events, tp=tp, kv_heads=heads)
    assert backend.ok, backend.violations
    d = backend._workers["D0"]
    assert d.tp == tp[1] and len(d.pools) == tp[1]
    # each D rank holds exactly its heads of the prompt
    for r in range(tp[1]):
        pool = backend.pool("D0", r)
        for pos in (0, 5):
            exp = backend.expected("r1", 0, pos)[:, :, d.heads[r]]
            assert torch.equal(pool[pos // 4, pos % 4], exp)


@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 4)])
def test_wrong_head_map_is_caught(tp):
    events = handoff() + decodes()[:1]
    _, backend = run_backend(events, tp=tp, kv_heads=2, head_map=[1, 0])
    v = kv(backend)[0]
    assert v.line == 10  # the commit
    assert v.found["request"] == "r1" and v.found["head"] != v.head


def test_replay_cli_tp(tmp_path, capsys):
    path = tmp_path / "h.jsonl"
    write_history(path, handoff() + decodes(), PUSH)
    for tp in ("2:1", "1:4"):
        code, out = replay_json(path, "--tp", tp, "--kv-heads", "2", capsys=capsys)
        assert code == 0 and out["ok"] and out["backend"]["tp"] == [int(x) for x in tp.split(":")]
    assert main(["replay", "--tp", "3:1", str(path)]) == 2
    assert main(["replay", "--tp", "x", str(path)]) == 2


# -- dtypes, pool growth, fuzzed clean runs ----------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_dtypes(dtype):
    _, backend = run_backend(handoff() + decodes(), dtype=dtype)
    assert backend.ok and backend.pool("D0").dtype == getattr(torch, dtype)


def test_pools_grow_without_declared_workers():
    events = handoff(p=(40, 41), d=(100, 3)) + decodes(d=(100, 3))
    _, backend = run_backend(events, HistoryHeader(policy="push"))
    assert backend.ok and backend._workers["D0"].nblocks > 100


def fuzz_history(seed, requests=60, blocks=12, bs=4):
    """A random clean history: many requests handed off concurrently, push or
    pull, with decode growth allocations, cancellations and failed transfers."""
    rnd = random.Random(seed)
    free = {"P0": list(range(blocks)), "D0": list(range(blocks))}
    events = []

    def take(w, n):
        if len(free[w]) < n:
            return None
        rnd.shuffle(free[w])
        out, free[w][:] = free[w][:n], free[w][n:]
        return tuple(out)

    def script(i):
        r, prompt = f"r{i}", rnd.randint(1, 9)
        n = -(-prompt // bs)
        first = rnd.randint(0, 1000)
        yield [Submit(r, 0, prompt_len=prompt, max_new_tokens=6)]
        d = None
        while (d := take("D0", n)) is None:
            yield []
        while (p := take("P0", n)) is None:
            yield []
        yield [Reserve(r, 0, f"t{i}", "D0", d), PrefillStart(r, 0, "P0", p)]
        yield [PrefillDone(r, 0, "P0", first_token=first, processed_len=prompt)]
        fail = rnd.random() < 0.1
        yield [TransferStart(f"x{i}", f"t{i}", r, 0, "P0", p, "D0", d)]
        if fail:
            yield [TransferFailed(f"x{i}")]
            yield [Cancel(r, 0), Free("P0", p, r, 0), Free("D0", d, r, 0)]
            free["P0"].extend(p), free["D0"].extend(d)
            return
        order = [TransferReadDone(f"x{i}"), TransferWriteDone(f"x{i}")]
        rnd.shuffle(order)
        yield [order[0]]
        yield [order[1]]
        yield [Free("P0", p, r, 0)]
        free["P0"].extend(p)
        yield [Commit(r, 0, f"t{i}", "D0")]
        table, tok = list(d), first
        for k in range(rnd.randint(0, 5)):
            pos = prompt + k
            if pos // bs >= len(table):
                while (extra := take("D0", 1)) is None:
                    yield []
                table += extra
                yield [Alloc(r, 0, "D0", extra)]
            yield [Decode(r, 0, "D0", pos, tok, tok + 7, tuple(table))]
            tok += 7
            if rnd.random() < 0.1:
                yield [Cancel(r, 0)]
                break
        else:
            yield [Finish(r, 0)]
        yield [Free("D0", tuple(table), r, 0)]
        free["D0"].extend(table)

    active = [script(i) for i in range(requests)]
    live = []
    while active or live:
        if active and (not live or rnd.random() < 0.3) and len(live) < 6:
            live.append(active.pop(0))
        g = rnd.choice(live)
        try:
            events.extend(next(g))
        except StopIteration:
            live.remove(g)
    header = HistoryHeader(policy="push", complete=True,
                           workers={"P0": WorkerSpec("prefill", blocks), "D0": WorkerSpec("decode", blocks)})
    return header, events


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_clean_runs_replay_clean(seed):
    header, events = fuzz_history(seed)
    monitor, backend = run_backend(events, header, tp=(2, 4), kv_heads=2)
    assert monitor.ok, monitor.violations[:3]
    assert backend.ok, backend.violations[:3]


def test_fuzzed_run_with_an_injected_early_free_is_caught():
    header, events = fuzz_history(7, requests=20)
    # free a source right after its transfer starts (before the read)
    i = next(i for i, e in enumerate(events) if isinstance(e, TransferStart)
             and any(isinstance(f, TransferReadDone) and f.transfer == e.transfer for f in events)
             and not any(isinstance(f, TransferFailed) and f.transfer == e.transfer for f in events))
    start = events[i]
    events.insert(i + 1, Free("P0", start.src_blocks, start.request, start.gen))
    monitor, backend = run_backend(events, header)
    assert "early-source-free" in {v.invariant for v in monitor.violations}
    assert kv(backend), "the early free must corrupt the KV the decode side gets"


def test_copy_is_independent():
    backend = TorchBackend(PUSH)
    for i, ev in enumerate(handoff()[:6]):
        backend.apply(ev, i + 2)
    twin = backend.copy()
    backend.apply(TransferWriteDone("x-r1-0"), 8)
    twin.apply(Free("P0", (0, 1)), 8)  # lazy read: the snapshot was taken at read_done
    twin.apply(TransferWriteDone("x-r1-0"), 9)
    twin.apply(Commit("r1", 0, "t-r1-0", "D0"), 10)
    assert twin.ok and backend.ok
    assert not torch.equal(backend.pool("P0"), twin.pool("P0"))  # only the twin freed


# -- command line ------------------------------------------------------------


def test_replay_text_report(tmp_path, capsys):
    path = tmp_path / "h.jsonl"
    write_history(path, handoff()[:6] + [Commit("r1", 0, "t-r1-0", "D0")], PUSH)
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "kv-corruption" in out and "commit-before-ready" in out


def test_replay_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["replay", str(bad)]) == 2
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["replay", "--head-dim", "3", os.path.join(EXAMPLES, "clean-push.jsonl")]) == 2
    if not CUDA:
        assert main(["replay", "--device", "cuda", os.path.join(EXAMPLES, "clean-push.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_replay_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "pdproto.backends._torch", raising=False)
    code = main(["replay", os.path.join(EXAMPLES, "clean-push.jsonl")])
    assert code == 2
    assert "pip install 'pdproto[torch]'" in capsys.readouterr().err


def test_import_pdproto_does_not_import_torch():
    code = "import sys, pdproto, pdproto._cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})


# -- CUDA --------------------------------------------------------------------


@needs_cuda
@pytest.mark.cuda
def test_cuda_clean_and_corrupt():
    _, backend = run_backend(handoff() + decodes(), device="cuda")
    assert backend.ok and backend.pool("D0").is_cuda
    events = handoff()[:5] + [Free("P0", (0, 1), "r1", 0)] + handoff()[5:7] + [Commit("r1", 0, "t-r1-0", "D0")]
    _, backend = run_backend(events, device="cuda")
    assert kv(backend)[0].found == "poison"


@needs_cuda
@pytest.mark.cuda
def test_cuda_lazy_read_then_reuse_delivers_the_snapshot():
    events = handoff()[:6] + [
        Free("P0", (0, 1), "r1", 0),
        Submit("r2", 0, prompt_len=4),
        Reserve("r2", 0, "t2", "D0", (4,)),
        PrefillStart("r2", 0, "P0", (0, 1)),
        PrefillDone("r2", 0, "P0", first_token=5, processed_len=4),
        TransferWriteDone("x-r1-0"),
        Commit("r1", 0, "t-r1-0", "D0"),
    ] + decodes()
    _, backend = run_backend(events, device="cuda", tp=(2, 1), kv_heads=2)
    assert backend.ok


@needs_cuda
@pytest.mark.cuda
def test_cuda_replay_cli(capsys):
    code, out = replay_json(os.path.join(EXAMPLES, "clean-push.jsonl"), "--device", "cuda", capsys=capsys)
    assert code == 0 and out["backend"]["device"].startswith("cuda")


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walks_of_the_reference_model_replay_clean(mode, seed):
    """Long random runs of the reference model, faults included, driven to a
    quiet state: the monitor and the buffers both find nothing."""
    import random

    from pdproto import FAULT_KINDS, Handoff, Monitor, ModelConfig

    rng = random.Random(seed)
    config = ModelConfig(
        mode=mode, requests=5, prefill_workers=2, decode_workers=2, blocks=3,
        faults={kind: 2 for kind in FAULT_KINDS},
    )
    h = Handoff(config)
    steps = 0
    while h.actions and steps < 400:
        h.do(rng.choice(h.actions))
        steps += 1
    h.run()  # progress actions only, to quiescence
    header = h.model.header
    monitor = Monitor.from_header(header)
    backend = TorchBackend(header)
    found = []
    for line, event in enumerate(h.events, start=2):
        found += monitor.feed(event, line) + backend.apply(event, line)
    found += monitor.finish() + backend.finish()
    assert found == []
    assert any(e.EV == "transfer_start" for e in h.events)  # KV did move


# -- memory: computed before allocating, refused over max_memory -------------


def test_memory_counts_every_pool_and_grows_within_the_limit():
    from pdproto._errors import LimitError
    from pdproto.backends import TorchBackend

    header = HistoryHeader(workers={"P0": WorkerSpec("prefill", 8), "D0": WorkerSpec("decode", 8)})
    b = TorchBackend(header, tp=(2, 1))
    b.apply(PrefillStart("r", 0, "P0", (0,)), 1)
    b.apply(Alloc("r", 0, "D0", (0,)), 2)
    pools = sum(t.numel() * t.element_size() for w in ("P0", "D0") for t in b._workers[w].pools)
    assert b.memory - b._fixed_bytes() == pools
    per = b.block_bytes("decode")
    # doubling 8 -> 16 blocks would pass the limit; growing to exactly what the event needs does not
    limit = b.memory + 2 * per
    b.max_memory = limit
    b.apply(Alloc("r", 0, "D0", (9,)), 3)
    assert b._workers["D0"].nblocks == 10 and b.memory <= limit
    with pytest.raises(LimitError) as info:
        b.apply(Alloc("r", 0, "D0", (11,)), 4)
    assert info.value.line == 4 and info.value.limit == limit
    assert b._workers["D0"].nblocks == 10  # nothing changed


def test_sizes_are_checked_before_anything_is_allocated():
    from pdproto._errors import LimitError
    from pdproto.backends import DEFAULT_MAX_MEMORY, TorchBackend

    # a declared pool is not allocated up front: it is the blocks the history touches
    header = HistoryHeader(workers={"P0": WorkerSpec("prefill", 10**400)})
    b = TorchBackend(header)
    assert b.memory < 1 << 20
    b.apply(PrefillStart("r", 0, "P0", (3,)), 2)
    assert b._workers["P0"].nblocks == 8  # the smallest pool, not 10**400
    with pytest.raises(LimitError) as info:
        b.apply(PrefillStart("r", 0, "P0", (10**400,)), 3)
    assert info.value.limit == DEFAULT_MAX_MEMORY and "P0" in str(info.value) and info.value.line == 3
    with pytest.raises(LimitError):
        TorchBackend(tp="400000000:1")
    TorchBackend(layers=64, max_memory=None)  # no limit


def test_positions_past_the_table_are_reported_not_allocated():
    from pdproto.backends import TorchBackend

    b = TorchBackend(max_memory=64 << 20)
    b.apply(Submit("r", 0, 10**400), 1)
    b.apply(PrefillStart("r", 0, "P0", (0,)), 2)
    b.apply(PrefillDone("r", 0, "P0", first_token=1, processed_len=10**400), 3)
    b.apply(Alloc("r", 0, "D0", (0,)), 4)
    found = b.apply(Decode("r", 0, "D0", 10**12, 1, 2, (0,)), 5)
    assert [v.invariant for v in found] == ["kv-corruption"]
    assert "covers positions [0, 4) only" in found[0].message


def test_torch_dtypes_and_tp_in_ascii_digits():
    from pdproto._errors import UsageError
    from pdproto.backends import TORCH_DTYPES, parse_tp

    assert TORCH_DTYPES["bfloat16"] is torch.bfloat16
    assert parse_tp("2:1") == (2, 1)
    for text in ("\u00b2:1", "1:\u0663", "1", "0:1", "1:2:3"):
        with pytest.raises(UsageError):
            parse_tp(text)
