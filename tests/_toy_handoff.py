"""A small push-mode handoff model for the explorer's tests, with switchable
bugs.  Requests r0..r{R-1}; one prefill worker P0 and one decode worker D0,
each with a pool of ``blocks`` blocks; a prompt fills one block.

Phases of a request: 0 new, 1 submitted, 2 reserved (holds a D block),
3 prefilled (holds a P block too), 4 transfer started, 5 read done (P block
freed), 6 committed, 7 ended.  ``cancel`` (a fault, budget ``cancels``)
ends a request in phases 1..3.
"""

from __future__ import annotations

from pdproto import (Cancel, Commit, Decode, Finish, Free, HistoryHeader, PrefillDone,
                     PrefillStart, Reserve, Submit, TransferReadDone, TransferStart,
                     TransferWriteDone, WorkerSpec)
from pdproto import Renaming
from pdproto.protocol import Action

EXPECTED = None
DEFAULT_CONFIG = None

BUGS = ("early-source-free", "leak", "stuck", "double-commit")


class ToyHandoff:
    def __init__(self, requests=2, blocks=2, cancels=1, bug=None, sometimes=True):
        assert bug is None or bug in BUGS
        self.name = f"toy-handoff{'-' + bug if bug else ''}"
        self.r, self.blocks, self.cancels, self.bug = requests, blocks, cancels, bug
        self.header = HistoryHeader(policy="push", complete=True, workers={
            "P0": WorkerSpec("prefill", blocks), "D0": WorkerSpec("decode", blocks)})
        self.invariants = {"blocks conserved": self._conserved}
        self.sometimes = {}
        if sometimes:
            self.sometimes = {
                "all finished": lambda s: all(p[0] == 7 for p in s[0]),
                "cancelled": lambda s: s[1] < self.cancels,
            }

    # state: (tuple of (phase, dblock, pblock) per request, cancels left)
    def initial_states(self):
        return [(((0, -1, -1),) * self.r, self.cancels)]

    def _free(self, reqs, idx, except_req=None):
        used = {p[idx] for p in reqs if p[0] < 7 and p[idx] >= 0}
        return [b for b in range(self.blocks) if b not in used]

    def _conserved(self, s):
        d = [p[1] for p in s[0] if p[1] >= 0]
        return len(d) == len(set(d))

    def actions(self, state):
        reqs, cancels = state
        out = []
        for i, (ph, db, pb) in enumerate(reqs):
            if ph == 0:
                out.append(Action("submit", "client", (i,)))
            elif ph == 1 and self._free(reqs, 1):
                out.append(Action("reserve", "D0", (i,)))
            elif ph == 2 and self._free(reqs, 2):
                out.append(Action("prefill", "P0", (i,)))
            elif ph == 3:
                out.append(Action("transfer", "P0", (i,)))
            elif ph == 4:
                out.append(Action("read_done", "P0", (i,)))
            elif ph == 5:
                out.append(Action("commit", "D0", (i,)))
            elif ph == 6 and not (self.bug == "stuck" and i == 1):
                out.append(Action("finish", "D0", (i,)))
            if 1 <= ph <= 3 and cancels:
                out.append(Action("cancel", "client", (i,), fault=True))
        return out

    def step(self, state, action):
        reqs, cancels = state
        i = action.args[0]
        ph, db, pb = reqs[i]
        r, t, x = f"r{i}", f"t-r{i}", f"x-r{i}"
        k = action.kind
        if k == "submit":
            new, evs = (1, -1, -1), (Submit(r, 0, prompt_len=3, max_new_tokens=2),)
        elif k == "reserve":
            b = self._free(reqs, 1)[0]
            new, evs = (2, b, -1), (Reserve(r, 0, t, "D0", (b,)),)
        elif k == "prefill":
            b = self._free(reqs, 2)[0]
            new, evs = (3, db, b), (PrefillStart(r, 0, "P0", (b,)), PrefillDone(r, 0, "P0", 7, 3))
        elif k == "transfer":
            evs = (TransferStart(x, t, r, 0, "P0", (pb,), "D0", (db,)),)
            if self.bug == "early-source-free":
                evs += (Free("P0", (pb,), r, 0),)
                new = (4, db, -1)
            else:
                new = (4, db, pb)
        elif k == "read_done":
            evs = (TransferReadDone(x),)
            if pb >= 0:
                evs += (Free("P0", (pb,), r, 0),)
            new = (5, db, -1)
        elif k == "commit":
            evs = (TransferWriteDone(x), Commit(r, 0, t, "D0"))
            if self.bug == "double-commit":
                evs += (Commit(r, 0, t, "D0"),)
            new = (6, db, -1)
        elif k == "finish":
            evs = (Decode(r, 0, "D0", 3, 7, 8, (db,)), Finish(r, 0, "length"))
            if self.bug != "leak":
                evs += (Free("D0", (db,), r, 0),)
            new = (7, -1, -1) if self.bug != "leak" else (7, db, -1)
        elif k == "cancel":
            evs = (Cancel(r, 0),)
            if pb >= 0:
                evs += (Free("P0", (pb,), r, 0),)
            if db >= 0:
                evs += (Free("D0", (db,), r, 0),)
            new, cancels = (7, -1, -1), cancels - 1
        else:
            raise ValueError(action)
        reqs = reqs[:i] + (new,) + reqs[i + 1:]
        return (reqs, cancels), evs

    # Requests are interchangeable, and so are the blocks of one pool: sort
    # the requests by their phase, then number the blocks in the order the
    # sorted requests hold them.  The same renaming goes to the monitor.
    def symmetry(self, state):
        reqs, cancels = state
        order = sorted(range(self.r), key=lambda i: reqs[i][0])
        names, blocks = {}, {}
        nextb = {"D0": 0, "P0": 0}
        new = []
        for j, i in enumerate(order):
            names[f"r{i}"], names[f"t-r{i}"], names[f"x-r{i}"] = f"r{j}", f"t-r{j}", f"x-r{j}"
            ph, db, pb = reqs[i]
            cell = [ph, db, pb]
            for w, pos in (("D0", 1), ("P0", 2)):
                b = cell[pos]
                if b >= 0:
                    if (w, b) not in blocks:
                        blocks[(w, b)] = nextb[w]
                        nextb[w] += 1
                    cell[pos] = blocks[(w, b)]
            new.append(tuple(cell))
        return (tuple(new), cancels), Renaming(names, blocks)


def rename_event(event, names, blocks):
    """``event`` with its ids renamed: ``names`` maps request, ticket,
    transfer and worker ids, ``blocks`` maps (old worker, block) to a block."""
    import attrs

    changes = {}
    for f in ("request", "ticket", "transfer", "worker", "src", "dst"):
        v = getattr(event, f, None)
        if v is not None:
            changes[f] = names.get(v, v)
    for f, w in (("blocks", getattr(event, "worker", None)), ("src_blocks", getattr(event, "src", None)),
                 ("dst_blocks", getattr(event, "dst", None))):
        if getattr(event, f, None) is not None:
            changes[f] = tuple(blocks.get((w, b), b) for b in getattr(event, f))
    return attrs.evolve(event, **changes)


def build(config=None):
    return ToyHandoff(**(config or {}))


model = ToyHandoff()
buggy = ToyHandoff(bug="early-source-free")
