"""Symmetry reduction of the reference handoff model.

Requests (with their ticket and transfer ids), the blocks of one pool and the
workers of one role are interchangeable: the model uses request and worker
indices and block ids only for equality (and takes blocks lowest-first among
the free ones, which are blank: held by nobody, written by no live transfer,
not tracked by the monitor), so renaming them maps every run to a run with
the renamed events, which the monitor judges alike.  :class:`HandoffSymmetry`
picks one renaming per state deterministically and returns it with the
renamed state (the model's ``symmetry(state)`` hook); the explorer applies
the :class:`~pdproto.protocol._model.Renaming` to the monitor's key, and keys
its cache of renamed monitor states by ``Renaming.key()``.

Candidates are compared as tuples, so the order of the state's enums (see
``_state``) decides which state of an orbit is canonical.
"""

from __future__ import annotations

from itertools import permutations
from typing import Any

from ._config import FAULT_KINDS
from ._model import Renaming
from ._state import HState, Msg, Req, Xfer, new

__all__ = ["HandoffSymmetry"]

_RETRY = FAULT_KINDS.index("retry")
_MEMO_LIMIT = 1 << 20


class _Ren(Renaming):
    """A Renaming whose ``key()`` is the compact permutation it came from
    (the explorer keys its cache of renamed monitor states by it)."""

    __slots__ = ("_key",)

    def key(self) -> tuple:
        return self._key  # type: ignore[attr-defined, no-any-return]


class HandoffSymmetry:
    """The ``symmetry`` hook of one :class:`HandoffModel`.  The model's class
    flags ``SYMMETRIC_REQUESTS``, ``SYMMETRIC_BLOCKS`` and ``SYMMETRIC_WORKERS``
    choose what is renamed (a mutant whose free blocks are not blank turns
    block renaming off)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.np, self.nd, self.nblocks = model.np, model.nd, model.nblocks
        self.requests = model.SYMMETRIC_REQUESTS
        self.blocks = model.SYMMETRIC_BLOCKS
        self.wperms = self._worker_perms(model.SYMMETRIC_WORKERS)
        self.ident_b = tuple(b for _ in range(self.np + self.nd) for b in range(self.nblocks))
        self.plain = (
            self.np == 1 and self.nd == 1 and (self.nblocks == 1 or not self.blocks) and self.requests
        )
        self._memo: dict = {}
        self._renamings: dict = {}

    def _worker_perms(self, symmetric: bool) -> tuple[tuple[int, ...], ...]:
        if not symmetric:
            return (tuple(range(self.np + self.nd)),)
        np_ = self.np
        return tuple(
            pp + dp for pp in permutations(range(np_)) for dp in permutations(range(np_, np_ + self.nd))
        )

    def symmetry(self, state: HState) -> tuple[Any, Renaming | None]:
        """``(canonical_state, renaming)`` (see docs/modeling.md): the renamed
        state and the renaming of request, ticket, transfer and worker names
        and of block ids that produced it (``None`` when it is the identity)."""
        if self.plain:
            return self._plain(state)
        memo = self._memo
        hit = memo.get(state)
        if hit is None:
            hit = self._general(state)
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            memo[state] = hit
        return hit

    def _plain(self, state: HState) -> tuple[Any, Renaming | None]:
        """One worker per role and no block renaming (one block per pool, or
        block renaming off): only the submitted requests are reordered, by
        their records; worker indices and block ids stay as they are."""
        reqs = state[0]
        if len(reqs) == 2:  # the common case, spelled out
            q0, q1 = reqs
            if q1.gen < 0 or q0 < q1:
                return state, None
            if q1 < q0:
                order: Any = (1, 0)
            else:
                return self._general(state)  # a tie: the full signature decides
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
                    return self._general(state)
            if order == list(range(n)):
                return state, None
            order = tuple(order) + tuple(range(n, len(reqs)))
        rp = [0] * len(order)
        for j, r in enumerate(order):
            rp[r] = j
        reqs_, xfers, msgs, inc, budget = state
        cstate = new(
            HState,
            (
                tuple(reqs_[r] for r in order),
                tuple(new(Xfer, (rp[x[0]],) + x[1:]) for x in xfers),
                tuple(new(Msg, (m[0], rp[m[1]]) + m[2:]) for m in msgs),
                inc,
                budget,
            ),
        )
        return cstate, self.renaming((tuple(rp), self.wperms[0], None))

    def _order(self, reqs: tuple, xfers: tuple, msgs: tuple, n: int, wp: tuple, plain: bool) -> list[int]:
        """The submitted requests, ordered by what they look like (block ids aside)."""
        if n <= 1 or not self.requests:
            return list(range(n))
        if plain:
            # one worker per role: a request's own record (block ids aside)
            # usually tells the requests apart; the full signature is needed
            # only on a tie
            cores = [
                (q.gen, q.ph, q.end, len(q.src), q.pinc, len(q.dst), q.dinc, q.xs, q.ndec, q.pfx)
                for q in reqs[:n]
            ]
            if len(set(cores)) == n:
                return sorted(range(n), key=cores.__getitem__)
        sigs = []
        for r in range(n):
            q = reqs[r]
            sigs.append(
                (
                    (
                        q.gen,
                        q.ph,
                        q.end,
                        wp[q.p],
                        wp[q.d],
                        len(q.src),
                        q.pinc,
                        len(q.dst),
                        q.dinc,
                        q.xs,
                        q.ndec,
                        q.pfx,
                    ),
                    tuple(
                        (i, m.kind, m.gen, wp[m.frm], m.inc, wp[m.to]) for i, m in enumerate(msgs) if m.r == r
                    ),
                    tuple(
                        (
                            i,
                            x.gen,
                            wp[x.p],
                            len(x.src),
                            wp[x.d],
                            len(x.dst),
                            x.aborted,
                            x.doomed,
                            x.dst_lost,
                            x.chunk,
                        )
                        for i, x in enumerate(xfers)
                        if x.r == r
                    ),
                    r,
                )
            )
        sigs.sort()
        return [sig[3] for sig in sigs]

    def _block_perm(self, reqs: tuple, xfers: tuple, order: list[int]) -> tuple | None:
        """Blocks, numbered per pool in the order the renamed state names them."""
        nb = self.nblocks
        if not self.blocks or nb <= 1:
            return None
        nw = self.np + self.nd
        bm: dict = {}
        nxt = [0] * nw

        def name(w: int, bs: tuple) -> None:
            for b in bs:
                if (w, b) not in bm:
                    bm[(w, b)] = nxt[w]
                    nxt[w] += 1

        for r in order:
            q = reqs[r]
            name(q.p, q.src)
            name(q.d, q.dst)
        for x in xfers:
            name(x.p, x.src)
            name(x.d, x.dst)
        for w in range(nw):
            if nxt[w] < nb:
                name(w, tuple(range(nb)))
        return tuple(bm[(w, b)] for w in range(nw) for b in range(nb))

    def _general(self, state: HState) -> tuple[Any, Renaming | None]:
        reqs, xfers, msgs, inc, budget = state
        nreq = len(reqs)
        n = 0
        while n < nreq and reqs[n][0] >= 0:
            n += 1
        wperms = self.wperms
        if n <= 1 and (self.nblocks == 1 or not self.blocks) and len(wperms) == 1:
            return state, None
        nw = self.np + self.nd
        best = None
        single = len(wperms) == 1
        plain = single and self.np == 1 and self.nd == 1
        ident_r = list(range(n))
        for wp in wperms:
            order = self._order(reqs, xfers, msgs, n, wp, plain)
            rp = [0] * nreq
            for j, r in enumerate(order):
                rp[r] = j
            for r in range(n, nreq):
                rp[r] = r
            bperm = self._block_perm(reqs, xfers, order)
            if single and order == ident_r and (bperm is None or bperm == self.ident_b):
                return state, None  # already canonical
            creqs, cx = self._renamed(reqs, xfers, n, order, rp, wp, bperm)
            cm = tuple(new(Msg, (m.kind, rp[m.r], m.gen, wp[m.frm], m.inc, wp[m.to])) for m in msgs)
            cinc = [0] * nw
            for w in range(nw):
                cinc[wp[w]] = inc[w]
            cand = (new(HState, (creqs, cx, cm, tuple(cinc), budget)), (tuple(rp), wp, bperm))
            if best is None or cand[0] < best[0]:
                best = cand
        assert best is not None
        cstate, rkey = best
        return cstate, self.renaming(rkey)

    def _renamed(
        self, reqs: tuple, xfers: tuple, n: int, order: list, rp: list, wp: tuple, bperm: Any
    ) -> tuple:
        """The renamed requests and transfers."""
        if bperm is None:
            creqs = (
                tuple(
                    new(
                        Req,
                        (
                            q.gen,
                            q.ph,
                            q.end,
                            wp[q.p],
                            wp[q.d],
                            q.src,
                            q.pinc,
                            q.dst,
                            q.dinc,
                            q.xs,
                            q.ndec,
                            q.pfx,
                        ),
                    )
                    for q in (reqs[r] for r in order)
                )
                + reqs[n:]
            )
            cx = tuple(
                new(
                    Xfer,
                    (
                        rp[x.r],
                        x.gen,
                        wp[x.p],
                        x.src,
                        wp[x.d],
                        x.dst,
                        x.aborted,
                        x.doomed,
                        x.dst_lost,
                        x.chunk,
                    ),
                )
                for x in xfers
            )
            return creqs, cx
        nb = self.nblocks
        creqs = (
            tuple(
                new(
                    Req,
                    (
                        q.gen,
                        q.ph,
                        q.end,
                        wp[q.p],
                        wp[q.d],
                        tuple(bperm[q.p * nb + b] for b in q.src),
                        q.pinc,
                        tuple(bperm[q.d * nb + b] for b in q.dst),
                        q.dinc,
                        q.xs,
                        q.ndec,
                        q.pfx,
                    ),
                )
                for q in (reqs[r] for r in order)
            )
            + reqs[n:]
        )
        cx = tuple(
            new(
                Xfer,
                (
                    rp[x.r],
                    x.gen,
                    wp[x.p],
                    tuple(bperm[x.p * nb + b] for b in x.src),
                    wp[x.d],
                    tuple(bperm[x.d * nb + b] for b in x.dst),
                    x.aborted,
                    x.doomed,
                    x.dst_lost,
                    x.chunk,
                ),
            )
            for x in xfers
        )
        return creqs, cx

    def renaming(self, rkey: tuple) -> Renaming | None:
        """The (cached) Renaming of ``(request perm, worker perm, block perm)``."""
        try:
            return self._renamings[rkey]  # type: ignore[no-any-return]
        except KeyError:
            pass
        m = self.model
        rp, wp, bperm = rkey
        names: dict[str, str] = {}
        for r, j in enumerate(rp):
            if r != j:
                names[m.rname[r]] = m.rname[j]
                for g in range(m.budget0[_RETRY] + 1):
                    names[m.ticket(r, g)] = m.ticket(j, g)
                    for c in range(m.chunks):
                        names[m.tid(r, g, c)] = m.tid(j, g, c)
        for w, v in enumerate(wp):
            if w != v:
                names[m.wname[w]] = m.wname[v]
        blocks: dict[tuple[str, int], int] = {}
        if bperm is not None:
            nb = self.nblocks
            for i, nbk in enumerate(bperm):
                w, b = divmod(i, nb)
                if nbk != b:
                    blocks[(m.wname[w], b)] = nbk
        ren: Renaming | None = None
        if names or blocks:
            ren = _Ren(names, blocks)
            object.__setattr__(ren, "_key", rkey)
        self._renamings[rkey] = ren
        return ren
