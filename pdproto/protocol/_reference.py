"""The reference P->D handoff model: a pure, sans-IO state machine.

Components (see docs/protocol.md):

- the **router** (coordinator): admits a generation of a request, picks its
  P and D worker, owns its lifecycle (the cancellation token every worker
  checks before doing anything for it), its handoff deadline and retries;
- **P workers** and **D workers**, each with a pool of ``config.blocks``
  blocks and an incarnation number that grows on restart;
- the **transfer engine** (data plane): one transfer per generation, from
  P's source blocks into D's target blocks; it completes, fails, or is
  aborted by its initiator (P in push, D in pull);
- **control messages** in flight: ``notify`` (push, P->D: the KV has landed,
  here is the first token), ``ready`` (pull, P->D: prefill is over, come and
  read) and ``release`` (pull, D->P: your source blocks were read).  Each
  message carries the request generation and its sender's incarnation; a
  message of another generation or of an old incarnation is dropped.

Two protocol families, chosen by ``config.mode``:

- **push**: D reserves target blocks under a ticket, P prefills, P writes
  into D, P frees its source on completion and notifies D, D commits and
  decodes;
- **pull**: P prefills and tells D, D reserves target blocks under a ticket
  and reads from P, D commits on completion and tells P to free its source.

Faults are actions with per-run budgets (``config.faults``): client cancel,
duplicate, lost and reordered messages, worker restart, timeouts, transfer
failure and retry.  A timer whose guarded wait can no longer end by itself
(the awaited message was lost or dropped) expires without a budget, so no
request is ever stuck.

The state is a tuple of small tuples (see :class:`HState`); ``actions``
lists the enabled moves in a fixed order and ``step`` returns the next
state and the history events (format v1) it emitted.  The model never
judges itself: the :class:`~pdproto.Monitor` does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

from ._config import FAULT_KINDS, ModelConfig
from ..spec._events import (
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    Free,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
)
from ..spec._history import HistoryHeader, WorkerSpec
from ._model import Action, ActionNotEnabled, Renaming

__all__ = [
    "HandoffModel",
    "Handoff",
    "HState",
    "Req",
    "Xfer",
    "Msg",
    "transition_table",
    "transition_table_markdown",
]

_CANCEL, _DUP, _LOSS, _REORDER, _RESTART, _TIMEOUT, _XFAIL, _RETRY = range(8)
assert FAULT_KINDS == ("cancel", "dup", "loss", "reorder", "restart", "timeout", "transfer_fail", "retry")

#: Phases of a generation (the router's view), in order.
PHASES = {
    "-": "not submitted",
    "Q": "queued at the router",
    "R": "(push) D blocks reserved under a ticket",
    "P": "prefilling on P",
    "F": "(pull) prefilled; P told D",
    "W": "(pull) queued at D",
    "X": "transfer started",
    "C": "committed on D; decoding",
}
#: How a generation ended ("" while live).
ENDS = {"": "live", "f": "finished", "c": "cancelled", "x": "failed"}


class Req(NamedTuple):
    """One request's current generation, as every component sees it."""

    gen: int = -1  # -1: not submitted yet
    ph: str = "-"  # phase, see PHASES (kept when the generation ends)
    end: str = ""  # "" live, "f" finished, "c" cancelled, "x" failed
    p: int = -1  # P worker index
    d: int = -1  # D worker index (global worker index)
    src: tuple = ()  # source blocks held on P
    pinc: int = 0  # P's incarnation when it took them
    dst: tuple = ()  # target blocks held on D
    dinc: int = 0  # D's incarnation when it took them
    xs: int = 0  # transfer: 0 none, 1 in flight, 2 done, 3 failed
    ndec: int = 0  # decode steps done


class Xfer(NamedTuple):
    """A transfer in flight (reading and writing until it ends)."""

    r: int
    gen: int
    p: int
    src: tuple
    d: int
    dst: tuple
    aborted: bool = False
    doomed: bool = False  # an endpoint restarted: it can only fail now
    dst_lost: bool = False  # the target restarted: its blocks are quarantined


class Msg(NamedTuple):
    """A control message in flight."""

    kind: str  # notify | ready | release
    r: int
    gen: int
    frm: int  # sender worker index
    inc: int  # sender incarnation
    to: int  # receiver worker index


class HState(NamedTuple):
    reqs: tuple  # of Req, one per request
    xfers: tuple  # of Xfer, in start order
    msgs: tuple  # of Msg, in send order (index 0 is the oldest)
    inc: tuple  # incarnation per worker (P workers first, then D workers)
    budget: tuple  # remaining budget per fault kind, in FAULT_KINDS order


_new = tuple.__new__


def _xf(s: "HState", xfers: tuple) -> "HState":
    return _new(HState, (s[0], xfers, s[2], s[3], s[4]))


def _ms(s: "HState", msgs: tuple) -> "HState":
    return _new(HState, (s[0], s[1], msgs, s[3], s[4]))


class _Ren(Renaming):
    """A Renaming whose ``key()`` is the compact permutation it came from
    (the explorer keys its cache of renamed monitor states by it)."""

    __slots__ = ("_key",)

    def key(self) -> tuple:
        return self._key  # type: ignore[attr-defined, no-any-return]


def _rq(q: "Req", i: int, v: Any) -> "Req":
    """``q`` with field ``i`` set to ``v`` (a fast ``_replace`` of one field)."""
    return _new(Req, q[:i] + (v,) + q[i + 1 :])


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class HandoffModel:
    """The reference handoff model built from a :class:`ModelConfig`.

    Satisfies :class:`pdproto.Model`.  Mutants subclass it and override one
    hook (the methods whose names start with ``_can_`` / ``_on_`` or the
    small policy methods below).
    """

    name = "reference"

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config = config or ModelConfig.all_faults(1)
        self.mode = config.mode
        self.push = config.mode == "push"
        self.np = config.prefill_workers
        self.nd = config.decode_workers
        self.nblocks = config.blocks
        self.bs = config.block_size
        self.prompt_len = config.prompt_len
        self.max_new = config.max_new_tokens
        self.nsrc = config.blocks_per_request
        # D keeps room for the prompt and every decoded position
        self.ndst = max(self.nsrc, _ceil(config.prompt_len + config.max_new_tokens - 1, config.block_size))
        self.wname = tuple(f"P{i}" for i in range(self.np)) + tuple(f"D{i}" for i in range(self.nd))
        self.rname = tuple(f"r{i}" for i in range(config.requests))
        workers = {f"P{i}": WorkerSpec("prefill", config.blocks) for i in range(self.np)}
        workers.update({f"D{i}": WorkerSpec("decode", config.blocks) for i in range(self.nd)})
        self.header = HistoryHeader(
            policy=config.mode, complete=True, workers=workers, extra={"block_size": config.block_size}
        )
        self.budget0 = tuple(config.faults[k] for k in FAULT_KINDS)
        self._cache_state: Any = None
        self._cache_acts: tuple = ()
        self._sym_memo: dict = {}
        self._renamings: dict = {}
        # interned actions and ids (the hot path builds no Action and no id string)
        self._interned: dict = {}
        self._handler: dict = {}
        self._req_cache: dict = {}
        self._xfer_cache: dict = {}
        self._msg_cache: dict = {}
        self._tids: dict = {}
        self._tks: dict = {}
        self._ridx = {n: i for i, n in enumerate(self.rname)}
        self._widx = {n: i for i, n in enumerate(self.wname)}
        self._submit_acts = tuple(
            tuple(
                self._act("submit", "client", (self.rname[r], self.wname[p], self.wname[self.np + d]))
                for p in range(self.np)
                for d in range(self.nd)
            )
            for r in range(config.requests)
        )
        self._restart_acts = tuple(self._act("restart", wn, (wn,), True) for wn in self.wname)
        self._wperms = self._worker_perms()
        self._ident_b = tuple(b for _ in self.wname for b in range(self.nblocks))
        self._plain = (
            self.np == 1 and self.nd == 1 and (self.nblocks == 1 or not self.SYMMETRIC_BLOCKS)
            and self.SYMMETRIC_REQUESTS
        )
        self.invariants = {"exclusive-blocks": self._exclusive_blocks}
        self.sometimes = self._make_sometimes()

    # -- ids and values --------------------------------------------------

    def ticket(self, r: int, gen: int) -> str:
        return f"t:{self.rname[r]}:{gen}"

    def transfer_id(self, r: int, gen: int) -> str:
        return f"x:{self.rname[r]}:{gen}:0"

    def first_token(self, r: int, gen: int) -> int:
        # Depends on the generation only, not on the request: symmetry
        # reduction renames requests, and a token value tied to a request
        # could not be renamed with it (Renaming maps ids, not tokens).  The
        # monitor compares tokens only within one generation.
        return 100 + gen

    # -- Model interface -------------------------------------------------

    def initial_states(self) -> tuple[HState, ...]:
        reqs = tuple(Req() for _ in range(self.config.requests))
        return (HState(reqs, (), (), (0,) * (self.np + self.nd), self.budget0),)

    def actions(self, state: HState) -> tuple[Action, ...]:
        if state is self._cache_state:
            return self._cache_acts
        acts = tuple(self._actions(state))
        self._cache_state = state
        self._cache_acts = acts
        return acts

    def step(self, state: HState, action: Action) -> tuple[HState, tuple[Event, ...]]:
        if state is not self._cache_state:
            self.actions(state)
        for a in self._cache_acts:  # the interned actions: identity first
            if a is action:
                break
        else:
            if action not in self._cache_acts:
                raise ActionNotEnabled(action, self._cache_acts)
            action = self._cache_acts[self._cache_acts.index(action)]
        ev: list[Event] = []
        nstate = self._handler[id(action)](state, action, ev)
        return nstate, tuple(ev)

    # -- helpers ---------------------------------------------------------

    def free_blocks(self, state: HState, w: int) -> list[int]:
        used = set()
        for q in state.reqs:
            if q.p == w:
                used.update(q.src)
            if q.d == w:
                used.update(q.dst)
        used.update(self.quarantined(state, w))
        return [b for b in range(self.nblocks) if b not in used]

    def quarantined(self, state: HState, w: int) -> tuple[int, ...]:
        """Blocks of D worker ``w`` that a write of an old incarnation can still land on."""
        out: tuple[int, ...] = ()
        for x in state.xfers:
            if x.d == w and x.dst_lost:
                out += x.dst
        return out

    def _xfer_of(self, state: HState, r: int) -> int:
        for i, x in enumerate(state.xfers):
            if x.r == r and x.gen == state.reqs[r].gen:
                return i
        return -1

    def _has_msg(self, state: HState, r: int, gen: int) -> bool:
        for m in state.msgs:
            if m.r == r and m.gen == gen:
                return True
        return False

    @staticmethod
    def _set(state: HState, r: int, q: Req) -> HState:
        reqs, xfers, msgs, inc, budget = state
        return _new(HState, (reqs[:r] + (q,) + reqs[r + 1 :], xfers, msgs, inc, budget))

    @staticmethod
    def _spend(state: HState, k: int) -> HState:
        reqs, xfers, msgs, inc, b = state
        return _new(HState, (reqs, xfers, msgs, inc, b[:k] + (b[k] - 1,) + b[k + 1 :]))

    def _end(self, q: Req, r: int, how: str, ev: list, reason: str | None = None) -> Req:
        name = self.rname[r]
        if how == "c":
            ev.append(Cancel(name, q.gen, reason))
        elif how == "x":
            ev.append(Fail(name, q.gen, reason))
        else:
            ev.append(Finish(name, q.gen, reason))
        return _rq(q, 2, how)

    def _finish_gen(self, s: HState, r: int, how: str, ev: list, reason: str | None = None) -> HState:
        """End generation ``r`` (the router's token) and clean up at once."""
        q = self._end(s.reqs[r], r, how, ev, reason)
        return self._cleanup(self._set(s, r, q), r, ev)

    def _cleanup(self, s: HState, r: int, ev: list) -> HState:
        """every worker | the generation ended (any path), or its transfer ended after it did | every worker sees the token: the initiator aborts a transfer in flight; blocks no transfer can still touch are freed, the rest when the transfer ends | transfer_abort, free"""
        q = s.reqs[r]
        xi = self._xfer_of(s, r)
        if xi >= 0:
            x = s.xfers[xi]
            if not x.aborted and not x.doomed:
                ev.append(TransferAbort(self._tid(x.r, x.gen)))
                s = _xf(s, s.xfers[:xi] + (_new(Xfer, x[:6] + (True,) + x[7:]),) + s.xfers[xi + 1 :])
        if q.src and self._can_p_free(s, r, q, xi):
            ev.append(Free(self.wname[q.p], q.src, self.rname[r], q.gen))
            q = _rq(q, 5, ())
        if q.dst and self._can_d_free(s, r, q, xi):
            ev.append(Free(self.wname[q.d], q.dst, self.rname[r], q.gen))
            q = _rq(q, 7, ())
        return self._set(s, r, q)

    # -- enabled actions -------------------------------------------------

    def _act(self, kind: str, actor: str, args: tuple, fault: bool = False) -> Action:
        """The interned Action (one object per distinct action of this model),
        with its handler noted for :meth:`step`."""
        key = (kind, actor, args, fault)
        a = self._interned.get(key)
        if a is None:
            a = self._interned[key] = Action(kind, actor, args, fault)
            self._handler[id(a)] = getattr(self, "_do_" + kind)
        return a

    def _req_acts(self, r: int, p: int, d: int) -> tuple[Action, ...]:
        """Request ``r``'s actions when routed to P worker ``p`` and D worker ``d``."""
        key = (r, p, d)
        acts = self._req_cache.get(key)
        if acts is None:
            name = (self.rname[r],)
            pn, dn, A = self.wname[p], self.wname[d], self._act
            acts = self._req_cache[key] = (
                A("reserve", dn, name),
                A("prefill_start", pn, name),
                A("prefill_done", pn, name),
                A("decode", dn, name),
                A("finish", dn, name),
                A("p_lease", pn, name, True),
                A("cancel", "client", name, True),
                A("expire", "router", name),
                A("timeout", "router", name, True),
                A("retry", "router", name, True),
            )
        return acts

    def _xfer_acts(self, r: int, gen: int) -> tuple[Action, ...]:
        key = (r, gen)
        acts = self._xfer_cache.get(key)
        if acts is None:
            tid = (self._tid(r, gen),)
            A = self._act
            acts = self._xfer_cache[key] = (
                A("xfer_done", "xfer", tid), A("xfer_fail", "xfer", tid), A("xfer_fail", "xfer", tid, True)
            )
        return acts

    def _msg_acts(self, i: int, m: Msg) -> tuple[Action, ...]:
        key = (i, m.kind, m.r, m.gen)
        acts = self._msg_cache.get(key)
        if acts is None:
            label = (i, m.kind, self.rname[m.r], m.gen)
            A = self._act
            acts = self._msg_cache[key] = (
                A("deliver", "net", label), A("deliver", "net", label, True),
                A("dup", "net", label, True), A("lose", "net", label, True),
            )
        return acts

    def _tid(self, r: int, gen: int) -> str:
        """``transfer_id(r, gen)``, one string object per id."""
        key = (r, gen)
        t = self._tids.get(key)
        if t is None:
            t = self._tids[key] = self.transfer_id(r, gen)
        return t

    def _tk(self, r: int, gen: int) -> str:
        """``ticket(r, gen)``, one string object per id."""
        key = (r, gen)
        t = self._tks.get(key)
        if t is None:
            t = self._tks[key] = self.ticket(r, gen)
        return t

    def _actions(self, s: HState) -> list[Action]:
        push = self.push
        reqs, xfers, msgs, _, budget = s
        out: list[Action] = []
        add = out.append
        # client: submit the next request (requests arrive in order)
        for r, q in enumerate(reqs):
            if q.gen < 0:
                out.extend(self._submit_acts[r])
                break
        b_timeout, b_cancel = budget[_TIMEOUT], budget[_CANCEL]
        for r, q in enumerate(reqs):
            if q.gen < 0:
                continue
            A = self._req_acts(r, q.p, q.d)
            ph = q.ph
            if q.end == "":
                if push:
                    if ph == "Q" and len(self.free_blocks(s, q.d)) >= self.ndst:
                        add(A[0])
                    if self._can_prefill_start(s, q):
                        add(A[1])
                    elif ph == "P":
                        add(A[2])
                else:
                    if ph == "Q" and len(self.free_blocks(s, q.p)) >= self.nsrc:
                        add(A[1])
                    elif ph == "P":
                        add(A[2])
                    elif ph == "W" and len(self.free_blocks(s, q.d)) >= self.ndst:
                        add(A[0])
                if ph == "C":
                    add(A[3] if 1 + q.ndec < self.max_new else A[4])
                if b_timeout and self._can_p_lease(s, r, q):
                    add(A[5])
                if b_cancel:
                    add(A[6])
                if ph != "C":
                    if self._deadline_necessary(s, r, q):
                        add(A[7])
                    elif b_timeout:
                        add(A[8])
        # data plane
        for x in xfers:
            X = self._xfer_acts(x.r, x.gen)
            if not x.doomed:
                add(X[0])
            if x.aborted or x.doomed:
                add(X[1])
            elif budget[_XFAIL]:
                add(X[2])
        # network
        if msgs:
            b_reorder, b_dup, b_loss = budget[_REORDER], budget[_DUP], budget[_LOSS]
            for i, m in enumerate(msgs):
                M = self._msg_acts(i, m)
                if i == 0:
                    add(M[0])
                elif b_reorder:
                    add(M[1])
                if b_dup and (i == 0 or b_reorder):
                    add(M[2])
                if b_loss:
                    add(M[3])
        if budget[_RESTART]:
            for w, a in enumerate(self._restart_acts):
                if self._restart_matters(s, w):
                    add(a)
        # router: retries
        if budget[_RETRY]:
            for r, q in enumerate(reqs):
                if self._can_retry(s, r, q):
                    add(self._req_acts(r, q.p, q.d)[9])
        return out

    # -- guards (mutants override these) ---------------------------------

    def _can_prefill_start(self, s: HState, q: Req) -> bool:
        """push: P prefills only under an open reservation."""
        return q.ph == "R" and len(self.free_blocks(s, q.p)) >= self.nsrc

    def _can_p_free(self, s: HState, r: int, q: Req, xi: int) -> bool:
        """P frees the source of an ended generation once no transfer reads it."""
        return xi < 0

    def _can_d_free(self, s: HState, r: int, q: Req, xi: int) -> bool:
        """D frees the target of an ended generation once no transfer writes it."""
        return xi < 0

    def _can_p_lease(self, s: HState, r: int, q: Req) -> bool:
        """(pull) P's source lease: it may expire once D committed (the read
        is over) while the release message is late or lost."""
        return (not self.push) and q.ph == "C" and bool(q.src) and self._xfer_of(s, r) < 0

    def _can_retry(self, s: HState, r: int, q: Req) -> bool:
        """A failed generation is retried once its cleanup is over."""
        return q.gen >= 0 and q.end == "x" and not q.src and not q.dst and self._xfer_of(s, r) < 0

    def _deadline_necessary(self, s: HState, r: int, q: Req) -> bool:
        """The handoff deadline must expire: the awaited message is gone."""
        if self.push:
            return q.ph == "X" and q.xs == 2 and not self._has_msg(s, r, q.gen)
        return q.ph == "F" and not self._has_msg(s, r, q.gen)

    def _restart_matters(self, s: HState, w: int) -> bool:
        """Restarting an idle worker is an uninteresting no-op: skip it."""
        for q in s.reqs:
            if q.gen >= 0 and (q.p == w or q.d == w) and (q.end == "" or q.src or q.dst):
                return True
        for x in s.xfers:
            if x.p == w or x.d == w:
                return True
        return False

    # -- action handlers: docstrings feed the transition table --------------
    # Each docstring: "ACTOR | GUARD | EFFECT | EVENTS" (modes: [push] / [pull]).

    def _do_submit(self, s: HState, a: Action, ev: list) -> HState:
        """client | request not yet submitted (requests arrive in order) | gen 0 queued at the router, routed to a P and a D worker | submit"""
        r = self._ridx[a.args[0]]
        p = self._widx[a.args[1]]
        d = self._widx[a.args[2]]
        ev.append(Submit(a.args[0], 0, self.prompt_len, self.max_new))
        return self._set(s, r, Req(gen=0, ph="Q", p=p, d=d))

    def _do_retry(self, s: HState, a: Action, ev: list) -> HState:
        """router | [fault: retry] the generation failed and its cleanup is over | a new generation gen+1 is queued; fresh ticket and transfer ids | submit"""
        r = self._ridx[a.args[0]]
        q = s.reqs[r]
        ev.append(Submit(a.args[0], q.gen + 1, self.prompt_len, self.max_new))
        return self._spend(self._set(s, r, Req(gen=q.gen + 1, ph="Q", p=q.p, d=q.d)), _RETRY)

    def _do_reserve(self, s: HState, a: Action, ev: list) -> HState:
        """D | [push] queued (Q) and D has free blocks; [pull] queued at D (W) and D has free blocks | D takes target blocks under ticket t:r:gen; [pull] D starts reading from P | reserve; [pull] transfer_start"""
        return self._reserve(s, self._ridx[a.args[0]], ev)

    def _reserve(self, s: HState, r: int, ev: list) -> HState:
        q = s.reqs[r]
        blocks = tuple(self._pick_blocks(s, q.d, self.ndst))
        name = self.rname[r]
        tk = self._tk(r, q.gen)
        ev.append(Reserve(name, q.gen, tk, self.wname[q.d], blocks))
        q = q._replace(dst=blocks, dinc=s.inc[q.d])
        if self.push:
            return self._set(s, r, _rq(q, 1, "R"))
        return self._start_transfer(s, r, _rq(q, 1, "X"), ev)

    def _pick_blocks(self, s: HState, w: int, n: int) -> list[int]:
        return self.free_blocks(s, w)[:n]

    def _start_transfer(self, s: HState, r: int, q: Req, ev: list) -> HState:
        dst = q.dst[: self.nsrc]
        ev.append(
            TransferStart(
                self._tid(r, q.gen),
                self._tk(r, q.gen),
                self.rname[r],
                q.gen,
                self.wname[q.p],
                q.src,
                self.wname[q.d],
                dst,
            )
        )
        x = Xfer(r, q.gen, q.p, q.src, q.d, dst)
        s = self._set(s, r, _rq(q, 9, 1))
        return _xf(s, s.xfers + (x,))

    def _do_prefill_start(self, s: HState, a: Action, ev: list) -> HState:
        """P | [push] reserved (R) and P has free blocks; [pull] queued (Q) and P has free blocks | P takes source blocks and prefills | prefill_start"""
        r = self._ridx[a.args[0]]
        q = s.reqs[r]
        blocks = tuple(self.free_blocks(s, q.p)[: self.nsrc])
        ev.append(PrefillStart(self.rname[r], q.gen, self.wname[q.p], blocks))
        return self._set(s, r, q._replace(ph="P", src=blocks, pinc=s.inc[q.p]))

    def _do_prefill_done(self, s: HState, a: Action, ev: list) -> HState:
        """P | prefilling (P) | first token sampled (not in the KV); [push] P starts writing into D's ticket blocks; [pull] P sends ready to D | prefill_done; [push] transfer_start"""
        r = self._ridx[a.args[0]]
        q = s.reqs[r]
        ev.append(PrefillDone(self.rname[r], q.gen, self.wname[q.p], self.first_token(r, q.gen), self.prompt_len))
        if self.push:
            return self._start_transfer(s, r, _rq(q, 1, "X"), ev)
        m = Msg("ready", r, q.gen, q.p, s.inc[q.p], q.d)
        s = self._set(s, r, _rq(q, 1, "F"))
        return _ms(s, s.msgs + (m,))

    def _do_xfer_done(self, s: HState, a: Action, ev: list) -> HState:
        """xfer | transfer in flight (aborted or not), neither endpoint restarted | every read and write landed and the initiator's completion handler runs: an ended generation gets its cleanup, a live one goes on; [push] P frees its source and sends notify to D; [pull] D commits and sends release to P | transfer_read_done, transfer_write_done; [push] free; [pull] commit"""
        i = self._xfer_index(s, a.args[0])
        x = s.xfers[i]
        tid = a.args[0]
        ev.append(TransferReadDone(tid))
        ev.append(TransferWriteDone(tid))
        s = _xf(s, s.xfers[:i] + s.xfers[i + 1 :])
        q = s.reqs[x.r]
        q = _rq(q, 9, 2)
        return self._on_xfer_done(s, x, q, ev)

    def _on_xfer_done(self, s: HState, x: Xfer, q: Req, ev: list) -> HState:
        r = x.r
        name = self.rname[r]
        if q.end != "":
            return self._cleanup(self._set(s, r, q), r, ev)
        if self.push:
            if q.src:
                ev.append(Free(self.wname[q.p], q.src, name, q.gen))
                q = _rq(q, 5, ())
            s = self._set(s, r, q)
            return _ms(s, s.msgs + (Msg("notify", r, q.gen, q.p, s.inc[q.p], q.d),))
        return self._commit(s, r, q, ev, self._tk(r, q.gen), send_release=True)

    def _commit(self, s: HState, r: int, q: Req, ev: list, ticket: str, send_release: bool = False) -> HState:
        ev.append(Commit(self.rname[r], q.gen, ticket, self.wname[q.d]))
        s = self._set(s, r, _rq(q, 1, "C"))
        if send_release:
            s = _ms(s, s.msgs + (Msg("release", r, q.gen, q.d, s.inc[q.d], q.p),))
        return s

    def _xfer_index(self, s: HState, tid: str) -> int:
        for i, x in enumerate(s.xfers):
            if self._tid(x.r, x.gen) == tid:
                return i
        raise KeyError(tid)

    def _do_xfer_fail(self, s: HState, a: Action, ev: list) -> HState:
        """xfer | aborted or an endpoint restarted; or [fault: transfer_fail] any transfer in flight | the transfer ends without success; the initiator fails a live generation; cleanup | transfer_failed, fail, free"""
        i = self._xfer_index(s, a.args[0])
        x = s.xfers[i]
        ev.append(TransferFailed(a.args[0]))
        if a.fault:
            s = self._spend(s, _XFAIL)
        s = _xf(s, s.xfers[:i] + s.xfers[i + 1 :])
        q = _rq(s.reqs[x.r], 9, 3)
        return self._on_xfer_failed(s, x, q, ev)

    def _on_xfer_failed(self, s: HState, x: Xfer, q: Req, ev: list) -> HState:
        s = self._set(s, x.r, q)
        if q.end == "":
            return self._finish_gen(s, x.r, "x", ev, "transfer_failed")
        return self._cleanup(s, x.r, ev)

    def _do_p_lease(self, s: HState, a: Action, ev: list) -> HState:
        """P | [pull] [fault: timeout] committed, P still holds the source, no transfer reads it (release late or lost) | P's source lease expires: P frees the source | free"""
        r = self._ridx[a.args[0]]
        q = s.reqs[r]
        ev.append(Free(self.wname[q.p], q.src, self.rname[r], q.gen))
        return self._spend(self._set(s, r, _rq(q, 5, ())), _TIMEOUT)

    def _do_deliver(self, s: HState, a: Action, ev: list) -> HState:
        """net | a message in flight: the oldest, or [fault: reorder] any other | the receiver handles it (below); a message of another generation, an ended one, or an old incarnation is dropped | see the message rows"""
        i = a.args[0]
        m = s.msgs[i]
        s = _ms(s, s.msgs[:i] + s.msgs[i + 1 :])
        if a.fault:
            s = self._spend(s, _REORDER)
        return self._receive(s, m, ev)

    def _do_dup(self, s: HState, a: Action, ev: list) -> HState:
        """net | [fault: dup] a message in flight (not the oldest: also reorder) | the receiver handles it and the message stays in flight | see the message rows"""
        i = a.args[0]
        m = s.msgs[i]
        s = self._spend(s, _DUP)
        if i:
            s = self._spend(s, _REORDER)
        return self._receive(s, m, ev)

    def _do_lose(self, s: HState, a: Action, ev: list) -> HState:
        """net | [fault: loss] a message in flight | the message is gone | (none)"""
        i = a.args[0]
        s = _ms(s, s.msgs[:i] + s.msgs[i + 1 :])
        return self._spend(s, _LOSS)

    def _receive(self, s: HState, m: Msg, ev: list) -> HState:
        q = s.reqs[m.r]
        if m.inc != s.inc[m.frm]:
            return s  # from an old incarnation: stale
        return getattr(self, "_recv_" + m.kind)(s, m, q, ev)

    def _recv_notify(self, s: HState, m: Msg, q: Req, ev: list) -> HState:
        """D | [push] notify: same generation, live, awaiting (X), transfer done, D still holds the ticket blocks of this incarnation | D commits | commit"""
        if (
            q.gen == m.gen
            and q.end == ""
            and q.ph == "X"
            and q.xs == 2
            and q.dst
            and q.dinc == s.inc[q.d]
            and m.to == q.d
        ):
            return self._commit(s, m.r, q, ev, self._tk(m.r, q.gen))
        return s

    def _recv_ready(self, s: HState, m: Msg, q: Req, ev: list) -> HState:
        """D | [pull] ready: same generation, live, prefilled (F) | D reserves and starts reading at once if it has free blocks, else queues the generation (W) | reserve, transfer_start"""
        if q.gen == m.gen and q.end == "" and q.ph == "F":
            if len(self.free_blocks(s, q.d)) >= self.ndst:
                return self._reserve(s, m.r, ev)
            return self._set(s, m.r, _rq(q, 1, "W"))
        return s

    def _recv_release(self, s: HState, m: Msg, q: Req, ev: list) -> HState:
        """P | [pull] release: same generation, P holds the source of this incarnation, transfer done | P frees the source | free"""
        if q.gen == m.gen and q.src and q.pinc == s.inc[q.p] and q.xs == 2 and self._xfer_of(s, m.r) < 0:
            ev.append(Free(self.wname[q.p], q.src, self.rname[m.r], q.gen))
            return self._set(s, m.r, _rq(q, 5, ()))
        return s

    def _do_decode(self, s: HState, a: Action, ev: list) -> HState:
        """D | committed (C), live, fewer than max_new_tokens tokens so far | one decode step: the first feeds the first token at position prompt_len | decode"""
        r = self._ridx[a.args[0]]
        q = s.reqs[r]
        pos, tok = self._decode_input(r, q)
        blocks = q.dst[: _ceil(pos + 1, self.bs)]
        ev.append(Decode(self.rname[r], q.gen, self.wname[q.d], pos, tok, tok + 1, blocks))
        return self._set(s, r, _rq(q, 10, q.ndec + 1))

    def _decode_input(self, r: int, q: Req) -> tuple[int, int]:
        """(position, input token) of the next decode step."""
        return self.prompt_len + q.ndec, self.first_token(r, q.gen) + q.ndec

    def _do_finish(self, s: HState, a: Action, ev: list) -> HState:
        """D | committed (C), live, max_new_tokens tokens produced | the generation finishes; cleanup: D frees its target; [pull] P frees its source if the release has not come | finish, free"""
        r = self._ridx[a.args[0]]
        return self._finish_gen(s, r, "f", ev)

    def _do_cancel(self, s: HState, a: Action, ev: list) -> HState:
        """client | [fault: cancel] a live generation, any phase | the generation is cancelled; cleanup | cancel, transfer_abort, free"""
        r = self._ridx[a.args[0]]
        return self._spend(self._finish_gen(s, r, "c", ev), _CANCEL)

    def _do_timeout(self, s: HState, a: Action, ev: list) -> HState:
        """router | [fault: timeout] a live generation before commit | the handoff deadline expires early: the generation fails; cleanup | fail, transfer_abort, free"""
        r = self._ridx[a.args[0]]
        return self._spend(self._finish_gen(s, r, "x", ev, "timeout"), _TIMEOUT)

    def _do_expire(self, s: HState, a: Action, ev: list) -> HState:
        """router | a live generation before commit whose awaited message is gone (lost, or dropped as stale); [push] transfer done and no notify in flight; [pull] prefilled (F) and no ready in flight | the handoff deadline expires: the generation fails; cleanup | fail, free"""
        r = self._ridx[a.args[0]]
        return self._finish_gen(s, r, "x", ev, "deadline")

    def _do_restart(self, s: HState, a: Action, ev: list) -> HState:
        """worker | [fault: restart] a worker holding state | incarnation+1, its blocks are gone; its transfers can only fail, the targets they write stay quarantined; the router fails every live generation it held; cleanup on the other workers | restart, fail, free"""
        w = self._widx[a.args[0]]
        inc = s.inc[:w] + (s.inc[w] + 1,) + s.inc[w + 1 :]
        ev.append(Restart(a.args[0], inc[w]))
        xfers = tuple(
            x._replace(doomed=True, dst_lost=x.dst_lost or x.d == w) if (x.p == w or x.d == w) else x
            for x in s.xfers
        )
        reqs = list(s.reqs)
        ended = []
        for r, q in enumerate(reqs):
            if q.gen < 0:
                continue
            involved = (q.p == w and (bool(q.src) or q.ph == "P")) or (q.d == w and (bool(q.dst) or q.ph == "W"))
            involved = involved or any(x.r == r and x.gen == q.gen and (x.p == w or x.d == w) for x in s.xfers)
            if q.p == w:
                q = _rq(q, 5, ())
            if q.d == w:
                q = _rq(q, 7, ())
            if q.end == "" and involved and (q.ph != "C" or q.d == w):
                q = self._end(q, r, "x", ev, "restart")
                ended.append(r)
            reqs[r] = q
        s = s._replace(inc=inc, xfers=xfers, reqs=tuple(reqs))
        for r in ended:
            s = self._cleanup(s, r, ev)
        return self._after_restart(self._spend(s, _RESTART), w)

    def _after_restart(self, s: HState, w: int) -> HState:
        return s

    # -- symmetry reduction ---------------------------------------------
    #
    # Requests (with their ticket and transfer ids), the blocks of one pool and
    # the workers of one role are interchangeable: the model uses request and
    # worker indices and block ids only for equality (and blocks lowest-first
    # among the free ones, which are blank: held by nobody, written by no live
    # transfer, not tracked by the monitor), so renaming them maps every run
    # to a run with the renamed events, which the monitor judges alike.
    # ``symmetry`` picks one renaming per state deterministically and returns
    # it with the renamed state; the explorer applies it to the monitor's key.
    # A mutant whose free blocks are not blank (the monitor still tracks a
    # write into a block the model hands out again) sets SYMMETRIC_BLOCKS off.

    #: rename submitted requests (the unsubmitted ones form the tail and stay)
    SYMMETRIC_REQUESTS = True
    #: renumber the blocks of each pool
    SYMMETRIC_BLOCKS = True
    #: permute the workers of one role
    SYMMETRIC_WORKERS = True
    _SYM_MEMO_LIMIT = 1 << 20

    def _worker_perms(self) -> tuple[tuple[int, ...], ...]:
        from itertools import permutations

        if not self.SYMMETRIC_WORKERS:
            return (tuple(range(self.np + self.nd)),)
        np_ = self.np
        out = []
        for pp in permutations(range(np_)):
            for dp in permutations(range(np_, np_ + self.nd)):
                out.append(pp + dp)
        return tuple(out)

    def symmetry(self, state: HState) -> tuple[Any, Renaming | None]:
        """``(canonical_state, renaming)`` (see docs/modeling.md): the renamed
        state and the renaming of request, ticket, transfer and worker names
        and of block ids that produced it (``None`` when it is the identity)."""
        if self._plain:
            return self._symmetry_plain(state)
        memo = self._sym_memo
        hit = memo.get(state)
        if hit is None:
            hit = self._symmetry(state)
            if len(memo) >= self._SYM_MEMO_LIMIT:
                memo.clear()
            memo[state] = hit
        return hit

    def _symmetry_plain(self, state: HState) -> tuple[Any, Renaming | None]:
        """One worker per role and no block renaming (one block per pool, or
        SYMMETRIC_BLOCKS off): only the submitted requests are reordered, by
        their records; worker indices and block ids stay as they are."""
        reqs = state[0]
        if len(reqs) == 2:  # the common case, spelled out
            q0, q1 = reqs
            if q1.gen < 0 or q0 < q1:
                return state, None
            if q1 < q0:
                order: Any = (1, 0)
            else:
                return self._symmetry(state)  # a tie: the full signature decides
        else:
            n = 0
            for q in reqs:
                if q.gen < 0:
                    break
                n += 1
            if n <= 1:
                return state, None
            order = sorted(range(n), key=reqs.__getitem__)
            for i in range(1, n):
                if reqs[order[i - 1]] == reqs[order[i]]:
                    return self._symmetry(state)
            if order == list(range(n)):
                return state, None
            order = tuple(order) + tuple(range(n, len(reqs)))
        rp = [0] * len(order)
        for j, r in enumerate(order):
            rp[r] = j
        reqs_, xfers, msgs, inc, budget = state
        cstate = _new(HState, (
            tuple(reqs_[r] for r in order),
            tuple(_new(Xfer, (rp[x[0]],) + x[1:]) for x in xfers),
            tuple(_new(Msg, (m[0], rp[m[1]]) + m[2:]) for m in msgs),
            inc,
            budget,
        ))
        return cstate, self._renaming((tuple(rp), self._wperms[0], None))

    def _symmetry(self, state: HState) -> tuple[Any, Renaming | None]:
        reqs, xfers, msgs, inc, budget = state
        nreq = len(reqs)
        n = 0
        while n < nreq and reqs[n][0] >= 0:
            n += 1
        nb = self.nblocks
        wperms = self._wperms
        if n <= 1 and (nb == 1 or not self.SYMMETRIC_BLOCKS) and len(wperms) == 1:
            return state, None
        nw = self.np + self.nd
        best = None
        single = len(wperms) == 1
        plain = single and self.np == 1 and self.nd == 1
        ident_r = list(range(n))
        ident_b = self._ident_b
        for wp in wperms:
            # 1. requests, ordered by what they look like (block ids aside)
            order = None
            if n > 1 and self.SYMMETRIC_REQUESTS and plain:
                # one worker per role: a request's own record (block ids
                # aside) usually tells the requests apart; the full
                # signature below is needed only on a tie
                cores = [
                    (q.gen, q.ph, q.end, len(q.src), q.pinc, len(q.dst), q.dinc, q.xs, q.ndec) for q in reqs[:n]
                ]
                if len(set(cores)) == n:
                    order = sorted(range(n), key=cores.__getitem__)
            if order is not None:
                pass
            elif n > 1 and self.SYMMETRIC_REQUESTS:
                sigs = []
                for r in range(n):
                    q = reqs[r]
                    sigs.append((
                        (q.gen, q.ph, q.end, wp[q.p], wp[q.d], len(q.src), q.pinc, len(q.dst), q.dinc, q.xs, q.ndec),
                        tuple((i, m.kind, m.gen, wp[m.frm], m.inc, wp[m.to]) for i, m in enumerate(msgs) if m.r == r),
                        tuple(
                            (i, x.gen, wp[x.p], len(x.src), wp[x.d], len(x.dst), x.aborted, x.doomed, x.dst_lost)
                            for i, x in enumerate(xfers)
                            if x.r == r
                        ),
                        r,
                    ))
                sigs.sort()
                order = [sig[3] for sig in sigs]
            else:
                order = list(range(n))
            rp = [0] * nreq
            for j, r in enumerate(order):
                rp[r] = j
            for r in range(n, nreq):
                rp[r] = r
            # 2. blocks, numbered per pool in the order the renamed state names them
            if self.SYMMETRIC_BLOCKS and nb > 1:
                bm: dict = {}
                nxt = [0] * nw
                for r in order:
                    q = reqs[r]
                    for w, bs in ((q.p, q.src), (q.d, q.dst)):
                        for b in bs:
                            if (w, b) not in bm:
                                bm[(w, b)] = nxt[w]
                                nxt[w] += 1
                for x in xfers:
                    for w, bs in ((x.p, x.src), (x.d, x.dst)):
                        for b in bs:
                            if (w, b) not in bm:
                                bm[(w, b)] = nxt[w]
                                nxt[w] += 1
                for w in range(nw):
                    if nxt[w] < nb:
                        for b in range(nb):
                            if (w, b) not in bm:
                                bm[(w, b)] = nxt[w]
                                nxt[w] += 1
                bperm = tuple(bm[(w, b)] for w in range(nw) for b in range(nb))
            else:
                bperm = None
            # 3. the renamed state
            if single and order == ident_r and (bperm is None or bperm == ident_b):
                return state, None  # already canonical
            if bperm is None:
                creqs = tuple(
                    _new(Req, (q.gen, q.ph, q.end, wp[q.p], wp[q.d], q.src, q.pinc, q.dst, q.dinc, q.xs, q.ndec))
                    for q in (reqs[r] for r in order)
                ) + reqs[n:]
                cx = tuple(
                    _new(Xfer, (rp[x.r], x.gen, wp[x.p], x.src, wp[x.d], x.dst, x.aborted, x.doomed, x.dst_lost))
                    for x in xfers
                )
            else:
                creqs = tuple(
                    _new(Req, (
                        q.gen, q.ph, q.end, wp[q.p], wp[q.d], tuple(bperm[q.p * nb + b] for b in q.src), q.pinc,
                        tuple(bperm[q.d * nb + b] for b in q.dst), q.dinc, q.xs, q.ndec,
                    ))
                    for q in (reqs[r] for r in order)
                ) + reqs[n:]
                cx = tuple(
                    _new(Xfer, (
                        rp[x.r], x.gen, wp[x.p], tuple(bperm[x.p * nb + b] for b in x.src), wp[x.d],
                        tuple(bperm[x.d * nb + b] for b in x.dst), x.aborted, x.doomed, x.dst_lost,
                    ))
                    for x in xfers
                )
            cm = tuple(_new(Msg, (m.kind, rp[m.r], m.gen, wp[m.frm], m.inc, wp[m.to])) for m in msgs)
            cinc = [0] * nw
            for w in range(nw):
                cinc[wp[w]] = inc[w]
            cand = (_new(HState, (creqs, cx, cm, tuple(cinc), budget)), (tuple(rp), wp, bperm))
            if best is None or cand[0] < best[0]:
                best = cand
        assert best is not None
        cstate, rkey = best
        return cstate, self._renaming(rkey)

    def _renaming(self, rkey: tuple) -> Renaming | None:
        """The (cached) Renaming of ``(request perm, worker perm, block perm)``."""
        try:
            return self._renamings[rkey]
        except KeyError:
            pass
        rp, wp, bperm = rkey
        names: dict[str, str] = {}
        for r, j in enumerate(rp):
            if r != j:
                names[self.rname[r]] = self.rname[j]
                for g in range(self.budget0[_RETRY] + 1):
                    names[self.ticket(r, g)] = self.ticket(j, g)
                    names[self.transfer_id(r, g)] = self.transfer_id(j, g)
        for w, v in enumerate(wp):
            if w != v:
                names[self.wname[w]] = self.wname[v]
        blocks: dict[tuple[str, int], int] = {}
        if bperm is not None:
            nb = self.nblocks
            for i, nbk in enumerate(bperm):
                w, b = divmod(i, nb)
                if nbk != b:
                    blocks[(self.wname[w], b)] = nbk
        ren: Renaming | None = None
        if names or blocks:
            ren = _Ren(names, blocks)
            object.__setattr__(ren, "_key", rkey)
        self._renamings[rkey] = ren
        return ren

    # -- properties ------------------------------------------------------

    def _exclusive_blocks(self, s: HState) -> bool:
        seen = set()
        for q in s.reqs:
            for b in q.src:
                if (q.p, b) in seen:
                    return False
                seen.add((q.p, b))
            for b in q.dst:
                if (q.d, b) in seen:
                    return False
                seen.add((q.d, b))
        for x in s.xfers:
            if x.dst_lost:
                for b in x.dst:
                    if (x.d, b) in seen:
                        return False
        return True

    def _make_sometimes(self) -> dict[str, Callable[[HState], bool]]:
        out: dict[str, Callable[[HState], bool]] = {}
        phases = "QRPXC" if self.push else "QPFWXC"
        for ph in phases:
            out[f"phase-{ph}"] = lambda s, ph=ph: any(q.ph == ph for q in s.reqs)
        out["finished"] = lambda s: any(q.end == "f" for q in s.reqs)
        out["all-finished-clean"] = lambda s: all(q.end == "f" and q.gen == 0 for q in s.reqs)
        if self.max_new >= 2:
            out["decoded"] = lambda s: any(q.ndec >= 1 for q in s.reqs)
        for k, kind in enumerate(FAULT_KINDS):
            if self.budget0[k]:
                out[f"fault-{kind}"] = lambda s, k=k: s.budget[k] < self.budget0[k]
        if self.budget0[_RETRY]:
            out["retry-finished"] = lambda s: any(q.gen >= 1 and q.end == "f" for q in s.reqs)
        if self.budget0[_CANCEL]:
            out["cancelled"] = lambda s: any(q.end == "c" for q in s.reqs)
        return out


class Handoff:
    """A mutable facade over :class:`HandoffModel`: ``do(action)`` steps the
    current state and records the events; ``actions`` lists what is enabled."""

    def __init__(self, config: ModelConfig | None = None, model: HandoffModel | None = None) -> None:
        self.model = model or HandoffModel(config)
        self.state = self.model.initial_states()[0]
        self.events: list[Event] = []
        self.trace: list[Action] = []

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.model.actions(self.state)

    def do(self, action: Action | str, *args: Any) -> tuple[Event, ...]:
        """Take ``action`` (an Action, or a kind and args matched against the
        enabled actions, e.g. ``do("reserve", "r0")``)."""
        if isinstance(action, str):
            match = [a for a in self.actions if a.kind == action and a.args[: len(args)] == args]
            if not match:
                raise ActionNotEnabled(Action(action, "?", args), self.actions)
            action = match[0]
        self.state, events = self.model.step(self.state, action)
        self.events.extend(events)
        self.trace.append(action)
        return events

    def run(self, choose: Callable[[tuple[Action, ...]], Action] | None = None, limit: int = 10_000) -> list[Event]:
        """Step until quiet, taking the first non-fault action (or ``choose``'s pick)."""
        for _ in range(limit):
            acts = self.actions
            if not acts:
                break
            if choose is not None:
                act = choose(acts)
            else:
                normal = [a for a in acts if not a.fault]
                if not normal:
                    break
                act = normal[0]
            self.do(act)
        return self.events


# -- the transition table, generated from the handlers' docstrings -------------

_ROW_ORDER = (
    "submit", "reserve", "prefill_start", "prefill_done", "xfer_done", "recv_notify", "recv_ready",
    "recv_release", "decode", "finish", "cancel", "timeout", "expire", "xfer_fail", "cleanup",
    "p_lease", "deliver", "dup", "lose", "restart", "retry",
)


def _mode_text(text: str, mode: str) -> str:
    """Keep the "; "-separated segments of ``text`` that apply to ``mode``:
    a segment starting with "[push]" or "[pull]" applies to that mode only."""
    keep = []
    for part in text.split("; "):
        part = part.strip()
        if part.startswith("[push]") or part.startswith("[pull]"):
            if not part.startswith(f"[{mode}]"):
                continue
            part = part[len(mode) + 2 :].strip()
        if part:
            keep.append(part)
    return "; ".join(keep)


def transition_table(mode: str, model_cls: type = HandoffModel) -> list[dict[str, str]]:
    """Rows ``{action, actor, guard, effect, events}`` of ``mode``'s
    transition table, read from the action handlers' docstrings."""
    rows = []
    for kind in _ROW_ORDER:
        fn = getattr(model_cls, "_do_" + kind, None) or getattr(model_cls, "_" + kind)
        doc = inspect.getdoc(fn) or ""
        doc = " ".join(doc.split())
        actor, guard, effect, events = (f.strip() for f in doc.split(" | "))
        if not _mode_text(guard, mode):
            continue
        name = kind.replace("recv_", "deliver ") if kind.startswith("recv_") else kind
        rows.append(
            {
                "action": name,
                "actor": _mode_text(actor, mode),
                "guard": _mode_text(guard, mode),
                "effect": _mode_text(effect, mode),
                "events": _mode_text(events, mode),
            }
        )
    return rows


def transition_table_markdown(mode: str) -> str:
    """The transition table of ``mode`` as Markdown."""
    lines = [
        f"| action ({mode}) | actor | guard | effect | events |",
        "|---|---|---|---|---|",
    ]
    for row in transition_table(mode):
        cells = [row["action"], row["actor"], row["guard"], row["effect"], row["events"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m pdproto._reference
    for _mode in ("push", "pull"):
        print(f"### {_mode}\n")
        print(transition_table_markdown(_mode))
