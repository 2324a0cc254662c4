"""One worker's share of a parallel search (:mod:`._parallel`): a shard.

A product state belongs to the shard ``hash(part) % n``, where ``part`` is
the model half of its search key (the state, or its canonical form under
symmetry): every worker process hashes alike (forked workers inherit the
hash seed, spawned ones and Ray actors run with ``PYTHONHASHSEED=0``, and
the coordinator checks that they agree before the search), and the monitor
half, an id local to each process, never enters the partition.

A shard owns its share of the visited set (exact keys or fingerprints), the
parent links of its states and its share of each level's frontier.  A state
is named across shards by its *global id* ``local index * n + shard``.
Per level, :meth:`Shard.expand` expands the frontier: successors the shard
owns are added at once, the others go into one batch per owner (the model
states, the owner's view of the monitor state as its key, the parent's
global id, the action index, the violation if the transition broke a rule);
:meth:`Shard.merge` adds the batches the other shards sent.  Batches are
pickled bytes, so the coordinator (or Ray's object store) moves them without
looking inside.

Nothing here knows processes or Ray: :mod:`._parallel` and :mod:`._ray`
drive shards; the parallel fuzzer can reuse the partition (:func:`owner`)
and the batch format.
"""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Callable
from typing import Any

from ..spec import Monitor
from ._search import (
    _CONCRETE,
    _SKIP,
    _append_wide,
    _key_functions,
    _meet,
    _MonitorStates,
    _rss,
    _symmetry_hooks,
)
from ._visited import _BAD, _PAIR, _flat_type, _unpack, _Visited

#: the kinds of finding, in the order a shard reports them
KINDS = ("violation", "state-invariant", "deadlock")


def owner(part: Any, n: int) -> int:
    """The shard (of ``n``) that owns states whose partition part is ``part``."""
    return hash(part) % n


class Shard:
    """Shard ``wid`` of ``n``: its visited set, links, frontier and findings."""

    def __init__(
        self,
        model: Any,
        template: Monitor | None,
        wid: int,
        n: int,
        *,
        symmetry: bool,
        fingerprint: bool,
        intern: bool,
        check_deadlock: bool,
    ) -> None:
        self.model, self.template, self.wid, self.n = model, template, wid, n
        self.check_deadlock = check_deadlock
        self.invariants = dict(getattr(model, "invariants", None) or {})
        self.unmet = dict(getattr(model, "sometimes", None) or {})
        self.init_states = list(model.initial_states())
        self.scls: type = type(self.init_states[0]) if self.init_states else tuple
        self.mons = _MonitorStates(template)
        hooks = _symmetry_hooks(model, symmetry)
        self.sym_mode = hooks[0]
        self.concrete = self.sym_mode in _CONCRETE
        self.visited = _Visited(fingerprint, intern, not self.concrete)
        self.flat_key, self.product_key, self.canon_key = _key_functions(hooks, self.mons, self.scls)
        self.sym_hook = hooks[2] if self.sym_mode == "renaming" else None
        self.fast = self.concrete and _flat_type(self.scls)
        self.part = _part_function(hooks, self.concrete, self.mons.keys)
        self.ikey = self.visited.interner.key if self.visited.interner is not None else None
        self.parents = array("i")  # local index -> parent's global id (-1: initial); widened past 2**31
        self.via = array("H")  # local index -> action index in the parent (initial index)
        # this level's entries (as in the serial search; _SKIP for a state not
        # expanded): entry i is the state of local index start + i
        self.frontier: list = []
        self.next: list = []
        self.start = self.next_start = 0
        self.level = 0
        self.checks = bool(self.invariants or self.unmet)
        self.transitions = 0
        self.found: dict[str, tuple] = {}  # invariant -> (depth, kind rank, gid, kind, message)
        self.met: set[str] = set()

    # -- the coordinator's calls -------------------------------------------

    def probe(self) -> list[int]:
        """Hashes that must agree across shards: a fixed string, the initial
        states' parts."""
        return [hash("pdproto partition probe")] + [hash(self.part(s, 0)) for s in self.init_states]

    def seed(self) -> dict[str, Any]:
        """Add the initial states this shard owns (level 0)."""
        n, wid = self.n, self.wid
        for i, state in enumerate(self.init_states):
            if owner(self.part(state, 0), n) == wid:
                self._add(state, 0, -1, i, None)
        return self._swap(False)

    def expand(self) -> tuple[dict[str, Any], list[bytes | None]]:
        """Expand this level's frontier; return the stats and one pickled
        batch per shard (None for none, and for this one)."""
        n, wid, part, step, actions_of = self.n, self.wid, self.part, self.model.step, self.model.actions
        mons = self.mons
        template, after = mons.template, mons.after
        scls, add = self.scls, self._add
        fast, keys, start = self.fast, self.visited.keys, self.start
        sym_hook, rename, canon_key = self.sym_hook, mons.rename, self.canon_key
        out = [_Batch() if w != wid else None for w in range(n)]
        sent: set = set()  # the (good) successors sent this level, to any shard: each goes once
        transitions = 0
        # the hot path (a new concrete flat state owned here) is inline, as in the serial loop
        parents, via, nxt, level1 = self.parents, self.via, self.next, self.level + 1
        kkey = self.visited.kinterner.key if self.visited.kinterner is not None else None
        checks, check_state = self.checks, self._check_state
        for i, entry in enumerate(self.frontier):
            if entry is _SKIP:
                continue
            state, mid = _unpack(entry, scls)
            acts = actions_of(state)
            pgid = (start + i) * n + wid
            if not acts:
                self._quiet(mid, pgid)
                continue
            for ai, act in enumerate(acts):
                nstate, events = step(state, act)
                transitions += 1
                if events and template is not None:
                    nmid, bads = after(mid, events)
                    bad = bads[0] if bads else None
                else:
                    nmid, bad = mid, None
                fast_state = fast and type(nstate) is scls
                if sym_hook is not None:
                    # the canonical state and the renamed monitor id, once: the
                    # owner gets both (it need not run the model's hook again)
                    cstate, ren = sym_hook(nstate)
                    rmid = nmid if nmid == 0 or ren is None else rename(nmid, ren)
                    dest = hash(cstate) % n
                    if dest == wid:
                        add(nstate, nmid, pgid, ai, bad, canon_key(cstate, rmid))
                        parents, via = self.parents, self.via
                    elif bad is not None or (skey := (cstate, rmid)) not in sent:
                        if bad is None:
                            sent.add(skey)
                        out[dest].add_canonical(nstate, nmid, pgid, ai, bad, cstate, rmid)  # type: ignore[union-attr]
                    continue
                dest = hash(nstate if fast_state else part(nstate, nmid)) % n
                if dest == wid:
                    if bad is None and fast_state and keys is not None:
                        key = nstate + (nmid, _PAIR) if nmid else nstate
                        if key in keys:
                            continue
                        if kkey is not None:
                            key = kkey(key) if nmid else kkey(key, 0)
                        keys.add(key)
                        try:
                            parents.append(pgid)
                            via.append(ai)
                        except OverflowError:
                            self._widen(pgid, ai)
                            parents, via = self.parents, self.via
                        if checks:
                            check_state(nstate, (len(parents) - 1) * n + wid, level1)
                            checks = self.checks
                        nxt.append(key)
                    else:
                        add(nstate, nmid, pgid, ai, bad)
                        parents, via = self.parents, self.via
                else:
                    if bad is None and fast_state:  # one copy of a successor per level is enough
                        skey = nstate + (nmid, _PAIR) if nmid else nstate
                        if skey in sent:
                            continue
                        sent.add(skey)
                    b = out[dest]
                    if bad is not None:
                        b.bads[len(b.states)] = (bad.invariant, bad.message)  # type: ignore[union-attr]
                    b.states.append(nstate)  # type: ignore[union-attr]
                    b.mids.append(nmid)  # type: ignore[union-attr]
                    b.pgids.append(pgid)  # type: ignore[union-attr]
                    b.ais.append(ai)  # type: ignore[union-attr]
        self.transitions += transitions
        batches = [None if b is None or not b.states else b.pack(mons.keys) for b in out]
        return self._stats(transitions), batches

    def merge(self, batches: list[bytes | None]) -> dict[str, Any]:
        """Add the successors the other shards sent; the next level becomes
        the frontier."""
        intern, add, new, fast, scls = self.mons.intern, self._add, self._new, self.fast, self.scls
        keys = self.visited.keys
        for blob in batches:
            if blob is None:
                continue
            table, states, smids, pgids, ais, bads, cstates, rmids = pickle.loads(blob)
            mids = {smid: intern(k) for smid, k in table.items()} if table else {0: 0}
            if cstates is not None:  # canonical states and renamed monitor ids along
                canon_key = self.canon_key
                for j, nstate in enumerate(states):
                    bad = bads.get(j) if bads else None
                    add(
                        nstate,
                        mids[smids[j]],
                        pgids[j],
                        ais[j],
                        None if bad is None else _Found(*bad),
                        canon_key(cstates[j], mids[rmids[j]]),
                    )
                continue
            for j, nstate in enumerate(states):
                nmid = mids[smids[j]]
                if bads and j in bads:
                    bad = bads[j]
                    add(nstate, nmid, pgids[j], ais[j], _Found(bad[0], bad[1]))
                elif fast and keys is not None and type(nstate) is scls:
                    key = nstate + (nmid, _PAIR) if nmid else nstate
                    if key not in keys:
                        new(key, nstate, pgids[j], ais[j])
                else:
                    add(nstate, nmid, pgids[j], ais[j], None)
        return self._swap(True)

    def links(self, gids: list[int]) -> list[tuple[int, int]]:
        """(parent global id, action index) of each of these states (owned here)."""
        n = self.n
        return [(self.parents[g // n], self.via[g // n]) for g in gids]

    def finish(self) -> dict[str, Any]:
        """What the coordinator needs for the result: findings, sometimes met,
        the monitor states seen, memory."""
        states = len(self.parents)
        memory: dict[str, int] = {"links": self.parents.itemsize * states + self.via.itemsize * states}
        self.visited.account(memory, states)
        return {
            "found": self.found,
            "met": sorted(self.met),
            "monitor_keys": list(self.mons.keys),
            "memory": memory,
            "states": states,
            "rss": _rss(),
        }

    # -- inside ----------------------------------------------------------------

    def _add(self, nstate: Any, nmid: int, pgid: int, ai: int, bad: Any, key: Any = None) -> None:
        """A successor (or initial state) owned here: add it when new.
        ``key``: its search key, when the caller has it."""
        if key is not None:
            pass
        elif self.fast and type(nstate) is self.scls:
            key = nstate + (nmid, _PAIR) if nmid else nstate
        else:
            key = self.flat_key(nstate, nmid) if self.concrete else self.product_key(nstate, nmid)
        if bad is not None:
            key = (_BAD, key, bad.invariant)
        visited = self.visited
        if visited.fpset is not None:
            if visited.add(key) is None:
                return
        else:
            keys = visited.keys
            if key in keys:  # type: ignore[operator]
                return
            kkey = visited.kinterner.key if visited.kinterner is not None else None
            if kkey is not None and type(key) is tuple and key:
                if key[-1] is _PAIR:
                    key = kkey(key)
                elif key is nstate and self.fast and type(nstate) is self.scls:
                    key = kkey(key, 0)
            keys.add(key)  # type: ignore[union-attr]
        self._link(pgid, ai)
        depth = self.level + 1 if pgid >= 0 else 0
        gid = (len(self.parents) - 1) * self.n + self.wid
        if bad is not None:
            self._record("violation", bad.invariant, gid, depth, bad.message)
            self.next.append(_SKIP)  # a violating state is not expanded
            return
        if self.checks:
            self._check_state(nstate, gid, depth)
        if visited.fpset is None and self.concrete:
            self.next.append(key)  # the stored key (fields already interned) is a frontier entry
        else:
            self.next.append(self.flat_key(nstate, nmid, self.ikey))

    def _new(self, key: Any, nstate: Any, pgid: int, ai: int) -> None:
        """A new concrete flat state (exact mode, no violation): ``key`` its
        stored form, known to be new."""
        kkey = self.visited.kinterner
        if kkey is not None:
            key = kkey.key(key) if key is not nstate else kkey.key(key, 0)
        self.visited.keys.add(key)  # type: ignore[union-attr]
        self._link(pgid, ai)
        if self.checks:
            self._check_state(nstate, (len(self.parents) - 1) * self.n + self.wid, self.level + 1)
        self.next.append(key)

    def _link(self, pgid: int, ai: int) -> None:
        try:
            self.parents.append(pgid)
            self.via.append(ai)
        except OverflowError:
            self._widen(pgid, ai)

    def _widen(self, pgid: int, ai: int) -> None:
        """Store the links of the next state in wider arrays (an index or an
        action number outgrew the item type; one append may have landed)."""
        self.parents = _append_wide(self.parents, len(self.via), pgid, "q")
        self.via = _append_wide(self.via, len(self.via), ai, "l")

    def _quiet(self, mid: int, gid: int) -> None:
        if self.check_deadlock and self.template is not None:
            ends = self.mons.monitor(mid).end_violations()
            if ends:
                self._record("deadlock", ends[0].invariant, gid, self.level, ends[0].message)

    def _check_state(self, state: Any, gid: int, depth: int) -> None:
        unmet = self.unmet
        if unmet:
            self.met.update(_meet(unmet, state))
        for name, pred in self.invariants.items():
            if not pred(state):
                self._record("state-invariant", name, gid, depth, f"state invariant {name!r} fails")
        self.checks = bool(self.invariants or unmet)

    def _record(self, kind: str, inv: str, gid: int, depth: int, message: str) -> None:
        """Keep the shallowest finding of each invariant (ties: the kind order
        of :data:`KINDS`, then the smaller global id)."""
        new = (depth, KINDS.index(kind), gid, kind, message)
        old = self.found.get(inv)
        if old is None or new[:3] < old[:3]:
            self.found[inv] = new

    def _swap(self, deeper: bool) -> dict[str, Any]:
        """The next level becomes the frontier; return the stats."""
        self.frontier, self.next = self.next, []
        self.start, self.next_start = self.next_start, len(self.parents)
        self.level += deeper
        return self._stats(0)

    def _stats(self, transitions: int) -> dict[str, Any]:
        return {
            "states": len(self.parents),
            "transitions": self.transitions,
            "frontier": len(self.frontier),
            "found": min((v[0] for v in self.found.values()), default=None),
            "rss": _rss(),
        }


class _Found:
    """A violation as a batch carries it: invariant and message."""

    __slots__ = ("invariant", "message")

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant, self.message = invariant, message


def _part_function(
    hooks: tuple[str, Any, Any, Any], concrete: bool, mkeys: list
) -> Callable[[Any, int], Any]:
    """``part(state, mid)``: the part of a state's search key that is the same
    object in every process (the partition hashes it): the model half, or the
    whole product key when the model's hook makes it (it holds the monitor's
    key, not its process-local id)."""
    mode, canonical_product, sym_hook, canonical = hooks
    if concrete:
        return lambda state, mid: state
    if mode == "product":
        return lambda state, mid: canonical_product(state, mkeys[mid])
    if mode == "renaming":
        return lambda state, mid: sym_hook(state)[0]
    return lambda state, mid: canonical(state)


class _Batch:
    """The successors one shard sends another in one level, as columns: the
    states, their monitor ids (the sender's), the parents' global ids, the
    action indices, and the violations by position."""

    __slots__ = ("states", "mids", "pgids", "ais", "bads", "cstates", "rmids")

    def __init__(self) -> None:
        self.states: list = []
        self.mids = array("l")
        self.pgids = array("q")
        self.ais = array("l")
        self.bads: dict[int, tuple[str, str]] = {}
        self.cstates: list | None = None  # under a renaming symmetry: the canonical states
        self.rmids: array | None = None  # ... and the renamed monitor ids

    def add_canonical(
        self, nstate: Any, nmid: int, pgid: int, ai: int, bad: Any, cstate: Any, rmid: int
    ) -> None:
        if self.cstates is None:
            self.cstates, self.rmids = [], array("l")
        if bad is not None:
            self.bads[len(self.states)] = (bad.invariant, bad.message)
        self.states.append(nstate)
        self.mids.append(nmid)
        self.pgids.append(pgid)
        self.ais.append(ai)
        self.cstates.append(cstate)
        self.rmids.append(rmid)  # type: ignore[union-attr]

    def pack(self, mkeys: list[tuple]) -> bytes:
        """Pickled, with the monitor key of each monitor id used (each once)."""
        used = set(self.mids)
        if self.rmids is not None:
            used.update(self.rmids)
        # (no monitor, no keys: every monitor id is 0)
        table = {mid: mkeys[mid] for mid in used} if mkeys else {}
        return pickle.dumps(
            (table, self.states, self.mids, self.pgids, self.ais, self.bads, self.cstates, self.rmids),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
