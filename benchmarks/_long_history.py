"""A deterministic generator of long clean histories (for replay_speed.py).

``generate(events=14000, seed=0, policy="push", version="1.1")`` returns
``(header, events, stats)``: the header and the events as JSON objects (dicts,
ready to be written one per line) and a few counts.  Same arguments, same
history.

Shape of the system: prefill workers P0, P1 and decode workers D0, D1, each
with a pool that a first-fit allocator hands out (so block ids are reused
after a free, as in an engine); the header declares each pool at the peak the
history reached.  Up to ``concurrency`` requests are in flight at once; a
seeded scheduler picks which one takes its next step, so their events
interleave.  Every request goes through submit, reserve (on D, for its prompt;
before prefill under push, after it under pull), prefill_start /
prefill_done on P, one transfer (or two chunked ones) with read_done and
write_done in either order, the free of its P blocks after the reads, commit
after the writes, one to nine decodes (an ``alloc`` on D when a decode
needs a new block), finish, and the free of its D blocks.

Version "1.1" adds, declared in the header's ``features``:

- ``ranges``: about one request in eight moves its prompt in two chunked
  transfers under one ticket, token ranges ``[0, m)`` and ``[m, prompt_len)``
  with ``m`` not block aligned (partial blocks travel in both);
- ``share``: about one request in eight is a prefix-cache hit: it shares the
  first full blocks of a request that is still holding its prefilled P
  blocks, and prefills only the rest (``processed_len = prompt_len -
  tokens``); its transfer moves the whole prompt through its block table
  (shared blocks first).

Version 1 generates neither.  Tokens: a prompt position holds the KV of the
prompt; generated tokens come from a seeded stream, each decode feeding the
token the previous step produced.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

PREFILL = ("P0", "P1")
DECODE = ("D0", "D1")


class _Pool:
    """First-fit block allocator with reference counts (shared blocks)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.peak = 0

    def take(self, n: int) -> list[int]:
        out, b = [], 0
        while len(out) < n:
            if b not in self.refs:
                out.append(b)
                self.refs[b] = 1
            b += 1
        self.peak = max(self.peak, b)
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]


class _Gen:
    """One request's state while its steps are generated."""

    def __init__(self, n: int, rng: random.Random, bs: int, prompt: tuple[int, int]) -> None:
        self.rid = f"r{n}"
        self.ticket = f"t{n}"
        self.prompt = rng.randint(*prompt)
        self.decodes = rng.randint(1, 9)
        self.p = PREFILL[rng.randrange(len(PREFILL))]
        self.d = DECODE[rng.randrange(len(DECODE))]
        self.chunked = False
        self.try_share = False
        self.shared: list[int] = []  # P blocks taken by a share
        self.shared_tokens = 0
        self.own: list[int] = []  # P blocks it allocated
        self.dtable: list[int] = []  # D block table
        self.holding_p = False  # prefilled, its P blocks not freed yet (a share source)
        self.tok = rng.randrange(1, 50_000)
        self.bs = bs

    def blocks_for(self, lo: int, hi: int, table: list[int]) -> list[int]:
        return table[lo // self.bs:(hi - 1) // self.bs + 1]


def _steps(g: _Gen, ctx: "_Ctx") -> Iterator[dict[str, Any]]:
    """The events of one request, in order; computed lazily so that
    allocation sees the pools as they are when the step runs."""
    rng, bs = ctx.rng, g.bs
    base = {"request": g.rid, "gen": 0}
    yield {"ev": "submit", **base, "prompt_len": g.prompt, "max_new_tokens": g.decodes + 1}

    def reserve() -> dict[str, Any]:
        g.dtable = ctx.pools[g.d].take(-(-g.prompt // bs))
        return {"ev": "reserve", **base, "ticket": g.ticket, "worker": g.d, "blocks": list(g.dtable)}

    if ctx.policy == "push":
        yield reserve()
    if g.try_share:
        lead = ctx.share_source(g)
        if lead is not None:
            k = min(len(lead.own) - (1 if lead.prompt % bs else 0), (g.prompt - 1) // bs)
            k = rng.randint(1, k)
            g.p = lead.p
            g.shared = lead.own[:k]
            g.shared_tokens = k * bs
            ctx.pools[g.p].share(g.shared)
            ctx.stats["shares"] += 1
            yield {"ev": "share", **base, "worker": g.p, "blocks": list(g.shared), "tokens": g.shared_tokens}
    g.own = ctx.pools[g.p].take(-(-g.prompt // bs) - len(g.shared))
    yield {"ev": "prefill_start", **base, "worker": g.p, "blocks": list(g.own)}
    g.holding_p = True
    yield {"ev": "prefill_done", **base, "worker": g.p, "first_token": g.tok,
           "processed_len": g.prompt - g.shared_tokens}
    if ctx.policy == "pull":
        yield reserve()
    ptable = g.shared + g.own
    if g.chunked:
        m = rng.randint(1, g.prompt - 1)
        while m % bs == 0 and g.prompt > 2:  # a partial block on both sides of the cut
            m = rng.randint(1, g.prompt - 1)
        ranges = [(0, m), (m, g.prompt)]
        ctx.stats["chunked"] += 1
    else:
        ranges = [None]
    xfers = []
    for i, r in enumerate(ranges):
        x = f"x{g.rid[1:]}-{i}"
        ev = {"ev": "transfer_start", "transfer": x, "ticket": g.ticket, **base, "src": g.p}
        if r is None:
            ev.update(src_blocks=list(ptable), dst=g.d, dst_blocks=list(g.dtable))
        else:
            ev.update(src_blocks=g.blocks_for(*r, ptable), dst=g.d, dst_blocks=g.blocks_for(*r, g.dtable),
                      tokens=list(r))
        xfers.append(x)
        yield ev
    # reads and writes complete in a seeded order; P blocks are freed after every read
    pending = [(x, kind) for x in xfers for kind in ("transfer_read_done", "transfer_write_done")]
    rng.shuffle(pending)
    pending.sort(key=lambda e: xfers.index(e[0]))  # each transfer's two ends stay near each other
    reads_left = len(xfers)
    freed_p = False
    for x, kind in pending:
        yield {"ev": kind, "transfer": x}
        if kind == "transfer_read_done":
            reads_left -= 1
        if not reads_left and not freed_p:
            freed_p = True
            g.holding_p = False
            ctx.pools[g.p].drop(ptable)
            yield {"ev": "free", "worker": g.p, "blocks": list(ptable), **base}
    yield {"ev": "commit", **base, "ticket": g.ticket, "worker": g.d}
    tok = g.tok
    for i in range(g.decodes):
        pos = g.prompt + i
        if pos // bs >= len(g.dtable):
            new = ctx.pools[g.d].take(1)
            g.dtable += new
            yield {"ev": "alloc", **base, "worker": g.d, "blocks": new}
        out = ctx.rng.randrange(1, 50_000)
        yield {"ev": "decode", **base, "worker": g.d, "position": pos, "input_token": tok,
               "output_token": out, "blocks": list(g.dtable)}
        tok = out
    yield {"ev": "finish", **base, "reason": "length"}
    ctx.pools[g.d].drop(g.dtable)
    yield {"ev": "free", "worker": g.d, "blocks": list(g.dtable), **base}
    ctx.stats["positions"] += g.prompt + g.decodes


class _Ctx:
    def __init__(self, rng: random.Random, policy: str) -> None:
        self.rng = rng
        self.policy = policy
        self.pools = {w: _Pool() for w in PREFILL + DECODE}
        self.active: list[_Gen] = []
        self.stats = {"requests": 0, "chunked": 0, "shares": 0, "positions": 0}

    def share_source(self, g: _Gen) -> _Gen | None:
        bs = g.bs
        leads = [a for a in self.active if a is not g and a.holding_p and not a.shared
                 and len(a.own) - (1 if a.prompt % bs else 0) >= 1 and g.prompt > bs]
        return self.rng.choice(leads) if leads else None


def generate(
    events: int = 14_000,
    *,
    seed: int = 0,
    policy: str = "push",
    version: str | int = "1.1",
    concurrency: int = 12,
    block_size: int = 4,
    prompt: tuple[int, int] = (4, 48),
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, int]]:
    """A clean history of at least ``events`` events (requests are admitted
    until that many were emitted, then drained): ``(header, events, stats)``.
    ``stats``: requests, chunked (two-transfer requests), shares, positions
    (prompt + decode positions over all requests: the KV a replay verifies),
    events.  Prompt lengths are drawn from ``prompt`` (inclusive; at least 4)."""
    if prompt[0] < 4 or prompt[1] < prompt[0]:
        raise ValueError(f"prompt must be (lo, hi) with 4 <= lo <= hi, got {prompt!r}")
    if policy not in ("push", "pull"):
        raise ValueError(f"policy must be push or pull, got {policy!r}")
    if version not in (1, "1", "1.1"):
        raise ValueError(f"version must be 1 or 1.1, got {version!r}")
    v11 = version == "1.1"
    rng = random.Random(seed)
    ctx = _Ctx(rng, policy)
    out: list[dict[str, Any]] = []
    running: list[tuple[_Gen, Iterator[dict[str, Any]]]] = []
    n = 0
    while running or len(out) < events:
        while len(out) < events and len(running) < concurrency:
            n += 1
            g = _Gen(n, rng, block_size, prompt)
            if v11:
                g.chunked = g.prompt > 2 and rng.random() < 0.125
                g.try_share = rng.random() < 0.125
            ctx.active.append(g)
            ctx.stats["requests"] += 1
            running.append((g, _steps(g, ctx)))
        i = rng.randrange(len(running))
        g, it = running[i]
        ev = next(it, None)
        if ev is None:
            running.pop(i)
            ctx.active.remove(g)
            continue
        out.append(ev)
    workers = {w: {"role": "prefill" if w in PREFILL else "decode", "blocks": max(1, ctx.pools[w].peak)}
               for w in PREFILL + DECODE}
    header: dict[str, Any] = {"pdproto": "history", "version": 1, "policy": policy, "complete": True}
    if v11:
        header["version"] = "1.1"
        header["features"] = ["ranges", "share"]
    header["workers"] = workers
    header["description"] = (f"Generated by benchmarks/_long_history.py (seed {seed}): a clean {policy} "
                             f"history of {ctx.stats['requests']} interleaved requests.")
    stats = dict(ctx.stats, events=len(out))
    return header, out, stats


def write(path: str, header: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Write the history as JSON Lines (the header first)."""
    import json

    with open(path, "w", encoding="utf-8") as fh:
        for obj in [header, *events]:
            fh.write(json.dumps(obj, separators=(", ", ": ")))
            fh.write("\n")
