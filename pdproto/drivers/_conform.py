"""Conformance of a (possibly partial) history to a model: trace validation
in the style of TLC's, where a log is checked against a specification.

:func:`conform` decides whether some behaviour of the model explains the
history: every observed event must be an event the model emits, in an order
the model allows, while the model may take steps whose events were not
observed (silent steps) in between.  When no behaviour explains it, the
result names the first event none explains, the model states still possible
just before it and the events the model could have produced there.

The method (docs/conformance.md says it in full, with its limits):

- **Projection per request.**  Requests interact only through the shared
  pools and workers, so each request of the history is matched against a
  one-request instance of the model (its own prompt length and token
  budget, one P and one D worker, a pool large enough that room never
  blocks it, fault budgets unlimited).  The search keeps, per request, a
  *frontier*: the set of configurations ``(model state, events of the
  current model step still to be observed, renaming)`` that explain the
  request's events so far.  The product of requests is never built.
- **Shared resources** are checked beside the projections, on the real ids:
  a block is held by at most one request at a time (but for shared prefix
  blocks), a block id lies in its declared pool, a restart frees the
  worker's blocks but for those a transfer in flight still writes.  A
  restart is an event of every request that holds something on that worker.
- **Renaming.**  Model ids (ticket ``t:r0:0``, transfer ``x:r0:0:0``,
  workers ``P0``/``D0``, block numbers, generation numbers) differ from a real
  system's.  Each configuration carries a bijection between them, extended
  when an event first names an id and checked every time after; a block's
  binding ends when the model frees it (its id may come back for another
  allocation).  Data values (token ids, reasons, incarnation numbers) are
  not matched: the monitor judges them.
- **Steps and silence.**  A model step emits a sequence of events; those of
  observed kinds must all appear (in any order, interleaved with other
  requests' events) before the request's next step.  Steps whose events are
  all of unobserved kinds are silent; the silent closure of a state is
  searched up to ``max_silent`` states.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import attrs

from .._errors import UsageError
from ..protocol import FAULT_KINDS, ModelConfig
from ..spec import EVENT_TYPES, Event, HistoryHeader, Monitor, Restart, Violation, open_history

__all__ = ["conform", "ConformanceResult"]

#: The budget of each fault kind in a projection: unlimited in effect (a
#: state's budgets are reset after every step, so they never run out).
_UNLIMITED = 1 << 30
#: How many model states a result shows, and how many expected events.
SHOWN_STATES = 5
SHOWN_EVENTS = 12

_ALL_KINDS = tuple(EVENT_TYPES)
# fields matched exactly, and fields ignored (data values: the monitor judges them)
_EXACT = frozenset(("prompt_len", "processed_len", "position", "layers", "tokens"))
_IGNORED = frozenset(
    ("first_token", "input_token", "output_token", "reason", "incarnation", "request", "extra")
)
_WORKER_FIELDS = {"blocks": "worker", "src_blocks": "src", "dst_blocks": "dst"}
_ID_FIELDS = {"ticket": "t", "transfer": "x", "worker": "w", "src": "w", "dst": "w"}


@attrs.frozen
class ConformanceResult:
    """What :func:`conform` found.

    ``ok``: some behaviour of ``model`` explains the history.  When not ok,
    ``line`` is the first event no behaviour explains (for a complete
    history whose end leaves a model step half observed: the line after the
    last), ``request`` its request, ``event`` its JSON object, ``reason`` why,
    ``states`` readable summaries of the model states still possible just
    before it (at most :data:`SHOWN_STATES`; ``states_total`` counts them)
    and ``expected`` the observed events the model could have produced
    there (real ids where the renaming knows them, else ``?`` and the
    model's id).  ``renaming`` is one configuration's renaming (model id ->
    real id) at that point.  ``violations`` is the monitor's verdict on the
    same history (a history can conform and still violate an invariant, or
    be clean for the monitor and not conform).  ``bounded`` says a search
    bound was hit (the answer may then be a false rejection)."""

    ok: bool
    events: int
    requests: int
    model: str
    policy: str
    observed: tuple[str, ...]
    complete: bool = False
    line: int | None = None
    request: str | None = None
    event: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    reason: str = ""
    states: tuple[str, ...] = ()
    states_total: int = 0
    expected: tuple[str, ...] = ()
    renaming: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    violations: tuple[Violation, ...] = ()
    bounded: bool = False
    #: the invariants the monitor could not judge on a partial history
    not_judged: tuple[str, ...] = ()

    @property
    def monitor_ok(self) -> bool:
        """The monitor found no violation."""
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``pdproto conform --json``."""
        return {
            "ok": self.ok,
            "events": self.events,
            "requests": self.requests,
            "model": self.model,
            "policy": self.policy,
            "observed": list(self.observed),
            "complete": self.complete,
            "line": self.line,
            "request": self.request,
            "event": dict(self.event) if self.event is not None else None,
            "reason": self.reason,
            "states": list(self.states),
            "states_total": self.states_total,
            "expected": list(self.expected),
            "renaming": dict(self.renaming),
            "bounded": self.bounded,
            "monitor": {
                "ok": self.monitor_ok,
                "violations": [v.to_dict() for v in self.violations],
                "not_judged": list(self.not_judged),
            },
        }


# -- the renaming ---------------------------------------------------------------------


class _Ren:
    """A bijection between model ids and real ids (copy on write).  Keys are
    ``("w", name)``, ``("t", ticket)``, ``("x", transfer)``, ``("g", gen)``
    and ``("b", model worker, block)``; values the real id (a block's value is
    ``(real worker, block)``)."""

    __slots__ = ("fwd", "back", "_key")

    def __init__(self, fwd: dict, back: dict) -> None:
        self.fwd = fwd
        self.back = back
        self._key: Any = None

    def key(self) -> Hashable:
        if self._key is None:
            self._key = frozenset(self.fwd.items())
        return self._key

    def real(self, key: tuple) -> Any:
        return self.fwd.get(key)


class _Binder:
    """Extends a renaming while one event is matched; ``ok`` turns False on a
    conflict.  The renaming is copied at the first new binding only."""

    __slots__ = ("ren", "fwd", "back", "ok")

    def __init__(self, ren: _Ren) -> None:
        self.ren = ren
        self.fwd = ren.fwd
        self.back = ren.back
        self.ok = True

    def bind(self, key: tuple, value: Any) -> bool:
        have = self.fwd.get(key, _MISSING)
        if have is not _MISSING:
            return have == value
        if value in self.back:
            return False
        if self.fwd is self.ren.fwd:
            self.fwd = dict(self.fwd)
            self.back = dict(self.back)
        self.fwd[key] = value
        self.back[value] = key
        return True

    def result(self) -> _Ren:
        return self.ren if self.fwd is self.ren.fwd else _Ren(self.fwd, self.back)


_MISSING = object()


_EXACT_F, _GEN_F, _MAXNEW_F, _ID_F, _BLOCKS_F, _OTHER_F = range(6)
_PLANS: dict = {}


def _plan(cls: type) -> tuple:
    """How :func:`_match` compares each field of an event class."""
    plan = _PLANS.get(cls)
    if plan is None:
        out = []
        for name in cls.FIELDS:  # type: ignore[attr-defined]
            if name in _IGNORED:
                continue
            if name in _EXACT:
                out.append((name, _EXACT_F, None))
            elif name == "gen":
                out.append((name, _GEN_F, "g"))
            elif name == "max_new_tokens":
                out.append((name, _MAXNEW_F, None))
            elif name in _ID_FIELDS:
                out.append((name, _ID_F, _ID_FIELDS[name]))
            elif name in _WORKER_FIELDS:
                out.append((name, _BLOCKS_F, _WORKER_FIELDS[name]))
            else:
                out.append((name, _OTHER_F, None))
        plan = _PLANS[cls] = tuple(out)
    return plan


def _match(me: Event, re: Event, ren: _Ren) -> _Ren | None:
    """``ren`` extended so that model event ``me`` names what real event
    ``re`` names, or None when they cannot be the same event.  A field the
    real event leaves out (None: a partial history) matches anything."""
    if type(me) is not type(re):
        return None
    b = _Binder(ren)
    for name, how, tag in _plan(type(me)):
        mv, rv = getattr(me, name), getattr(re, name)
        if rv is None:  # left out by a partial history (or optional)
            continue
        if how is _EXACT_F or how is _MAXNEW_F:
            if mv is not None and mv != rv:
                return None
            if mv is None and how is _EXACT_F:
                return None
        elif mv is None:
            continue
        elif how is _GEN_F or how is _ID_F:
            if not b.bind((tag, mv), rv):
                return None
        elif how is _BLOCKS_F:
            mw, rw = getattr(me, tag), getattr(re, tag)
            if len(mv) != len(rv):
                return None
            for x, y in zip(mv, rv):
                if not b.bind(("b", mw, x), (rw, y)):
                    return None
        elif mv != rv:
            return None
    return b.result()


#: The events a transfer's write completion gates: a real system may report
#: the write completion after any other later event of the same model step
#: (P freeing the source it read does not wait for the write).  The data
#: plane reports a transfer's read and write completions in either order, and
#: the frees of one step (a cleanup on P and on D) come in either order.
_WRITE_GATES = frozenset(("commit", "decode"))


def _may_pass(lagging: Event, kind: str) -> bool:
    """Whether an event of ``kind`` may be seen before ``lagging``, an earlier event of the same step."""
    lag = lagging.EV
    if lag == "transfer_write_done":
        return kind not in _WRITE_GATES
    if lag == "transfer_read_done":
        return kind == "transfer_write_done"  # (the renaming keeps it the same transfer)
    if lag == "free":  # one step's frees (cleanup on P and on D) are independent of each other
        return kind == "free"
    return False


def _positions(events: tuple, kind: str) -> Iterable[int]:
    """The indices ``i`` of the events an event of ``kind`` can be: the
    first one, or a later one that every earlier one lets pass
    (:func:`_may_pass`).  A model step's events are otherwise seen in order."""
    for i, pe in enumerate(events):
        if pe.EV == kind:
            yield i
        if not _may_pass(pe, kind):
            return


def _matches(events: tuple, e: Event, ren: _Ren) -> Iterable[tuple[int, _Ren]]:
    """``(i, renaming)`` for each event ``events[i]`` that real event ``e`` can be."""
    for i in _positions(events, e.EV):
        r = _match(events[i], e, ren)
        if r is not None:
            yield i, r


def _unbind_blocks(ren: _Ren, keep: frozenset) -> _Ren:
    """``ren`` without the block bindings whose model block is not in ``keep``."""
    drop = [k for k in ren.fwd if k[0] == "b" and (k[1], k[2]) not in keep]
    if not drop:
        return ren
    fwd, back = dict(ren.fwd), dict(ren.back)
    for k in drop:
        del back[fwd.pop(k)]
    return _Ren(fwd, back)


# -- a projection model: one request, memoised --------------------------------------


class _Proj:
    """One request's instance of the model, with its successor graph
    memoised: ``succ(state)`` -> ``((action, next state, observed events),
    ...)`` and the silent closure of a state."""

    def __init__(self, model: Any, observed: frozenset[str], max_silent: int) -> None:
        self.model = model
        self.observed = observed
        self.max_silent = max_silent
        self._succ: dict = {}
        self._closure: dict = {}
        self._cands: dict = {}
        self._live: dict = {}
        self.budget0 = getattr(model, "budget0", None)
        self.handoff = self.budget0 is not None and hasattr(model, "wname")
        #: the renaming keys of the model's workers (None: look for them)
        self.worker_keys = tuple(("w", w) for w in model.wname) if self.handoff else None
        self.bounded = False

    def initial(self) -> tuple:
        return tuple(self.model.initial_states())

    def succ(self, s: Any) -> tuple:
        out = self._succ.get(s)
        if out is None:
            items = []
            obs = self.observed
            b0 = self.budget0
            for a in self.model.actions(s):
                ns, evs = self.model.step(s, a)
                if b0 is not None:
                    if ns.budget != b0:
                        ns = ns._replace(budget=b0)
                    if self.handoff and any(ns.inc):
                        ns = _dense_incarnations(ns)
                items.append((a, ns, tuple(e for e in evs if e.EV in obs)))
            out = self._succ[s] = tuple(items)
        return out

    def closure(self, s: Any) -> tuple:
        """The states reachable from ``s`` by silent steps, ``s`` first."""
        out = self._closure.get(s)
        if out is None:
            seen = {s: None}
            todo = [s]
            # unobserved retries could go on forever: at most one new generation per closure
            top = s.reqs[0].gen + 1 if self.handoff else None
            while todo:
                t = todo.pop()
                for _, ns, obs in self.succ(t):
                    if top is not None and ns.reqs[0].gen > top:
                        continue
                    if not obs and ns not in seen:
                        if len(seen) >= self.max_silent:
                            self.bounded = True
                            break
                        seen[ns] = None
                        todo.append(ns)
            out = self._closure[s] = tuple(seen)
        return out

    def quiet(self, s: Any) -> bool:
        """Some state silently reachable from ``s`` enables nothing but faults
        (the system went quiet: only a fault could move it on)."""
        for t in self.closure(s):
            if all(a.fault for a, _, _ in self.succ(t)):
                return True
        return False

    def candidates(self, s: Any, pending: tuple, kind: str) -> tuple:
        """``(model event, next state, events still to see, blocks)`` for each
        way an event of ``kind`` can come next from configuration ``(s,
        pending)``: one of the pending events, or (none pending) an event of a
        step from the silent closure of ``s``; ``blocks``, when not None, are
        the model blocks still held just before that step (silent steps on
        the way freed the others: their bindings end).  Memoised."""
        key = (s, pending, kind)
        out = self._cands.get(key)
        if out is None:
            found: dict = {}
            if pending:
                for i in _positions(pending, kind):
                    found.setdefault((pending[i], s, pending[:i] + pending[i + 1 :], None))
            else:
                for t in self.closure(s):
                    before = self.live_blocks(t) if t is not s and self.handoff else None
                    for _, ns, obs in self.succ(t):
                        for i in _positions(obs, kind):
                            found.setdefault((obs[i], ns, obs[:i] + obs[i + 1 :], before))
            out = self._cands[key] = tuple(found)
        return out

    def live_blocks(self, s: Any) -> frozenset:
        """The model blocks ``(model worker, block)`` state ``s`` still knows."""
        out = self._live.get(s)
        if out is None:
            out = self._live[s] = frozenset(self._live_blocks(s))
        return out

    def _live_blocks(self, s: Any) -> set:
        if not self.handoff:
            return set()
        wn = self.model.wname
        out = set()
        for q in s.reqs:
            if q.gen >= 0:
                out.update((wn[q.p], b) for b in q.src)
                out.update((wn[q.d], b) for b in q.dst)
        for x in s.xfers:
            out.update((wn[x.p], b) for b in x.src)
            out.update((wn[x.d], b) for b in x.dst)
        return out


def _dense_incarnations(s: Any) -> Any:
    """``s`` with each worker's incarnation numbers renumbered densely
    (0, 1, ... in order), keeping which are equal: the model compares
    incarnations only for equality, so repeated silent restarts reach
    finitely many states."""
    reqs, msgs, inc = s.reqs, s.msgs, s.inc
    ranks = []
    for w, now in enumerate(inc):
        vals = {now}
        vals.update(m.inc for m in msgs if m.frm == w)
        vals.update(q.pinc for q in reqs if q.p == w)
        vals.update(q.dinc for q in reqs if q.d == w)
        ranks.append({v: i for i, v in enumerate(sorted(vals))})
    new_inc = tuple(ranks[w][v] for w, v in enumerate(inc))
    if new_inc == inc:
        return s
    new_reqs = tuple(
        q._replace(
            pinc=ranks[q.p][q.pinc] if q.p >= 0 else q.pinc, dinc=ranks[q.d][q.dinc] if q.d >= 0 else q.dinc
        )
        for q in reqs
    )
    new_msgs = tuple(m._replace(inc=ranks[m.frm][m.inc]) for m in msgs)
    return s._replace(inc=new_inc, reqs=new_reqs, msgs=new_msgs)


class _Cfg:
    """One configuration of a request's search: a model state, the observed
    events of its last step not yet seen, and the renaming."""

    __slots__ = ("state", "pending", "ren")

    def __init__(self, state: Any, pending: tuple, ren: _Ren) -> None:
        self.state = state
        self.pending = pending
        self.ren = ren

    def key(self) -> Hashable:
        return (self.state, self.pending, self.ren.key())


# -- pre-pass: the shape of each request --------------------------------------------


@attrs.define
class _Shape:
    prompt_len: int | None = None
    max_new: int | None = None
    decodes: dict = attrs.field(factory=dict)  # gen -> decode count
    src: int | None = None  # blocks of the first prefill_start
    dst: int | None = None  # blocks of the first reserve
    chunks: dict = attrs.field(factory=dict)  # ticket -> transfers started under it
    layers: bool = False  # some transfer moved a range of layers
    ranges: set = attrs.field(factory=set)  # the token ranges its transfers moved (a few)


def _shapes(events: Iterable[tuple[int, Event]], roles: Mapping[str, str]) -> dict[str, _Shape]:
    """What each request's events say of its shape: prompt length, token
    budget, block counts, chunks (a pre-pass: the model of a request is
    built before its first event is matched)."""
    out: dict[str, _Shape] = {}
    for _, e in events:
        r = getattr(e, "request", None)
        if r is None:
            continue
        sh = out.get(r)
        if sh is None:
            sh = out[r] = _Shape()
        ev = e.EV
        if ev == "submit":
            if sh.prompt_len is None:
                sh.prompt_len = e.prompt_len
            if sh.max_new is None and e.max_new_tokens is not None:
                sh.max_new = e.max_new_tokens
        elif ev == "decode":
            sh.decodes[e.gen] = sh.decodes.get(e.gen, 0) + 1
            if sh.prompt_len is None:
                sh.prompt_len = e.position - sh.decodes[e.gen] + 1
        elif ev == "prefill_done" and sh.prompt_len is None:
            sh.prompt_len = e.processed_len
        elif ev == "prefill_start" and sh.src is None:
            sh.src = len(e.blocks)
        elif ev == "reserve" and sh.dst is None:
            sh.dst = len(e.blocks)
        elif ev == "free" and e.blocks is not None:
            role = roles.get(e.worker)
            if role == "prefill" and sh.src is None:
                sh.src = len(e.blocks)
            elif role == "decode" and sh.dst is None:
                sh.dst = len(e.blocks)
        elif ev == "transfer_start":
            sh.chunks[e.ticket] = sh.chunks.get(e.ticket, 0) + 1
            if sh.src is None and e.tokens is None and e.layers is None:
                sh.src = len(e.src_blocks)
            sh.layers = sh.layers or e.layers is not None
            if e.tokens is not None and len(sh.ranges) < 8:
                sh.ranges.add(e.tokens)
    return out


def _infer_chunks(shapes: Mapping[str, _Shape]) -> tuple[int, bool]:
    """``(chunks, layerwise)``: the fewest chunks per handoff that are at
    least the most transfers one ticket started and split every request's
    prompt at the token ranges its transfers moved; and whether some
    transfer moved layers."""
    most = max((n for sh in shapes.values() for n in sh.chunks.values()), default=1)
    layers = any(sh.layers for sh in shapes.values())
    facts = [(sh.prompt_len, sh.ranges) for sh in shapes.values() if sh.ranges and sh.prompt_len][:200]
    if layers or not facts:
        return most, layers
    for k in range(most, min(f[0] for f in facts) + 1):
        if all(r <= {(L * i // k, L * (i + 1) // k) for i in range(k)} for L, r in facts):
            return k, False
    return most, False


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _infer_block_size(shapes: Mapping[str, _Shape]) -> int:
    """The block size that fits the most requests' block counts (the
    smallest among equals; 16 when nothing says)."""
    facts = []
    for sh in shapes.values():
        if sh.prompt_len is None or (sh.src is None and sh.dst is None):
            continue
        facts.append((sh.prompt_len, _max_new(sh), sh.src, sh.dst))
        if len(facts) >= 200:
            break
    if not facts:
        return 16
    best, best_fit = 16, -1
    top = max(f[0] for f in facts) + max(f[1] for f in facts) + 1
    for bs in range(1, min(top, 4096) + 1):
        fit = 0
        for L, M, src, dst in facts:
            nsrc = _ceil(L, bs)
            ndst = max(nsrc, _ceil(L + M - 1, bs))
            fit += (src is None or src == nsrc) and (dst is None or dst == ndst)
        if fit > best_fit:
            best, best_fit = bs, fit
        if fit == len(facts):
            break
    return best


def _max_new(sh: _Shape, block_size: int | None = None) -> int:
    """The token budget: the submit's, else one more than the most decodes
    of a generation, else (decodes unobserved) the least budget that needs
    as many target blocks as a reserve or free on D showed."""
    if sh.max_new is not None:
        return sh.max_new
    if sh.decodes or not (block_size and sh.dst and sh.prompt_len):
        return max(sh.decodes.values(), default=0) + 1
    return max(1, (sh.dst - 1) * block_size - sh.prompt_len + 2)


# -- the search -----------------------------------------------------------------------


class _Failure(Exception):
    def __init__(
        self,
        line: int | None,
        request: str | None,
        event: Event | None,
        reason: str,
        cfgs: list | None = None,
        proj: _Proj | None = None,
    ) -> None:
        self.line, self.request, self.event, self.reason = line, request, event, reason
        self.cfgs, self.proj = cfgs or [], proj


class _Request:
    """The search state of one request of the history."""

    __slots__ = ("name", "proj", "cfgs", "workers", "last")

    def __init__(self, name: str, proj: _Proj) -> None:
        self.name = name
        self.proj = proj
        self.cfgs = [_Cfg(s, (), _Ren({}, {})) for s in proj.initial()]
        self.workers: set = set()  # real workers some configuration binds
        self.last = 0


class _Search:
    def __init__(
        self,
        build: Any,
        base: ModelConfig,
        shapes: Mapping[str, _Shape],
        observed: frozenset[str],
        header: HistoryHeader,
        max_silent: int,
        max_frontier: int,
    ) -> None:
        self.build = build
        self.base = base
        self.shapes = shapes
        self.observed = observed
        self.max_silent = max_silent
        self.max_frontier = max_frontier
        self.models: dict = {}
        self.reqs: dict[str, _Request] = {}
        self.by_worker: dict[str, set] = {}  # real worker -> names of requests that bind it
        self.xfer_req: dict[str, str] = {}  # real transfer -> request
        self.holder: dict = {}  # (real worker, block) -> {request: line}
        self.writing: dict = {}  # real transfer -> (dst worker, dst blocks) while in flight for writing
        self.quarantine: dict = {}  # real transfer -> (worker, blocks) fenced by a restart
        self.roles = {w: spec.role for w, spec in (header.workers or {}).items()}
        self.pools = {w: spec.blocks for w, spec in (header.workers or {}).items()}
        self.bounded = False
        #: who holds a block is known only when every way to release one is observed
        self.track = {"free", "restart"} <= observed
        #: which blocks a restart fences, only when a transfer's start and ends are observed
        self.fence = {"transfer_start", "transfer_write_done", "transfer_failed"} <= observed

    # projections

    def _proj(self, name: str) -> _Proj:
        sh = self.shapes.get(name) or _Shape()
        bs = self.base.block_size
        if sh.prompt_len is None:  # no submit, prefill_done or decode observed: the source's block count says
            sh.prompt_len = max((sh.src or 1) * bs, self.base.prompt_len)
        L = sh.prompt_len
        M = _max_new(sh, bs)
        key = (L, M)
        proj = self.models.get(key)
        if proj is None:
            per = max(_ceil(L, bs), _ceil(L + M - 1, bs))
            config = attrs.evolve(
                self.base,
                prompt_len=L,
                max_new_tokens=M,
                blocks=3 * per + 2,
                chunks=min(self.base.chunks, L) if not self.base.layerwise else self.base.chunks,
            )
            proj = self.models[key] = _Proj(self.build(config), self.observed, self.max_silent)
        return proj

    def request(self, name: str) -> _Request:
        rq = self.reqs.get(name)
        if rq is None:
            rq = self.reqs[name] = _Request(name, self._proj(name))
        return rq

    # one event of one request

    def advance(self, rq: _Request, e: Event, line: int) -> list:
        proj = rq.proj
        out: dict = {}
        kind = e.EV
        for c in rq.cfgs:
            for pe, ns, rest, held in proj.candidates(c.state, c.pending, kind):
                ren = _match(pe, e, c.ren if held is None else _unbind_blocks(c.ren, held))
                if ren is not None:
                    self._add(out, proj, ns, rest, ren)
        return list(out.values())

    def _add(self, out: dict, proj: _Proj, state: Any, pending: tuple, ren: _Ren) -> None:
        if not pending and proj.handoff:
            ren = _unbind_blocks(ren, proj.live_blocks(state))
        c = _Cfg(state, pending, ren)
        k = c.key()
        if k not in out:
            if len(out) >= self.max_frontier:
                self.bounded = True
                return
            out[k] = c

    def commit(self, rq: _Request, cfgs: list, line: int) -> None:
        rq.cfgs = cfgs
        rq.last = line
        keys = rq.proj.worker_keys
        for c in cfgs:
            fwd = c.ren.fwd
            for k in keys if keys is not None else [k for k in fwd if k[0] == "w"]:
                v = fwd.get(k)
                if v is not None and v not in rq.workers:
                    rq.workers.add(v)
                    self.by_worker.setdefault(v, set()).add(rq.name)

    def restart(self, rq: _Request, e: Restart, line: int) -> list:
        """A restart of ``e.worker`` seen by request ``rq``: where the model
        offers that restart it must take it; elsewhere the restart does not
        concern the request (its state stays)."""
        proj = rq.proj
        out: dict = {}
        role = self.roles.get(e.worker)
        for c in rq.cfgs:
            if c.pending:
                self._add(out, proj, c.state, c.pending, c.ren)
                continue
            bound = c.ren.back.get(e.worker)
            for s in proj.closure(c.state):
                took = False
                base = (
                    c.ren if s is c.state or not proj.handoff else _unbind_blocks(c.ren, proj.live_blocks(s))
                )
                for a, ns, obs in proj.succ(s):
                    if a.kind != "restart":
                        continue
                    mw = a.args[0] if a.args else None
                    if bound is not None and bound != ("w", mw):
                        continue
                    if bound is None and (("w", mw) in c.ren.fwd or not _role_fits(role, mw)):
                        continue
                    for i, ren in _matches(obs, e, base):
                        took = True
                        self._add(out, proj, ns, obs[:i] + obs[i + 1 :], ren)
                if not took or bound is None:
                    self._add(out, proj, s, (), base)
        return list(out.values())

    # shared resources

    def take(self, name: str, e: Event, line: int, shared: bool = False) -> None:
        w = e.worker  # type: ignore[attr-defined]
        pool = self.pools.get(w)
        holder = self.holder
        for b in e.blocks:  # type: ignore[attr-defined]
            if pool is not None and b >= pool:
                raise _Failure(line, name, e, f"block {b} is outside {w}'s pool of {pool} blocks")
            if not self.track:
                continue
            h = holder.get((w, b))
            if h:
                other = [r for r in h if r != name]
                if other and not (shared and all(v[1] for v in h.values())):
                    r = other[0]
                    what = (
                        "fenced (a transfer into the restarted worker still writes it)"
                        if r.startswith("\x00")
                        else f"still held by request {r!r} (line {h[r][0]})"
                    )
                    raise _Failure(
                        line, name, e, f"block {b} on {w} is {what}: the model allocates free blocks only"
                    )
                h[name] = (line, shared)
            else:
                holder[(w, b)] = {name: (line, shared)}

    def give(self, name: str | None, w: str, blocks: tuple | None) -> None:
        if blocks is None:  # a partial history's free of every block the request holds on w
            blocks = tuple(b for (hw, b), h in self.holder.items() if hw == w and name in h)
        for b in blocks:
            h = self.holder.get((w, b))
            if h is None:
                continue
            if name is None:
                if len(h) == 1:
                    del self.holder[(w, b)]
            else:
                h.pop(name, None)
                if not h:
                    del self.holder[(w, b)]

    def owner(self, w: str, blocks: tuple | None) -> str | None:
        for b in blocks or ():
            h = self.holder.get((w, b))
            if h:
                for r in h:
                    if not r.startswith("\x00"):
                        return r
        return None

    def restart_pool(self, w: str) -> None:
        for x, (dw, blocks) in self.writing.items():
            if dw == w and self.fence:
                self.quarantine[x] = (dw, blocks)
        for key in [k for k in self.holder if k[0] == w]:
            del self.holder[key]
        for x, (dw, blocks) in self.quarantine.items():
            if dw == w:
                for b in blocks:
                    self.holder[(w, b)] = {"\x00" + x: (0, False)}

    def transfer_over(self, x: str, writes_over: bool) -> None:
        if writes_over:
            self.writing.pop(x, None)
            q = self.quarantine.pop(x, None)
            if q is not None:
                self.give("\x00" + x, q[0], q[1])


def _role_fits(role: str | None, model_worker: str | None) -> bool:
    if role is None or model_worker is None:
        return True
    return model_worker.startswith("P") == (role == "prefill")


# -- reporting ------------------------------------------------------------------------


def _real(ren: _Ren, key: tuple, model_id: Any) -> str:
    v = ren.fwd.get(key)
    if v is None:
        return f"?{model_id}"
    if key[0] == "b":
        return str(v[1])
    return str(v)


def _brief(e: Event, ren: _Ren, request: str) -> str:
    """A model event in real ids where the renaming knows them."""
    parts = []
    for name in e.FIELDS:
        v = getattr(e, name)
        if v is None or name in ("first_token", "input_token", "output_token", "reason", "incarnation"):
            continue
        if name == "request":
            parts.append(repr(request))
        elif name == "gen":
            parts.append(f"gen {_real(ren, ('g', v), v)}")
        elif name in _ID_FIELDS:
            parts.append(f"{name} {_real(ren, (_ID_FIELDS[name], v), v)}")
        elif name in _WORKER_FIELDS:
            mw = getattr(e, _WORKER_FIELDS[name])
            parts.append(f"{name} [" + ", ".join(_real(ren, ("b", mw, b), b) for b in v) + "]")
        else:
            parts.append(f"{name} {v}")
    return f"{e.EV}(" + ", ".join(parts) + ")"


def _summary(proj: _Proj, c: _Cfg, request: str) -> str:
    s = c.state
    ren = c.ren
    if not proj.handoff:
        text = repr(s)
    else:
        m = proj.model
        wn = m.wname
        bits = []
        for q in s.reqs:
            if q.gen < 0:
                bits.append(f"{request!r} not submitted")
                continue
            head = f"{request!r} gen {_real(ren, ('g', q.gen), q.gen)}: {q.ph.name.lower()}"
            if q.end:
                head += f", {q.end.name.lower()}"
            p, d = wn[q.p], wn[q.d]
            if q.src:
                head += (
                    f", source on {_real(ren, ('w', p), p)} ["
                    + ", ".join(_real(ren, ("b", p, b), b) for b in q.src)
                    + "]"
                )
            if q.dst:
                head += (
                    f", target on {_real(ren, ('w', d), d)} ["
                    + ", ".join(_real(ren, ("b", d, b), b) for b in q.dst)
                    + "]"
                )
            if q.ndec:
                head += f", {q.ndec} decode(s)"
            bits.append(head)
        for x in s.xfers:
            tid = m.tid(x.r, x.gen, x.chunk)
            how = "doomed" if x.doomed else "aborted" if x.aborted else "running"
            bits.append(f"transfer {_real(ren, ('x', tid), tid)} {how}")
        for msg in s.msgs:
            bits.append(f"{msg.kind.word} in flight")
        text = "; ".join(bits)
    if c.pending:
        text += "; still to see: " + ", ".join(_brief(e, ren, request) for e in c.pending)
    return text


def _expected(proj: _Proj, cfgs: list, request: str) -> list[str]:
    out: dict[str, None] = {}
    for c in cfgs:
        if c.pending:
            for e in c.pending:
                out.setdefault(_brief(e, c.ren, request))
            continue
        for s in proj.closure(c.state):
            for _, _, obs in proj.succ(s):
                for e in obs:
                    out.setdefault(_brief(e, c.ren, request))
    return list(out)


def _renaming(ren: _Ren) -> dict[str, str]:
    out = {}
    for k, v in ren.fwd.items():
        if k[0] == "b":
            out[f"{k[1]}/block {k[2]}"] = f"{v[0]}/block {v[1]}"
        elif k[0] == "g":
            out[f"gen {k[1]}"] = f"gen {v}"
        else:
            out[str(k[1])] = str(v)
    return out


# -- the entry point ------------------------------------------------------------------


def _events_of(history: Any) -> tuple[HistoryHeader, list[tuple[int, Event]], int]:
    """``(header, [(line, event)], last line)`` of a path or an iterable of
    events (or of ``(line, event)`` pairs)."""
    if isinstance(history, (str, os.PathLike)):
        with open_history(os.fspath(history)) as reader:
            events = list(reader)
            return reader.header, events, reader.line
    header = None
    out: list[tuple[int, Event]] = []
    line = 0
    for item in history:
        if isinstance(item, HistoryHeader):
            header = item
            line += 1
            continue
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Event):
            line, e = item
        elif isinstance(item, Event):
            line, e = line + 1, item
        else:
            raise UsageError("history item", item, "an Event or a (line, Event) pair")
        out.append((line, e))
    return header or HistoryHeader(), out, line


def _builder(model: Any, policy: str) -> tuple[Any, str]:
    """``(build(config) -> model, name)`` for a catalogue name, a model file,
    a module with ``build``, a callable, or a handoff model instance."""
    if isinstance(model, str):
        from ._loader import load_model

        _, info = load_model(model, policy=policy)
        module = info.module
        if module is None or not callable(getattr(module, "build", None)):
            raise UsageError("model", model, "a model with build(config) (a handoff model of the catalogue)")
        return module.build, info.name
    if hasattr(model, "config") and hasattr(model, "budget0"):
        return type(model), getattr(model, "name", type(model).__name__)
    if callable(getattr(model, "build", None)):
        return model.build, getattr(model, "__name__", "model").rsplit(".", 1)[-1]
    if callable(model):
        return model, getattr(model, "__name__", "model")
    raise UsageError("model", model, "a catalogue name, a handoff model, or build(config) -> model")


def _observed_kinds(observed: Iterable[str] | None, header: HistoryHeader) -> frozenset[str]:
    if observed is None:
        declared = getattr(header, "observed", None)
        if declared is None:
            return frozenset(_ALL_KINDS)
        kinds = getattr(declared, "kinds", declared)
        return frozenset(kinds)
    if isinstance(observed, str):
        observed = [k for k in observed.replace(",", " ").split() if k]
    kinds = frozenset(observed)
    unknown = sorted(k for k in kinds if k not in EVENT_TYPES)
    if unknown:
        raise UsageError(
            "observed kind", unknown[0], "event kinds of the history format: " + ", ".join(_ALL_KINDS)
        )
    return kinds


def conform(
    history: Any,
    model: Any = "reference",
    *,
    policy: str | None = None,
    observed: Iterable[str] | str | None = None,
    complete: bool | None = None,
    block_size: int | None = None,
    chunks: int | None = None,
    layerwise: bool | None = None,
    max_silent: int = 10_000,
    max_frontier: int = 256,
) -> ConformanceResult:
    """Decide whether some behaviour of ``model`` explains ``history``.

    ``history``: a path (``"-"`` is standard input) or an iterable of events
    (or ``(line, event)`` pairs; a :class:`HistoryHeader` first sets the
    header).  ``model``: a catalogue name (``"reference"``, a mutant), a
    handoff model instance, or ``build(config) -> model``.  ``policy``
    overrides the header's.  ``observed``: the event kinds the history
    observed (default: the header's declaration, else every kind); the
    model's events of other kinds are silent.  ``complete`` (default: the
    header's) requires every model step the history began to be seen whole.
    ``block_size`` (default: the header's, else inferred from the block
    counts) sizes the model's blocks; ``chunks`` and ``layerwise`` its
    handoff (format 1.1; default: the most transfers one ticket started, and
    whether a transfer names ``layers``).  ``max_silent`` bounds the silent closure of one
    state and ``max_frontier`` the configurations kept per request (the
    result says ``bounded`` when either was hit).

    A malformed history raises :class:`~pdproto.HistoryFormatError`; a bad
    argument :class:`~pdproto.UsageError`."""
    header, events, last_line = _events_of(history)
    policy = policy or header.policy
    complete = header.complete if complete is None else bool(complete)
    kinds = _observed_kinds(observed, header)
    build, name = _builder(model, policy)
    shapes = _shapes(events, {w: spec.role for w, spec in (header.workers or {}).items()})
    bs = block_size or header.block_size or _infer_block_size(shapes)
    seen_chunks, seen_layers = _infer_chunks(shapes)
    if seen_layers and header.kv is not None and header.kv.layers:  # one chunk per layer
        seen_chunks = max(seen_chunks, header.kv.layers)
    chunks = seen_chunks if chunks is None else chunks
    layerwise = seen_layers if layerwise is None else layerwise
    if layerwise and chunks < 2:
        layerwise = False
    base = ModelConfig(
        policy=policy,
        requests=1,
        blocks=4,
        block_size=bs,
        prompt_len=max(chunks, 1),
        faults={k: _UNLIMITED for k in FAULT_KINDS},
        chunks=chunks,
        layerwise=layerwise,
    )
    search = _Search(build, base, shapes, kinds, header, max_silent, max_frontier)
    monitor = _monitor(header, policy, complete, observed, kinds)
    failure: _Failure | None = None
    for line, e in events:
        monitor.feed(e, line)
        if failure is None and e.EV in kinds:
            try:
                _step(search, e, line)
            except _Failure as f:
                failure = f
    monitor.line = max(monitor.line, last_line)
    monitor.finish()
    if failure is None and complete:
        for rq in search.reqs.values():
            whole = [c for c in rq.cfgs if not c.pending]
            if not whole:
                failure = _Failure(
                    last_line,
                    rq.name,
                    None,
                    "end of history: a model step of this request was seen in part only",
                    rq.cfgs,
                    rq.proj,
                )
                break
            if not any(rq.proj.quiet(c.state) for c in whole):
                failure = _Failure(
                    last_line,
                    rq.name,
                    None,
                    "end of history: the model cannot be quiet here without a step the history does not show",
                    rq.cfgs,
                    rq.proj,
                )
                break
    bounded = search.bounded or any(p.bounded for p in search.models.values())
    common = dict(
        events=len(events),
        requests=len(shapes),
        model=name,
        policy=policy,
        observed=tuple(k for k in _ALL_KINDS if k in kinds),
        complete=complete,
        violations=tuple(monitor.violations),
        bounded=bounded,
        not_judged=tuple(entry[0] for entry in getattr(monitor, "not_judged", ())),
    )
    if failure is None:
        return ConformanceResult(ok=True, **common)  # type: ignore[arg-type]
    states: list[str] = []
    expected: list[str] = []
    renaming: dict[str, str] = {}
    total = 0
    if failure.proj is not None and failure.cfgs:
        proj = failure.proj
        seen: dict[str, None] = {}
        for c in failure.cfgs:
            starts = [c] if c.pending else [_Cfg(s, (), c.ren) for s in proj.closure(c.state)]
            for sc in starts:
                seen.setdefault(_summary(proj, sc, failure.request or "?"))
        total = len(seen)
        states = list(seen)[:SHOWN_STATES]
        expected = _expected(proj, failure.cfgs, failure.request or "?")[:SHOWN_EVENTS]
        renaming = _renaming(failure.cfgs[0].ren)
    return ConformanceResult(
        ok=False,
        line=failure.line,
        request=failure.request,
        event=failure.event.to_dict() if failure.event is not None else None,
        reason=failure.reason,
        states=tuple(states),
        states_total=total,
        expected=tuple(expected),
        renaming=renaming,
        **common,  # type: ignore[arg-type]
    )


def _monitor(
    header: HistoryHeader, policy: str, complete: bool, observed: Any, kinds: frozenset[str]
) -> Monitor:
    """The monitor of the same history: partial as the header says, or as
    ``observed`` overrides it."""
    if observed is None:
        return Monitor.from_header(header, policy=policy, complete=complete)
    from ..spec import Observation

    return Monitor.from_header(header, policy=policy, complete=complete, observed=Observation(kinds))


def _step(search: _Search, e: Event, line: int) -> None:
    """Feed one observed event to the request(s) it concerns."""
    ev = e.EV
    if ev == "restart":
        _restart(search, e, line)  # type: ignore[arg-type]
        return
    name = getattr(e, "request", None)
    if name is None and ev in (
        "transfer_read_done",
        "transfer_write_done",
        "transfer_failed",
        "transfer_abort",
    ):
        name = search.xfer_req.get(e.transfer)  # type: ignore[attr-defined]
    elif ev == "free" and name is None:
        name = search.owner(e.worker, e.blocks)  # type: ignore[attr-defined]
    if name is None:
        name = _adopt(search, e, line)
    rq = search.request(name)
    cfgs = search.advance(rq, e, line)
    if not cfgs:
        why = "no behaviour of the model explains this event here"
        raise _Failure(line, name, e, why, rq.cfgs, rq.proj)
    # shared resources, on the real ids
    if ev in ("reserve", "prefill_start", "alloc", "share"):
        try:
            search.take(name, e, line, shared=ev == "share")
        except _Failure as f:
            f.cfgs, f.proj = rq.cfgs, rq.proj  # what the request's model could do there
            raise
    elif ev == "free":
        search.give(name, e.worker, e.blocks)  # type: ignore[attr-defined]
    elif ev == "transfer_start":
        search.xfer_req[e.transfer] = name  # type: ignore[attr-defined]
        search.writing[e.transfer] = (e.dst, e.dst_blocks)  # type: ignore[attr-defined]
    elif ev in ("transfer_write_done", "transfer_failed"):
        search.transfer_over(e.transfer, True)  # type: ignore[attr-defined]
    search.commit(rq, cfgs, line)


def _adopt(search: _Search, e: Event, line: int) -> str:
    """The request an event that names none belongs to (its transfer's start
    or its blocks' allocation were not observed): the most recent request
    whose search can explain it (a greedy choice: see docs/conformance.md)."""
    for rq in sorted(search.reqs.values(), key=lambda r: -r.last):
        if search.advance(rq, e, line):
            if hasattr(e, "transfer"):
                search.xfer_req[e.transfer] = rq.name  # type: ignore[attr-defined]
            return rq.name
    raise _Failure(
        line,
        None,
        e,
        "no request's behaviour explains this event (it names no request, and "
        "no observed event tied its transfer or blocks to one)",
    )


def _restart(search: _Search, e: Restart, line: int) -> None:
    """A restart is an event of every request that binds the worker, and of
    every request that could be routed there without having shown it."""
    w = e.worker
    bound = search.by_worker.get(w, set())
    for rq in list(search.reqs.values()):
        if rq.name not in bound and not _unbound_role(rq, search.roles.get(w)):
            continue
        cfgs = search.restart(rq, e, line)
        if not cfgs:
            raise _Failure(
                line,
                rq.name,
                e,
                "no behaviour of the model explains this restart for this request",
                rq.cfgs,
                rq.proj,
            )
        search.commit(rq, cfgs, line)
    search.restart_pool(w)


def _unbound_role(rq: _Request, role: str | None) -> bool:
    """Some configuration of ``rq`` has not bound a worker of ``role`` yet."""
    want = ("P0",) if role == "prefill" else ("D0",) if role == "decode" else ("P0", "D0")
    return any(any(("w", m) not in c.ren.fwd for m in want) for c in rq.cfgs)
