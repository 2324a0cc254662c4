"""The reference P->D handoff model: a pure, sans-IO state machine that runs a
family's rule table (see docs/protocol.md).

Components:

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

The protocol itself is data: ``HandoffModel.rules`` (a
:class:`~pdproto.protocol._rules.RuleBook`, by default
:data:`~pdproto.protocol._push_pull.REFERENCE`) holds one rule table per
family, chosen by ``config.policy`` (push: D reserves first and P writes
into D; pull: P prefills first and D reads from P).  ``actions`` offers the
table's action rules in table order and ``step`` runs the chosen rule's
effect.  A mutant is the reference with one rule replaced.

Faults are actions with per-run budgets (``config.faults``): client cancel,
duplicate, lost and reordered messages, worker restart, timeouts, transfer
failure and retry.  A timer whose guarded wait can no longer end by itself
(the awaited message was lost or dropped) expires without a budget, so no
request is ever stuck.  The model never judges itself: the
:class:`~pdproto.Monitor` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ..spec import (
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    HistoryHeader,
    KVSpec,
    TransferStart,
    WorkerSpec,
)
from ._config import FAULT_KINDS, ModelConfig
from ._model import Action, ActionNotEnabled, Renaming
from ._push_pull import REFERENCE
from ._rules import AT, Kind, Rule, RuleBook, RuleTable
from ._state import (
    CANCELLED,
    COMMITTED,
    FAILED,
    FINISHED,
    SHARED_PREFIX,
    End,
    HState,
    Msg,
    MsgKind,
    Phase,
    Req,
    Xfer,
    XferState,
    new,
    with_end,
    with_msgs,
    with_ndec,
    with_ph,
    with_reqs,
    with_xfers,
    with_xs,
)
from ._symmetry import HandoffSymmetry

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

_RETRY = FAULT_KINDS.index("retry")
_CANCEL = FAULT_KINDS.index("cancel")
#: The first token of generation ``gen`` is FIRST_TOKEN + gen (any value would do).
FIRST_TOKEN = 100
_END_EVENT = {CANCELLED: Cancel, FAILED: Fail, FINISHED: Finish}
_CLIENT, _REQUEST, _TRANSFER, _MESSAGE, _WORKER = Kind.ACTIONS


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _entries(rules: list[Rule], guards: dict | None = None) -> tuple:
    """``(slot, fault index or -1, guard)`` of each rule, in table order."""
    return tuple(
        (j, FAULT_KINDS.index(rule.fault) if rule.fault else -1, (guards or {}).get(rule.name, rule.guard))
        for j, rule in enumerate(rules)
        if guards is None or rule.name in guards
    )


def _cell(rules: list[Rule], end: End, ph: Phase) -> tuple:
    """The entries of the request rules that may fire on a record in ``end`` and ``ph``."""
    here = {rule.name: rule for rule in rules if end in rule.ends and ph in rule.phases}
    guards = {}
    for name, rule in here.items():
        other = here.get(rule.unless) if rule.unless else None
        if other is None:
            guards[name] = rule.guard
        elif other.guard is not None:  # offered only where ``other`` is not
            guards[name] = _unless(other.guard, rule.guard)
    return _entries(rules, guards)


def _unless(other: Callable[..., bool], own: Callable[..., bool] | None) -> Callable[..., bool]:
    if own is None:
        return lambda m, s, r, q: not other(m, s, r, q)
    return lambda m, s, r, q: not other(m, s, r, q) and own(m, s, r, q)


class HandoffModel:
    """The reference handoff model built from a :class:`ModelConfig`.

    Satisfies :class:`pdproto.Model`.  A mutant subclasses it with another
    ``rules`` (``REFERENCE.replace(name, ...)``); ``SYMMETRIC_*`` say what
    symmetry reduction may rename (see :mod:`._symmetry`).
    """

    name = "reference"
    #: the protocol: one rule table per policy
    rules: ClassVar[RuleBook] = REFERENCE
    #: rename submitted requests (the unsubmitted ones form the tail and stay)
    SYMMETRIC_REQUESTS = True
    #: renumber the blocks of each pool
    SYMMETRIC_BLOCKS = True
    #: permute the workers of one role
    SYMMETRIC_WORKERS = True

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config = config or ModelConfig.all_faults(1)
        self.policy = config.policy
        #: this model's family of rules
        self.table: RuleTable = self.rules[config.policy]
        self.np = config.prefill_workers
        self.nd = config.decode_workers
        self.nblocks = config.blocks
        self.bs = config.block_size
        self.prompt_len = config.prompt_len
        self.max_new = config.max_new_tokens
        self.nsrc = config.blocks_per_request
        #: format 1.1: blocks (and tokens) of the cached prefix (0: no prefix cache), chunks per handoff
        self.prefix_blocks = config.prefix_blocks if config.prefix_cache else 0
        self.prefix_tokens = self.prefix_blocks * config.block_size
        self.chunks = config.chunks
        self.layerwise = config.layerwise
        self.chunk_ranges = config.chunk_ranges
        #: extension: P's source lease renewed by D's heartbeats (pull only)
        self.heartbeat = config.heartbeat and config.policy == "pull"
        # D keeps room for the prompt and every decoded position
        self.ndst = max(self.nsrc, _ceil(config.prompt_len + config.max_new_tokens - 1, config.block_size))
        self.wname = tuple(f"P{i}" for i in range(self.np)) + tuple(f"D{i}" for i in range(self.nd))
        self.rname = tuple(f"r{i}" for i in range(config.requests))
        workers = {f"P{i}": WorkerSpec("prefill", config.blocks) for i in range(self.np)}
        workers.update({f"D{i}": WorkerSpec("decode", config.blocks) for i in range(self.nd)})
        self.header = _header(config, workers)
        self.budget0 = tuple(config.faults[k] for k in FAULT_KINDS)
        self._cache_state: Any = None
        self._cache_acts: tuple = ()
        # interned actions and ids (the hot path builds no Action and no id string)
        self._handler: dict = {}  # id(action) -> (kind, effect, target, fault index or -1)
        self._interned: dict = {}
        self._tids: dict = {}
        self._tks: dict = {}
        self._compile(self.table)
        self._sym = HandoffSymmetry(self)
        if type(self).symmetry is HandoffModel.symmetry:
            self.symmetry = self._sym.symmetry  # type: ignore[method-assign]  # skip one call per state
        self.invariants = {"exclusive-blocks": self._exclusive_blocks}
        self.sometimes = self._make_sometimes()

    @property
    def mode(self) -> str:
        """The old name of :attr:`policy` (read-only)."""
        return self.policy

    # -- ids and values --------------------------------------------------

    def ticket(self, r: int, gen: int) -> str:
        return f"t:{self.rname[r]}:{gen}"

    def transfer_id(self, r: int, gen: int, chunk: int = 0) -> str:
        return f"x:{self.rname[r]}:{gen}:{chunk}"

    def first_token(self, r: int, gen: int) -> int:
        # Depends on the generation only, not on the request: symmetry
        # reduction renames requests, and a token value tied to a request
        # could not be renamed with it (Renaming maps ids, not tokens).  The
        # monitor compares tokens only within one generation.
        return FIRST_TOKEN + gen

    def tid(self, r: int, gen: int, chunk: int = 0) -> str:
        """``transfer_id(r, gen, chunk)``, one string object per id."""
        t = self._tids.get((r, gen, chunk))
        if t is None:  # a subclass's transfer_id(r, gen) of format 1 still works without chunks
            t = self._tids[(r, gen, chunk)] = (
                self.transfer_id(r, gen, chunk) if chunk else self.transfer_id(r, gen)
            )
        return t

    def tk(self, r: int, gen: int) -> str:
        """``ticket(r, gen)``, one string object per id."""
        t = self._tks.get((r, gen))
        return t if t is not None else self._tks.setdefault((r, gen), self.ticket(r, gen))

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
        kind, effect, target, k = self._handler[id(action)]
        ev: list[Event] = []
        if kind is _REQUEST:
            nstate = effect(self, state, target, state[0][target], ev)
        elif kind is _MESSAGE:
            nstate = effect(self, state, target, state[2][target], ev)
        elif kind is _TRANSFER:
            i = self._xfer_index(state, target[0], target[1])
            if i < 0:
                raise KeyError(target)
            nstate = effect(self, state, i, state[1][i], ev)
        else:
            nstate = effect(self, state, target, ev)
        if k >= 0:
            nstate = self.spend(nstate, k)
        return nstate, tuple(ev)

    def symmetry(self, state: HState) -> tuple[Any, Renaming | None]:
        """``(canonical_state, renaming)``: see :class:`HandoffSymmetry`."""
        return self._sym.symmetry(state)

    # -- the rule table, compiled ----------------------------------------

    def _compile(self, table: RuleTable) -> None:
        """Group the action rules in runs of one kind (in table order) and
        precompute, per run, the entries ``(slot, fault index or -1, guard)``
        that ``_actions`` checks: for request rules per (end, phase), for
        message and transfer rules per place (:data:`AT`)."""
        runs: list[tuple[str, list[Rule]]] = []
        for rule in table:
            if rule.kind == Kind.HANDLER:
                continue
            if runs and runs[-1][0] == rule.kind:
                runs[-1][1].append(rule)
            else:
                runs.append((rule.kind, [rule]))
        plan = []
        for n, (kind, rules) in enumerate(runs):
            if kind == _REQUEST:
                entries: Any = tuple(tuple(_cell(rules, end, ph) for ph in Phase) for end in End)
            elif kind in AT:
                entries = tuple(
                    _entries(rules, {r.name: r.guard for r in rules if not r.at or where in r.at})
                    for where in AT[kind]
                )
            else:
                entries = _entries(rules)
            plan.append((Kind.ACTIONS[Kind.ACTIONS.index(kind)], n, entries, tuple(rules), {}))
        self._plan = tuple(plan)
        self._recv = tuple(table.get("recv_" + kind.word) for kind in MsgKind)
        fence = table.get("fence")
        self._fenced = fence.guard if fence is not None else None

    def _intern(self, rule: Rule, actor: str, args: tuple, target: Any, kind: str) -> Action:
        """The interned Action of ``rule`` on ``target``, with what ``step`` runs for it."""
        key = (rule.name, actor, args, target)
        a = self._interned.get(key)
        if a is None:
            a = self._interned[key] = Action(rule.action, actor, args, rule.fault is not None)
            fault = FAULT_KINDS.index(rule.fault) if rule.fault else -1
            self._handler[id(a)] = (kind, rule.effect, target, fault)
        return a

    def _run_actions(self, run: tuple, key: tuple) -> tuple[Action, ...]:
        """The actions of one run's rules on one object (cached per run and key)."""
        kind, _, _, rules, cache = run
        acts = cache.get(key)
        if acts is None:
            if kind == _REQUEST:
                r, p, d = key
                args: tuple = (self.rname[r],)
                actors = {"P": self.wname[p], "D": self.wname[d]}
                target: Any = r
            elif kind == _TRANSFER:
                args, actors, target = (self.tid(*key),), {}, key
            elif kind == _MESSAGE:
                i, mk, r, gen = key
                args, actors, target = (i, mk.word, self.rname[r], gen), {}, i
            else:  # worker
                args, actors, target = (self.wname[key],), {"worker": self.wname[key]}, key
            acts = cache[key] = tuple(
                self._intern(rule, actors.get(rule.actor, rule.actor), args, target, kind) for rule in rules
            )
        return acts  # type: ignore[no-any-return]

    def _submit_actions(self, run: tuple, r: int) -> tuple[Action, ...]:
        cache = run[4]
        acts = cache.get(r)
        if acts is None:
            rn = self.rname[r]
            acts = cache[r] = tuple(
                self._intern(
                    rule,
                    rule.actor,
                    (rn, self.wname[p], self.wname[self.np + d]),
                    (r, p, self.np + d),
                    _CLIENT,
                )
                for rule in run[3]
                for p in range(self.np)
                for d in range(self.nd)
            )
        return acts  # type: ignore[no-any-return]

    def _actions(self, s: HState) -> list[Action]:
        reqs, xfers, msgs, _, budget = s
        out: list[Action] = []
        add = out.append
        for run in self._plan:
            kind, _, plan, _, _ = run
            if kind is _REQUEST:
                cache = run[4]
                for r, q in enumerate(reqs):
                    if q.gen < 0:
                        continue
                    acts = None
                    for j, k, guard in plan[q.end][q.ph]:
                        if (k < 0 or budget[k]) and (guard is None or guard(self, s, r, q)):
                            if acts is None:
                                key = (r, q.p, q.d)
                                acts = cache.get(key) or self._run_actions(run, key)
                            add(acts[j])
            elif kind is _TRANSFER:
                for x in xfers:
                    acts = None
                    for j, k, guard in plan[2 if x.doomed else x.aborted]:  # AT["transfer"]
                        if (k < 0 or budget[k]) and (guard is None or guard(self, s, x)):
                            if acts is None:
                                acts = self._run_actions(run, (x.r, x.gen, x.chunk))
                            add(acts[j])
            elif kind is _MESSAGE:
                for i, m in enumerate(msgs):
                    acts = None
                    for j, k, guard in plan[i > 0]:  # AT["message"]
                        if (k < 0 or budget[k]) and (guard is None or guard(self, s, i, m)):
                            if acts is None:
                                acts = self._run_actions(run, (i, m.kind, m.r, m.gen))
                            add(acts[j])
            elif kind is _WORKER:
                for w in range(self.np + self.nd):
                    acts = None
                    for j, k, guard in plan:
                        if (k < 0 or budget[k]) and (guard is None or guard(self, s, w)):
                            if acts is None:
                                acts = self._run_actions(run, w)
                            add(acts[j])
            else:  # client: submit the next request (requests arrive in order)
                for r, q in enumerate(reqs):
                    if q.gen < 0:
                        out.extend(self._submit_actions(run, r))
                        break
        return out

    # -- helpers the rules use -------------------------------------------

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
        """Blocks of D worker ``w`` that the ``fence`` rule keeps out of its pool."""
        out: tuple[int, ...] = ()
        fenced = self._fenced
        if fenced is not None:
            for x in state.xfers:
                if x.d == w and fenced(self, state, x):
                    out += x.dst
        return out

    def cached_prefix(self, state: HState, w: int) -> tuple[int, ...]:
        """The prefix blocks P worker ``w`` has cached: those a generation on
        ``w`` holds as its shared or published prefix (``()``: none)."""
        for q in state.reqs:
            if q.pfx and q.p == w and q.src:
                return q.src[: self.prefix_blocks]  # type: ignore[no-any-return]
        return ()

    def xfer_of(self, state: HState, r: int) -> int:
        """Index of the transfer of request ``r``'s current generation, or -1."""
        return self._xfer_index(state, r, state.reqs[r].gen)

    @staticmethod
    def _xfer_index(state: HState, r: int, gen: int) -> int:
        """Index of the transfer of generation ``gen`` of request ``r``, or -1."""
        for i, x in enumerate(state.xfers):
            if x[0] == r and x[1] == gen:
                return i
        return -1

    def has_msg(self, state: HState, r: int, gen: int) -> bool:
        for m in state.msgs:
            if m.r == r and m.gen == gen:
                return True
        return False

    @staticmethod
    def set_req(state: HState, r: int, q: Req) -> HState:
        reqs = state[0]
        return with_reqs(state, reqs[:r] + (q,) + reqs[r + 1 :])

    @staticmethod
    def spend(state: HState, k: int) -> HState:
        reqs, xfers, msgs, inc, b = state
        return new(HState, (reqs, xfers, msgs, inc, b[:k] + (b[k] - 1,) + b[k + 1 :]))

    def send(self, state: HState, kind: MsgKind, r: int, gen: int, frm: int, to: int) -> HState:
        """``state`` with message ``kind`` from worker ``frm`` to ``to`` in flight."""
        return with_msgs(state, state.msgs + (new(Msg, (kind, r, gen, frm, state.inc[frm], to)),))

    def receive(self, state: HState, m: Msg, ev: list) -> HState:
        """The receiver of ``m`` runs its ``recv_`` rule (if the rule's guard
        holds); a message of an old incarnation of its sender is dropped."""
        q = state.reqs[m.r]
        if m.inc != state.inc[m.frm]:
            return state  # from an old incarnation: stale
        rule = self._recv[m.kind]
        if rule is None or (rule.guard is not None and not rule.guard(self, state, m, q)):
            return state
        return rule.effect(self, state, m, q, ev)  # type: ignore[no-any-return]

    def end_gen(self, q: Req, r: int, how: End, ev: list, reason: str | None = None) -> Req:
        """``q`` ended ``how`` (the router's token), with its event."""
        ev.append(_END_EVENT[how](self.rname[r], q.gen, reason))
        return with_end(q, how)

    def finish_gen(self, s: HState, r: int, how: End, ev: list, reason: str | None = None) -> HState:
        """End generation ``r`` and clean up at once."""
        q = self.end_gen(s.reqs[r], r, how, ev, reason)
        return self.cleanup(self.set_req(s, r, q), r, ev)

    def cleanup(self, s: HState, r: int, ev: list) -> HState:
        """Run the table's ``cleanup`` rule for request ``r``."""
        return self.table.cleanup.effect(self, s, r, ev)  # type: ignore[no-any-return]

    def start_transfer(self, s: HState, r: int, q: Req, ev: list) -> HState:
        """Start the handoff of ``r``: its transfer (its first chunk's)."""
        if self.chunks > 1:
            return self.start_chunk(s, r, with_xs(q, XferState.IN_FLIGHT), 0, ev)
        dst = q.dst[: self.nsrc]
        tk, tid = self.tk(r, q.gen), self.tid(r, q.gen)
        ev.append(TransferStart(tid, tk, self.rname[r], q.gen, self.wname[q.p], q.src, self.wname[q.d], dst))
        s = self.set_req(s, r, with_xs(q, XferState.IN_FLIGHT))
        return with_xfers(s, s.xfers + (Xfer(r, q.gen, q.p, q.src, q.d, dst),))

    def start_chunk(self, s: HState, r: int, q: Req, c: int, ev: list) -> HState:
        """Start chunk ``c`` of the handoff of ``r``: the blocks holding its
        positions (every block, for a layer), under the generation's ticket."""
        lo, hi = self.chunk_ranges[c]
        if self.layerwise:
            src, dst, layers, tokens = q.src, q.dst[: self.nsrc], (lo, hi), None
        else:
            first, end = lo // self.bs, _ceil(hi, self.bs)
            src, dst, layers, tokens = q.src[first:end], q.dst[first:end], None, (lo, hi)
        tid = self.tid(r, q.gen, c)
        ev.append(
            TransferStart(
                tid,
                self.tk(r, q.gen),
                self.rname[r],
                q.gen,
                self.wname[q.p],
                src,
                self.wname[q.d],
                dst,
                layers,
                tokens,
            )
        )
        s = self.set_req(s, r, q)
        return with_xfers(s, s.xfers + (Xfer(r, q.gen, q.p, src, q.d, dst, chunk=c),))

    def commit(self, s: HState, r: int, q: Req, ev: list, ticket: str) -> HState:
        ev.append(Commit(self.rname[r], q.gen, ticket, self.wname[q.d]))
        return self.set_req(s, r, with_ph(q, COMMITTED))

    def decode_at(self, s: HState, r: int, q: Req, ev: list, position: int, token: int) -> HState:
        """One decode step of ``r`` feeding ``token`` at ``position``."""
        blocks = q.dst[: _ceil(position + 1, self.bs)]
        ev.append(Decode(self.rname[r], q.gen, self.wname[q.d], position, token, token + 1, blocks))
        return self.set_req(s, r, with_ndec(q, q.ndec + 1))

    # -- properties ------------------------------------------------------

    def _exclusive_blocks(self, s: HState) -> bool:
        """No block has two holders, but for the cached prefix blocks (held
        by every generation that shares them, and by no one else)."""
        seen = set()
        shared = set()
        for q in s.reqs:
            src = q.src
            if q.pfx:
                k = self.prefix_blocks
                shared.update((q.p, b) for b in src[:k])
                src = src[k:]
            for b in src:
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
        return not shared or not (shared & seen)

    def _make_sometimes(self) -> dict[str, Callable[[HState], bool]]:
        out: dict[str, Callable[[HState], bool]] = {}
        for ph in self.table.phases:
            out[f"phase-{ph.letter}"] = lambda s, ph=ph: any(q.ph is ph for q in s.reqs)
        out["finished"] = lambda s: any(q.end is FINISHED for q in s.reqs)
        out["all-finished-clean"] = lambda s: all(q.end is FINISHED and q.gen == 0 for q in s.reqs)
        if self.max_new >= 2:
            out["decoded"] = lambda s: any(q.ndec >= 1 for q in s.reqs)
        for k, kind in enumerate(FAULT_KINDS):
            if self.budget0[k]:
                out[f"fault-{kind}"] = lambda s, k=k: s.budget[k] < self.budget0[k]
        if self.budget0[_RETRY]:
            out["retry-finished"] = lambda s: any(q.gen >= 1 and q.end is FINISHED for q in s.reqs)
        if self.budget0[_CANCEL]:
            out["cancelled"] = lambda s: any(q.end is CANCELLED for q in s.reqs)
        if self.prefix_blocks:
            out["prefix-shared"] = lambda s: any(q.pfx == SHARED_PREFIX for q in s.reqs)
        if self.chunks > 1:
            out["last-chunk"] = lambda s: any(x.chunk == self.chunks - 1 for x in s.xfers)
        return out


def _header(config: ModelConfig, workers: dict) -> HistoryHeader:
    """The history header of ``config``'s traces: format 1, or 1.1 with the
    features the configuration uses (``kv.layers`` for layer-wise chunks)."""
    kv = KVSpec(layers=config.chunks) if config.layerwise else None
    return HistoryHeader(
        policy=config.policy,
        complete=True,
        workers=workers,
        extra={"block_size": config.block_size},
        features=config.features,
        kv=kv,
    )


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

    def run(
        self, choose: Callable[[tuple[Action, ...]], Action] | None = None, limit: int = 10_000
    ) -> list[Event]:
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


def transition_table(policy: str, model_cls: type = HandoffModel) -> list[dict[str, str]]:
    """Rows ``{action, kind, actor, guard, effect, events}`` of ``policy``'s
    transition table, read from ``model_cls.rules``."""
    return model_cls.rules[policy].rows()  # type: ignore[no-any-return]


def transition_table_markdown(policy: str, model_cls: type = HandoffModel) -> str:
    """The transition table of ``policy`` as Markdown."""
    return model_cls.rules[policy].markdown()  # type: ignore[no-any-return]
