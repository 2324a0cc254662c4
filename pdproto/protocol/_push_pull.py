"""The rules of the reference handoff protocol: the push and pull families
(:data:`PUSH`, :data:`PULL`, both in :data:`REFERENCE`).

Each rule's guard and effect are plain functions of the model ``m`` (a
:class:`~pdproto.protocol._reference.HandoffModel`, whose helpers they use),
the state ``s`` and what the rule is about (see :class:`Kind`).  The rules
shared by both families are written once; the others come in a push and a
pull version.  docs/protocol.md renders these tables
(``python benchmarks/gen_protocol_table.py``).
"""

from __future__ import annotations

from typing import Any

from ..spec import (
    Free,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Share,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferWriteDone,
)
from ._config import FAULT_KINDS
from ._rules import Kind, Rule, RuleBook, RuleTable
from ._state import (
    CANCELLED,
    COMMITTED,
    FAILED,
    FINISHED,
    LIVE,
    NO_PREFIX,
    NOTIFY,
    OWN_PREFIX,
    PREFILLED,
    PREFILLING,
    QUEUED,
    READY,
    RELEASE,
    RESERVED,
    SHARED_PREFIX,
    TRANSFERRING,
    WAITING,
    Phase,
    Req,
    Xfer,
    XferState,
    with_aborted,
    with_dst,
    with_msgs,
    with_pfx,
    with_ph,
    with_src,
    with_xfers,
    with_xs,
)

__all__ = ["PUSH", "PULL", "REFERENCE"]

DONE = XferState.DONE
REORDER_BUDGET = FAULT_KINDS.index("reorder")
BEFORE_COMMIT = tuple(ph for ph in Phase if ph not in (Phase.NEW, COMMITTED))

# -- guards and effects -----------------------------------------------------------


def submit(m: Any, s: Any, target: tuple, ev: list) -> Any:
    r, p, d = target
    ev.append(Submit(m.rname[r], 0, m.prompt_len, m.max_new))
    return m.set_req(s, r, Req(gen=0, ph=QUEUED, p=p, d=d))


def d_has_room(m: Any, s: Any, r: int, q: Req) -> bool:
    return len(m.free_blocks(s, q.d)) >= m.ndst


def p_has_room(m: Any, s: Any, r: int, q: Req) -> bool:
    need = m.nsrc
    if m.prefix_blocks and _prefix_hit(m, s, r, q):
        need -= m.prefix_blocks
    return len(m.free_blocks(s, q.p)) >= need


def _prefix_hit(m: Any, s: Any, r: int, q: Req) -> bool:
    guard = m.table.share_prefix.guard
    return guard is None or bool(guard(m, s, r, q))


def take_target(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    """D takes the first free target blocks under the generation's ticket."""
    blocks = tuple(m.free_blocks(s, q.d)[: m.ndst])
    ev.append(Reserve(m.rname[r], q.gen, m.tk(r, q.gen), m.wname[q.d], blocks))
    return q._replace(dst=blocks, dinc=s.inc[q.d])


def reserve_push(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    return m.set_req(s, r, with_ph(take_target(m, s, r, q, ev), RESERVED))


def reserve_pull(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    return m.start_transfer(s, r, with_ph(take_target(m, s, r, q, ev), TRANSFERRING), ev)


def prefill_start(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    if m.prefix_blocks and _prefix_hit(m, s, r, q):
        q = m.table.share_prefix.effect(m, s, r, q, ev)
    blocks = tuple(m.free_blocks(s, q.p)[: m.nsrc - len(q.src)])
    ev.append(PrefillStart(m.rname[r], q.gen, m.wname[q.p], blocks))
    return m.set_req(s, r, q._replace(ph=PREFILLING, src=q.src + blocks, pinc=s.inc[q.p]))


def prefix_cached(m: Any, s: Any, r: int, q: Req) -> bool:
    return bool(m.cached_prefix(s, q.p))


def share_prefix(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    """The generation takes a reference on the prefix blocks P has cached."""
    blocks = m.cached_prefix(s, q.p)
    ev.append(Share(m.rname[r], q.gen, m.wname[q.p], blocks, m.prefix_tokens))
    return q._replace(src=blocks, pfx=SHARED_PREFIX)


def prefix_uncached(m: Any, s: Any, r: int, q: Req) -> bool:
    return q.pfx == NO_PREFIX and not m.cached_prefix(s, q.p)


def publish_prefix(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    return with_pfx(q, OWN_PREFIX)


def _prefilled(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    done = m.prompt_len
    if m.prefix_blocks:
        if q.pfx == SHARED_PREFIX:
            done -= m.prefix_tokens
        else:
            rule = m.table.publish_prefix
            if rule.guard is None or rule.guard(m, s, r, q):
                q = rule.effect(m, s, r, q, ev)
    ev.append(PrefillDone(m.rname[r], q.gen, m.wname[q.p], m.first_token(r, q.gen), done))
    return q


def prefill_done_push(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    q = _prefilled(m, s, r, q, ev)
    return m.start_transfer(s, r, with_ph(q, TRANSFERRING), ev)


def prefill_done_pull(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    q = _prefilled(m, s, r, q, ev)
    if m.heartbeat:  # the incarnation of D whose heartbeats renew P's lease
        q = q._replace(dinc=s.inc[q.d])
    return m.send(m.set_req(s, r, with_ph(q, PREFILLED)), READY, r, q.gen, q.p, q.d)


def may_decode(m: Any, s: Any, r: int, q: Req) -> bool:
    return 1 + q.ndec < m.max_new


def may_finish(m: Any, s: Any, r: int, q: Req) -> bool:
    return 1 + q.ndec >= m.max_new


def decode(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    return m.decode_at(s, r, q, ev, m.prompt_len + q.ndec, m.first_token(r, q.gen) + q.ndec)


def source_lease_over(m: Any, s: Any, r: int, q: Req) -> bool:
    return bool(q.src) and m.xfer_of(s, r) < 0


def p_lease(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
    return m.set_req(s, r, with_src(q, ()))


def heartbeat_stopped(m: Any, s: Any, r: int, q: Req) -> bool:
    """(heartbeat) P still holds the source and D's heartbeats stopped: D
    restarted since P told it the prefill was ready."""
    return m.heartbeat and bool(q.src) and q.dinc != s.inc[q.d]


def lease_expire(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
    s = m.set_req(s, r, with_src(q, ()))
    return m.finish_gen(s, r, FAILED, ev, "timeout")


def notify_gone(m: Any, s: Any, r: int, q: Req) -> bool:
    return q.xs is DONE and not m.has_msg(s, r, q.gen)


def ready_gone(m: Any, s: Any, r: int, q: Req) -> bool:
    return not m.has_msg(s, r, q.gen)


def ended_clean(m: Any, s: Any, r: int, q: Req) -> bool:
    return not q.src and not q.dst and m.xfer_of(s, r) < 0


def retry(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
    ev.append(Submit(m.rname[r], q.gen + 1, m.prompt_len, m.max_new))
    return m.set_req(s, r, Req(gen=q.gen + 1, ph=QUEUED, p=q.p, d=q.d))


def _end_with(how: Any, reason: str | None) -> Any:
    def end(m: Any, s: Any, r: int, q: Req, ev: list) -> Any:
        return m.finish_gen(s, r, how, ev, reason)

    end.__name__ = end.__qualname__ = f"end_{how.name.lower()}_{reason or 'done'}"
    return end


# transfers


def xfer_done(m: Any, s: Any, i: int, x: Xfer, ev: list) -> Any:
    tid = m.tid(x.r, x.gen, x.chunk)
    ev.append(TransferReadDone(tid))
    ev.append(TransferWriteDone(tid))
    s = with_xfers(s, s.xfers[:i] + s.xfers[i + 1 :])
    if m.chunks > 1:
        rule = m.table.next_chunk
        if rule.guard is None or rule.guard(m, s, x, s.reqs[x.r]):
            return rule.effect(m, s, x, s.reqs[x.r], ev)
    return m.table.on_xfer_done.effect(m, s, x, with_xs(s.reqs[x.r], DONE), ev)


def chunks_left(m: Any, s: Any, x: Xfer, q: Req) -> bool:
    return x.chunk + 1 < m.chunks and not x.aborted and q.end is LIVE


def next_chunk(m: Any, s: Any, x: Xfer, q: Req, ev: list) -> Any:
    return m.start_chunk(s, x.r, q, x.chunk + 1, ev)


def xfer_fail(m: Any, s: Any, i: int, x: Xfer, ev: list) -> Any:
    ev.append(TransferFailed(m.tid(x.r, x.gen, x.chunk)))
    s = with_xfers(s, s.xfers[:i] + s.xfers[i + 1 :])
    return m.table.on_xfer_failed.effect(m, s, x, with_xs(s.reqs[x.r], XferState.FAILED), ev)


def on_xfer_done_push(m: Any, s: Any, x: Xfer, q: Req, ev: list) -> Any:
    if q.end is not LIVE:
        return m.cleanup(m.set_req(s, x.r, q), x.r, ev)
    if q.src:
        ev.append(Free(m.wname[q.p], q.src, m.rname[x.r], q.gen))
        q = with_src(q, ())
    return m.send(m.set_req(s, x.r, q), NOTIFY, x.r, q.gen, q.p, q.d)


def on_xfer_done_pull(m: Any, s: Any, x: Xfer, q: Req, ev: list) -> Any:
    if q.end is not LIVE:
        return m.cleanup(m.set_req(s, x.r, q), x.r, ev)
    s = m.commit(s, x.r, q, ev, m.tk(x.r, q.gen))
    return m.send(s, RELEASE, x.r, q.gen, q.d, q.p)


def on_xfer_failed(m: Any, s: Any, x: Xfer, q: Req, ev: list) -> Any:
    s = m.set_req(s, x.r, q)
    if q.end is LIVE:
        return m.finish_gen(s, x.r, FAILED, ev, "transfer_failed")
    return m.cleanup(s, x.r, ev)


# messages (deliver, reorder, dup, lose) and their receivers


def dup_allowed(m: Any, s: Any, i: int, msg: Any) -> bool:
    return i == 0 or s.budget[REORDER_BUDGET] > 0


def deliver(m: Any, s: Any, i: int, msg: Any, ev: list) -> Any:
    return m.receive(with_msgs(s, s.msgs[:i] + s.msgs[i + 1 :]), msg, ev)


def dup(m: Any, s: Any, i: int, msg: Any, ev: list) -> Any:
    return m.receive(m.spend(s, REORDER_BUDGET) if i else s, msg, ev)


def lose(m: Any, s: Any, i: int, msg: Any, ev: list) -> Any:
    return with_msgs(s, s.msgs[:i] + s.msgs[i + 1 :])


def notify_awaited(m: Any, s: Any, msg: Any, q: Req) -> bool:
    return (
        q.gen == msg.gen
        and q.end is LIVE
        and q.ph is TRANSFERRING
        and q.xs is DONE
        and bool(q.dst)
        and q.dinc == s.inc[q.d]
        and msg.to == q.d
    )


def recv_notify(m: Any, s: Any, msg: Any, q: Req, ev: list) -> Any:
    return m.commit(s, msg.r, q, ev, m.tk(msg.r, q.gen))


def ready_awaited(m: Any, s: Any, msg: Any, q: Req) -> bool:
    return q.gen == msg.gen and q.end is LIVE and q.ph is PREFILLED


def recv_ready(m: Any, s: Any, msg: Any, q: Req, ev: list) -> Any:
    if d_has_room(m, s, msg.r, q):
        return reserve_pull(m, s, msg.r, q, ev)
    return m.set_req(s, msg.r, with_ph(q, WAITING))


def release_awaited(m: Any, s: Any, msg: Any, q: Req) -> bool:
    return (
        q.gen == msg.gen and bool(q.src) and q.pinc == s.inc[q.p] and q.xs is DONE and m.xfer_of(s, msg.r) < 0
    )


def recv_release(m: Any, s: Any, msg: Any, q: Req, ev: list) -> Any:
    ev.append(Free(m.wname[q.p], q.src, m.rname[msg.r], q.gen))
    return m.set_req(s, msg.r, with_src(q, ()))


# workers


def restart_matters(m: Any, s: Any, w: int) -> bool:
    """Restarting an idle worker is an uninteresting no-op: skip it."""
    for q in s.reqs:
        if q.gen >= 0 and (q.p == w or q.d == w) and (q.end is LIVE or q.src or q.dst):
            return True
    return any(x.p == w or x.d == w for x in s.xfers)


def restart(m: Any, s: Any, w: int, ev: list) -> Any:
    inc = s.inc[:w] + (s.inc[w] + 1,) + s.inc[w + 1 :]
    ev.append(Restart(m.wname[w], inc[w]))
    xfers = tuple(
        x._replace(doomed=True, dst_lost=x.dst_lost or x.d == w) if (x.p == w or x.d == w) else x
        for x in s.xfers
    )
    reqs = list(s.reqs)
    ended = []
    for r, q in enumerate(reqs):
        if q.gen < 0:
            continue
        involved = (q.p == w and (bool(q.src) or q.ph is PREFILLING)) or (
            q.d == w and (bool(q.dst) or q.ph is WAITING)
        )
        involved = involved or any(x.r == r and x.gen == q.gen and (x.p == w or x.d == w) for x in s.xfers)
        if q.p == w:
            q = with_src(q, ())
        if q.d == w:
            q = with_dst(q, ())
        if q.end is LIVE and involved and (q.ph is not COMMITTED or q.d == w):
            q = m.end_gen(q, r, FAILED, ev, "restart")
            ended.append(r)
        reqs[r] = q
    s = s._replace(inc=inc, xfers=xfers, reqs=tuple(reqs))
    for r in ended:
        s = m.cleanup(s, r, ev)
    return s


def fenced(m: Any, s: Any, x: Xfer) -> bool:
    return x.dst_lost


# cleanup


def cleanup(m: Any, s: Any, r: int, ev: list) -> Any:
    q = s.reqs[r]
    xi = m.xfer_of(s, r)
    if xi >= 0:
        x = s.xfers[xi]
        if not x.aborted and not x.doomed:
            ev.append(TransferAbort(m.tid(x.r, x.gen, x.chunk)))
            s = with_xfers(s, s.xfers[:xi] + (with_aborted(x, True),) + s.xfers[xi + 1 :])
    table = m.table
    for held, rule in ((q.src, table.free_source), (q.dst, table.free_target)):
        if held and (rule.guard is None or rule.guard(m, s, r, q, xi)):
            q = rule.effect(m, s, r, q, ev)
    return m.set_req(s, r, q)


def untouched(m: Any, s: Any, r: int, q: Req, xi: int) -> bool:
    """No transfer of the generation is in flight (``xi`` is its index, or -1)."""
    return xi < 0


def free_source(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
    return with_src(q, ())


def free_target(m: Any, s: Any, r: int, q: Req, ev: list) -> Req:
    ev.append(Free(m.wname[q.d], q.dst, m.rname[r], q.gen))
    return with_dst(q, ())


# -- the tables -------------------------------------------------------------------

R, T, M, W, H = Kind.REQUEST, Kind.TRANSFER, Kind.MESSAGE, Kind.WORKER, Kind.HANDLER
CLEANUP = ("cleanup",)

SUBMIT = Rule(
    "submit",
    Kind.CLIENT,
    "client",
    "request not yet submitted (requests arrive in order)",
    "gen 0 queued at the router, routed to a P and a D worker",
    ("submit",),
    effect=submit,
)
DECODE = Rule(
    "decode",
    R,
    "D",
    "committed (C), live, fewer than max_new_tokens tokens so far",
    "one decode step: the first feeds the first token at position prompt_len",
    ("decode",),
    may_decode,
    decode,
    phases=(COMMITTED,),
)
CANCEL = Rule(
    "cancel",
    R,
    "client",
    "a live generation, any phase",
    "the generation is cancelled; cleanup",
    ("cancel",),
    None,
    _end_with(CANCELLED, None),
    fault="cancel",
    calls=CLEANUP,
)
TIMEOUT = Rule(
    "timeout",
    R,
    "router",
    "a live generation before commit",
    "the handoff deadline expires early: the generation fails; cleanup",
    ("fail",),
    None,
    _end_with(FAILED, "timeout"),
    fault="timeout",
    phases=BEFORE_COMMIT,
    calls=CLEANUP,
    unless="expire",
)
TRANSFER_RULES = (
    Rule(
        "xfer_done",
        T,
        "xfer",
        "transfer in flight (aborted or not), neither endpoint restarted",
        "every read and write landed; the initiator's completion handler runs (next_chunk first)",
        ("transfer_read_done", "transfer_write_done"),
        None,
        xfer_done,
        calls=("next_chunk", "on_xfer_done"),
        at=("running", "aborted"),
    ),
    Rule(
        "xfer_fail",
        T,
        "xfer",
        "aborted, or an endpoint restarted",
        "the transfer ends without success",
        ("transfer_failed",),
        None,
        xfer_fail,
        calls=("on_xfer_failed",),
        at=("aborted", "doomed"),
    ),
    Rule(
        "xfer_fault",
        T,
        "xfer",
        "any other transfer in flight",
        "the data plane fails the transfer",
        ("transfer_failed",),
        None,
        xfer_fail,
        fault="transfer_fail",
        action="xfer_fail",
        calls=("on_xfer_failed",),
        at=("running",),
    ),
)
NEXT_CHUNK = Rule(
    "next_chunk",
    H,
    "initiator",
    "chunks > 1: a chunk landed, chunks are left, the generation is live, the transfer was not aborted",
    "the initiator starts the next chunk's transfer under the same ticket "
    "(on_xfer_done runs after the last chunk only)",
    ("transfer_start",),
    chunks_left,
    next_chunk,
)
PREFIX_RULES = (
    Rule(
        "share_prefix",
        H,
        "P",
        "prefix_cache: a generation on P holds the cached prefix",
        "prefill_start takes a reference on the prefix blocks (share) and allocates only the rest; "
        "prefill then computes the positions after the prefix",
        ("share",),
        prefix_cached,
        share_prefix,
    ),
    Rule(
        "publish_prefix",
        H,
        "P",
        "prefix_cache: prefill done, P caches no prefix, the generation shares none",
        "the generation's first source blocks become P's cached prefix (until their last owner frees them)",
        (),
        prefix_uncached,
        publish_prefix,
    ),
)
ON_XFER_FAILED = Rule(
    "on_xfer_failed",
    H,
    "initiator",
    "a transfer ended without success",
    "the initiator fails a live generation; cleanup",
    ("fail",),
    None,
    on_xfer_failed,
    calls=CLEANUP,
)
RECEIVE = "the receiver runs its recv_ rule; a message of an old incarnation of its sender is dropped"
MESSAGE_RULES = (
    Rule("deliver", M, "net", "the oldest message in flight", RECEIVE, (), None, deliver, at=("oldest",)),
    Rule(
        "reorder",
        M,
        "net",
        "a message in flight other than the oldest",
        RECEIVE,
        (),
        None,
        deliver,
        fault="reorder",
        action="deliver",
        at=("other",),
    ),
    Rule(
        "dup",
        M,
        "net",
        "a message in flight (not the oldest: also spends reorder)",
        "the receiver handles it and the message stays in flight",
        (),
        dup_allowed,
        dup,
        fault="dup",
    ),
    Rule("lose", M, "net", "a message in flight", "the message is gone", (), None, lose, fault="loss"),
)
WORKER_RULES = (
    Rule(
        "restart",
        W,
        "worker",
        "a worker holding state",
        "incarnation+1, its blocks are gone; its transfers can only fail, the targets they write stay "
        "fenced; the router fails every live generation it held; cleanup on the other workers",
        ("restart", "fail"),
        restart_matters,
        restart,
        fault="restart",
        calls=CLEANUP,
    ),
    Rule(
        "fence",
        H,
        "D",
        "a transfer into D of an old incarnation of D is in flight",
        "its target blocks stay out of D's free pool until the transfer ends",
        (),
        fenced,
    ),
    Rule(
        "retry",
        R,
        "router",
        "the generation failed and its cleanup is over",
        "a new generation gen+1 is queued; fresh ticket and transfer ids",
        ("submit",),
        ended_clean,
        retry,
        fault="retry",
        ends=(FAILED,),
    ),
)
CLEANUP_RULES = (
    Rule(
        "cleanup",
        H,
        "every worker",
        "the generation ended (any path), or its transfer ended after it did",
        "every worker sees the token: the initiator aborts a transfer in flight; then free_source, "
        "free_target",
        ("transfer_abort",),
        None,
        cleanup,
        calls=("free_source", "free_target"),
    ),
    Rule(
        "free_source",
        H,
        "P",
        "the generation ended and no transfer of it is in flight",
        "P frees its source blocks (a shared prefix block: drops its reference)",
        ("free",),
        untouched,
        free_source,
    ),
    Rule(
        "free_target",
        H,
        "D",
        "the generation ended and no transfer of it is in flight",
        "D frees its target blocks",
        ("free",),
        untouched,
        free_target,
    ),
)


def _expire(awaiting: str, phase: Phase, guard: Any) -> Rule:
    return Rule(
        "expire",
        R,
        "router",
        f"{awaiting} in flight (lost, or dropped as stale)",
        "the handoff deadline expires: the generation fails; cleanup",
        ("fail",),
        guard,
        _end_with(FAILED, "deadline"),
        phases=(phase,),
        calls=CLEANUP,
    )


def _on_xfer_done(actor: str, then: str, event: str, effect: Any) -> Rule:
    return Rule(
        "on_xfer_done",
        H,
        actor,
        "the transfer completed",
        f"an ended generation gets its cleanup; else {then}",
        (event,),
        None,
        effect,
        calls=CLEANUP,
    )


PUSH = RuleTable(
    "push",
    (
        SUBMIT,
        Rule(
            "reserve",
            R,
            "D",
            "queued (Q) and D has free blocks",
            "D takes target blocks under ticket t:r:gen",
            ("reserve",),
            d_has_room,
            reserve_push,
            phases=(QUEUED,),
        ),
        Rule(
            "prefill_start",
            R,
            "P",
            "reserved (R) and P has free blocks",
            "P takes source blocks and prefills",
            ("prefill_start",),
            p_has_room,
            prefill_start,
            phases=(RESERVED,),
            calls=("share_prefix",),
        ),
        Rule(
            "prefill_done",
            R,
            "P",
            "prefilling (P)",
            "first token sampled (not in the KV); P starts writing into D's ticket blocks",
            ("prefill_done", "transfer_start"),
            None,
            prefill_done_push,
            phases=(PREFILLING,),
            calls=("publish_prefix",),
        ),
        *PREFIX_RULES,
        DECODE,
        Rule(
            "finish",
            R,
            "D",
            "committed (C), live, max_new_tokens tokens produced",
            "the generation finishes; cleanup (D frees its target)",
            ("finish",),
            may_finish,
            _end_with(FINISHED, None),
            phases=(COMMITTED,),
            calls=CLEANUP,
        ),
        CANCEL,
        _expire("transfer done and no notify", TRANSFERRING, notify_gone),
        TIMEOUT,
        *TRANSFER_RULES,
        NEXT_CHUNK,
        _on_xfer_done("P", "P frees its source and sends notify to D", "free", on_xfer_done_push),
        ON_XFER_FAILED,
        *MESSAGE_RULES,
        Rule(
            "recv_notify",
            H,
            "D",
            "notify: same generation, live, awaiting (X), transfer done, D still holds the ticket blocks of "
            "this incarnation",
            "D commits",
            ("commit",),
            notify_awaited,
            recv_notify,
        ),
        *WORKER_RULES,
        *CLEANUP_RULES,
    ),
    phases=(QUEUED, RESERVED, PREFILLING, TRANSFERRING, COMMITTED),
)

PULL = RuleTable(
    "pull",
    (
        SUBMIT,
        Rule(
            "reserve",
            R,
            "D",
            "queued at D (W) and D has free blocks",
            "D takes target blocks under ticket t:r:gen and starts reading from P",
            ("reserve", "transfer_start"),
            d_has_room,
            reserve_pull,
            phases=(WAITING,),
        ),
        Rule(
            "prefill_start",
            R,
            "P",
            "queued (Q) and P has free blocks",
            "P takes source blocks and prefills",
            ("prefill_start",),
            p_has_room,
            prefill_start,
            phases=(QUEUED,),
            calls=("share_prefix",),
        ),
        Rule(
            "prefill_done",
            R,
            "P",
            "prefilling (P)",
            "first token sampled (not in the KV); P sends ready to D",
            ("prefill_done",),
            None,
            prefill_done_pull,
            phases=(PREFILLING,),
            calls=("publish_prefix",),
        ),
        *PREFIX_RULES,
        DECODE,
        Rule(
            "finish",
            R,
            "D",
            "committed (C), live, max_new_tokens tokens produced",
            "the generation finishes; cleanup (D frees its target; P its source if the release has not come)",
            ("finish",),
            may_finish,
            _end_with(FINISHED, None),
            phases=(COMMITTED,),
            calls=CLEANUP,
        ),
        Rule(
            "p_lease",
            R,
            "P",
            "committed, P still holds the source, no transfer reads it (release late or lost)",
            "P's source lease expires: P frees the source",
            ("free",),
            source_lease_over,
            p_lease,
            fault="timeout",
            phases=(COMMITTED,),
        ),
        Rule(
            "lease_expire",
            R,
            "P",
            "heartbeat: prefilled (F), P holds the source, D's heartbeats stopped "
            "(D restarted since P sent ready)",
            "P's source lease expires: P frees the source and the router fails the generation; cleanup",
            ("free", "fail"),
            heartbeat_stopped,
            lease_expire,
            fault="timeout",
            phases=(PREFILLED,),
            calls=CLEANUP,
        ),
        CANCEL,
        _expire("prefilled (F) and no ready", PREFILLED, ready_gone),
        TIMEOUT,
        *TRANSFER_RULES,
        NEXT_CHUNK,
        _on_xfer_done("D", "D commits and sends release to P", "commit", on_xfer_done_pull),
        ON_XFER_FAILED,
        *MESSAGE_RULES,
        Rule(
            "recv_ready",
            H,
            "D",
            "ready: same generation, live, prefilled (F)",
            "D reserves and starts reading at once if it has free blocks, else queues the generation (W)",
            ("reserve", "transfer_start"),
            ready_awaited,
            recv_ready,
        ),
        Rule(
            "recv_release",
            H,
            "P",
            "release: same generation, P holds the source of this incarnation, transfer done",
            "P frees the source",
            ("free",),
            release_awaited,
            recv_release,
        ),
        *WORKER_RULES,
        *CLEANUP_RULES,
    ),
    phases=(QUEUED, PREFILLING, PREFILLED, WAITING, TRANSFERRING, COMMITTED),
)

#: The reference protocol: both families, by policy.
REFERENCE = RuleBook(push=PUSH, pull=PULL)
