"""The breadth-first search behind :func:`pdproto.explore`, in stages.

- setup: :class:`_MonitorStates` interns the monitor's verdict states (an int
  id each) and memoizes what a list of events does to them;
  :func:`_key_functions` turns the model's symmetry hooks into the search
  key of a product state; :class:`~._visited._Visited` is the visited set.
- :meth:`_Search._seed` adds the initial states, :meth:`_Search._loop` runs
  the level loop and handles every successor inline (it runs once per
  transition, so everything it needs is bound to locals up front and the
  rare cases call out: a quiet state, a violation, the data backend, a
  graph edge, a wider link array);
- :meth:`_Search._result` rebuilds the counterexamples from the parent
  links, accounts for memory and returns the :class:`ExploreResult`.
"""

from __future__ import annotations

import gc
import os
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from ..protocol import Renaming
from ..spec import HistoryHeader, Monitor, Violation
from ._results import Counterexample, ExploreResult
from ._traces import _build_graph, _counterexample, _path
from ._visited import _BAD, _PAIR, _flat_type, _unpack, _Visited

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: the frontier entry of a state that is not expanded (so that the entries
#: after it keep their state indices)
_SKIP = object()

#: symmetry modes in which a state's search key is its flat stored form
_CONCRETE = ("off", "none offered")


class _MonitorStates:
    """The monitor's verdict states seen so far, interned to ints (``mid``),
    with a memo of ``(mid, events) -> mid`` (or ``(mid, violations)`` when the
    events break a rule), keyed by one int: ``mid | (events id << 32)``."""

    __slots__ = ("template", "keys", "ids", "parts", "memo", "ev_ids", "limit", "renamed", "ren_ids", "_last")

    def __init__(self, template: Monitor | None, limit: int = 2_000_000) -> None:
        self.template = template
        self.keys: list[tuple] = []  # mid -> verdict key
        self.ids: dict[tuple, int] = {}  # verdict key -> mid
        self.parts: dict[Any, Any] = {}  # hash-consed key components
        self.memo: dict[int, Any] = {}
        self.ev_ids: dict[tuple, int] = {}
        self.limit = limit
        self.renamed: dict[int, int] = {}  # mid | (renaming id << 32) -> mid of renamed key
        self.ren_ids: dict[Any, int] = {}
        self._last: tuple[int, Monitor] | None = None  # the monitor of the last mid fed
        if template is not None:
            self.intern(template.key())

    def intern(self, k: tuple) -> int:
        mid = self.ids.get(k)
        if mid is None:
            parts = self.parts
            k = tuple(parts.setdefault(p, p) for p in k)
            mid = len(self.keys)
            self.keys.append(k)
            self.ids[k] = mid
        return mid

    def monitor(self, mid: int) -> Monitor:
        """A monitor in verdict state ``mid`` (no line bookkeeping)."""
        assert self.template is not None
        return self.template.with_key(self.keys[mid])

    def events_id(self, evs: tuple) -> int:
        """A new id for a tuple of events (the memo starts over when full)."""
        ev_ids = self.ev_ids
        if len(ev_ids) >= self.limit:
            ev_ids.clear()
            self.memo.clear()
        evid = ev_ids[evs] = len(ev_ids)
        return evid

    def after(self, mid: int, events: Any) -> tuple[int, tuple]:
        """(next mid, violations) of the monitor in state ``mid`` fed
        ``events`` (memoized)."""
        evs = events if type(events) is tuple else tuple(events)
        evid = self.ev_ids.get(evs)
        mk = mid | ((self.events_id(evs) if evid is None else evid) << 32)
        hit = self.memo.get(mk)
        if hit is None:
            hit = self.feed(mid, evs, mk)
        return (hit, ()) if type(hit) is int else hit

    def feed(self, mid: int, evs: tuple, mk: int) -> Any:
        """Feed ``evs`` to the monitor in state ``mid``; memoize the outcome
        under ``mk``: the next mid, or (next mid, violations)."""
        last = self._last
        if last is None or last[0] != mid:
            last = self._last = (mid, self.monitor(mid))
        child = last[1].copy()
        found: list[Violation] = []
        for ev in evs:
            found.extend(child.feed(ev))
        nmid = self.intern(child.key())
        hit = (nmid, tuple(found)) if found else nmid
        if len(self.memo) >= self.limit:
            self.memo.clear()
        self.memo[mk] = hit
        return hit

    def rename(self, mid: int, ren: Any) -> int:
        """The mid of verdict state ``mid`` under a renaming (a
        :class:`Renaming` or a ``(names, blocks)`` pair), cached."""
        rkey = ren.key() if isinstance(ren, Renaming) else ren
        rid = self.ren_ids.get(rkey)
        if rid is None:
            rid = self.ren_ids[rkey] = len(self.ren_ids)
        rk = mid | (rid << 32)
        rmid = self.renamed.get(rk)
        if rmid is None:
            r = ren if isinstance(ren, Renaming) else Renaming(*ren)
            rmid = self.renamed[rk] = self.intern(Monitor.renamed_key(self.keys[mid], r.names, r.blocks))
        return rmid


def _symmetry_hooks(model: Any, symmetry: bool) -> tuple[str, Any, Any, Any]:
    """(mode, canonical_product, symmetry, canonical): the hooks the model
    offers, the preferred one first, and the mode they make."""

    def hook(name: str) -> Any:
        f = getattr(model, name, None) if symmetry else None
        return f if callable(f) else None

    product, renaming, canonical = hook("canonical_product"), hook("symmetry"), hook("canonical")
    if not symmetry:
        mode = "off"
    elif product is not None:
        mode = "product"
    elif renaming is not None:
        mode = "renaming"
    elif canonical is not None:
        mode = "state-only"
    else:
        mode = "none offered"
    return mode, product, renaming, canonical


def _key_functions(
    hooks: tuple[str, Any, Any, Any], mons: _MonitorStates, scls: type
) -> tuple[Callable, Callable, Callable]:
    """(flat_key, product_key) for the hooks of :func:`_symmetry_hooks`:
    ``flat_key(state, mid)`` is the stored form of a concrete product state
    (a frontier entry), ``product_key(state, mid)`` its search key under the
    model's symmetry hooks; ``canon_key(cstate, mid)`` the search key of a
    canonical state and a (renamed) monitor id."""
    _, canonical_product, sym_hook, canonical = hooks
    mkeys, rename = mons.keys, mons.rename
    flat_types: dict[type, bool] = {}
    canon_flat: dict[type, bool] = {}

    def flat_key(state: Any, mid: int, intern: Callable | None = None) -> Hashable:
        """The stored form of (state, mid): the state itself for monitor id 0,
        else flat when the state's type allows; with its parts interned by
        ``intern`` when given."""
        cls = type(state)
        ok = flat_types.get(cls)
        if ok is None:
            ok = flat_types[cls] = _flat_type(cls) and cls is scls
        if ok:
            if mid == 0:
                return state if intern is None else intern(state, 0)
            return tuple(state) + (mid, _PAIR) if intern is None else intern(tuple(state) + (mid, _PAIR))
        return state if mid == 0 else (_PAIR, state, mid)

    def product_key(state: Any, mid: int) -> Hashable:
        if canonical_product is not None:
            return canonical_product(state, mkeys[mid])
        if sym_hook is not None:
            cstate, ren = sym_hook(state)
            return canon_key(cstate, mid if mid == 0 or ren is None else rename(mid, ren))
        if canonical is not None:
            state = canonical(state)
        return canon_key(state, mid)

    def canon_key(cstate: Any, mid: int) -> Hashable:
        # a canonical state may be of another type than the model's states
        cls = type(cstate)
        ok = canon_flat.get(cls)
        if ok is None:
            ok = canon_flat[cls] = _flat_type(cls)
        if ok:
            return tuple(cstate) + (mid, _PAIR)
        return cstate if mid == 0 else (_PAIR, cstate, mid)

    return flat_key, product_key, canon_key


class _Search:
    """One search: set up by ``__init__``, run by :meth:`run`."""

    def __init__(
        self,
        model: Any,
        *,
        header: HistoryHeader,
        template: Monitor | None,
        max_states: int | None,
        max_seconds: float | None = None,
        symmetry: bool,
        fingerprint: bool,
        progress: Callable[[dict[str, Any]], None] | None,
        progress_interval: float,
        keep_graph: bool,
        graph_limit: int,
        stop_on_first: bool,
        check_deadlock: bool,
        freeze_gc: bool,
        intern: bool,
        backend: Callable[[], Any] | None,
    ) -> None:
        self.model, self.header, self.template, self.backend = model, header, template, backend
        self.progress, self.progress_interval = progress, progress_interval
        self.stop_on_first, self.check_deadlock, self.freeze_gc = stop_on_first, check_deadlock, freeze_gc
        self.fingerprint, self.keep_graph, self.graph_limit = fingerprint, keep_graph, graph_limit
        self.limit = max_states if max_states is not None else -1
        self.max_seconds = max_seconds
        self.deadline = float("inf")
        self.stopped_by: str | None = None
        self.invariants = dict(getattr(model, "invariants", None) or {})
        self.sometimes = dict(getattr(model, "sometimes", None) or {})
        self.met: dict[str, None] = {}
        self.unmet = dict(self.sometimes)
        self.init_states = list(model.initial_states())
        self.scls: type = type(self.init_states[0]) if self.init_states else tuple
        self.mons = _MonitorStates(template)
        hooks = _symmetry_hooks(model, symmetry)
        self.sym_mode = hooks[0]
        self.visited = _Visited(fingerprint, intern, self.sym_mode not in _CONCRETE)
        self.flat_key, self.product_key, _ = _key_functions(hooks, self.mons, self.scls)
        self.ikey = self.visited.interner.key if self.visited.interner is not None else None
        self.parents = array("i")  # state index -> parent index (-1 for initial); widened past 2**31
        self.via = array("H")  # state index -> action index in the parent (initial index); widened past 65535
        self.index_of: dict | None = {} if keep_graph else None
        self.edges: list[tuple[int, int, str]] = []
        self.graph_ok = keep_graph
        self.found_ids: set[str] = set()
        self.pending: list[tuple[str, str, int, str]] = []  # (kind, invariant, state index, message)
        # A frontier entry is a flat tuple ``fields + (mid, _PAIR)`` (with
        # interned fields: in the plain search it is the stored key itself), a
        # ``(_PAIR, state, mid)`` triple, or a bare state with mid 0.
        self.frontier: deque = deque()
        self.bfront: deque | None = deque() if backend is not None else None  # data backends of the frontier
        self.peak_frontier = self.transitions = self.depth = 0
        self.levels: list[int] = []  # states per level, as far as the search got
        self.stopped = self.truncated = False
        self.t0 = self.next_report = self.seconds = 0.0

    # -- running -------------------------------------------------------------

    def run(self) -> ExploreResult:
        gc_was = gc.isenabled()
        if self.freeze_gc:
            # No gc.collect() first: on a large heap (a long test session) a full
            # collection costs seconds per search, and garbage frozen here is
            # collected as usual once the search unfreezes it.
            gc.freeze()
            gc.disable()
        self.t0 = time.perf_counter()
        self.next_report = self.t0 + self.progress_interval
        if self.max_seconds is not None:
            self.deadline = self.t0 + self.max_seconds
        try:
            if not self._seed():
                self._loop()
            self.seconds = time.perf_counter() - self.t0
        finally:
            if self.freeze_gc:
                gc.unfreeze()
                if gc_was:
                    gc.enable()
        return self._result()

    def _seed(self) -> bool:
        """Add the initial states; True when the search is already over."""
        concrete = self.sym_mode in _CONCRETE
        for i, state in enumerate(self.init_states):
            key = self.visited.add(self.flat_key(state, 0) if concrete else self.product_key(state, 0))
            if key is None:
                continue
            idx = len(self.parents)
            self.parents.append(-1)
            self.via.append(i)
            if self.index_of is not None:
                self.index_of[key] = idx
            self.frontier.append(self.flat_key(state, 0, self.ikey))
            if self.bfront is not None:
                b0 = self.backend()  # type: ignore[misc]
                b0.line = 1  # the header is line 1 of a written history
                self.bfront.append(b0)
            if self._check_state(state, idx):
                self.stopped = True
                return True
            if idx + 1 == self.limit:
                self.truncated = self.stopped = True
                self.stopped_by = "max_states"
                return True
        return False

    def _states(self) -> Iterator[tuple[int, Any, int, Any, list]]:
        """The level loop: yield ``(index, state, mid, data backend, actions)``
        for each frontier state, in BFS order, that enables something; handle
        the quiet ones (the search stops when one ends it)."""
        frontier, bfront, actions_of, scls = self.frontier, self.bfront, self.model.actions, self.scls
        level_end, expanded = len(self.parents), 0
        self.levels.append(level_end)
        while frontier:
            if expanded == level_end:
                self.depth += 1
                self.levels.append(len(self.parents) - level_end)
                level_end = len(self.parents)
                self.peak_frontier = max(self.peak_frontier, len(frontier))
            entry = frontier.popleft()
            if entry is _SKIP:  # a state that is not expanded keeps its place (its index)
                expanded += 1
                continue
            pb = bfront.popleft() if bfront is not None else None
            if type(entry) is not tuple or not entry:
                state, mid = entry, 0  # a bare state: monitor id 0
            else:
                state, mid = _unpack(entry, scls)
            pidx = expanded
            expanded += 1
            acts = actions_of(state)
            if acts:
                yield pidx, state, mid, pb, acts
            elif self._quiet(pidx, mid, pb):
                self.stopped = True
                return

    def _loop(self) -> None:
        """Successor handling: every transition of every state :meth:`_states`
        yields, inline (see the module doc)."""
        frontier, parents, via, limit, progress = (
            self.frontier,
            self.parents,
            self.via,
            self.limit,
            self.progress,
        )
        mons, visited, graph_ok = self.mons, self.visited, self.graph_ok
        template, after = mons.template, mons.after
        fpset, keys, kkey = visited.fpset, visited.keys, visited.kinterner and visited.kinterner.key
        fp_table, fp_mask = (fpset.table, fpset.mask) if fpset is not None else (None, 0)
        flat_key, product_key, ikey, fast_key = (
            self.flat_key,
            self.product_key,
            self.ikey,
            self.sym_mode in _CONCRETE,
        )
        fast_flat, scls, stored_entry = (
            fast_key and _flat_type(self.scls),
            self.scls,
            fast_key and fpset is None,
        )
        step, check_state, invariants, unmet = self.model.step, self._check_state, self.invariants, self.unmet
        checks = bool(invariants or unmet)
        transitions = self.transitions
        ticking = progress is not None or self.max_seconds is not None
        for pidx, state, mid, pb, acts in self._states():
            for ai, act in enumerate(acts):
                nstate, events = step(state, act)
                transitions += 1
                if events and template is not None:
                    nmid, bad = after(mid, events)
                else:
                    nmid, bad = mid, ()
                if fast_flat and type(nstate) is scls:
                    # monitor id 0: the state itself; else a plain flat tuple (also for a named tuple)
                    key = nstate + (nmid, _PAIR) if nmid else nstate
                else:
                    key = flat_key(nstate, nmid) if fast_key else product_key(nstate, nmid)
                if bad:  # the transition is bad, not only the state (which can equal a clean one
                    key = (_BAD, key, bad[0].invariant)  # seen before): keep the shortest bad path
                if fp_table is not None:
                    i = (fp := hash(key) or 1) & fp_mask
                    while (v := fp_table[i]) and v != fp:
                        i = (i + 1) & fp_mask
                    if v:
                        continue
                    fp_table[i] = fp
                    fpset.n += 1  # type: ignore[union-attr]
                    if fpset.n > fpset.limit:  # type: ignore[union-attr]
                        fp_table, fp_mask = fpset.grow()  # type: ignore[union-attr]
                elif key in keys:  # type: ignore[operator]
                    if graph_ok:
                        self.edges.append((pidx, self.index_of[key], str(act)))  # type: ignore[index]
                    continue
                else:
                    if kkey:
                        if type(key) is tuple and key and key[-1] is _PAIR:
                            key = kkey(key)
                        elif key is nstate and fast_flat and type(nstate) is scls:
                            key = kkey(key, 0)
                    keys.add(key)  # type: ignore[union-attr]
                nidx = len(parents)
                try:
                    parents.append(pidx)
                    via.append(ai)
                except OverflowError:
                    parents, via = self._widen(nidx, pidx, ai)
                if graph_ok:
                    graph_ok = self._new_edge(key, pidx, nidx, act)
                if (bad or pb is not None) and (stop := self._judge(nidx, bad, pb, events)) is not None:
                    if stop:
                        break
                    frontier.append(_SKIP)  # a violating or corrupting state is not expanded
                    continue
                if checks:
                    if check_state(nstate, nidx):
                        break
                    checks = bool(invariants or unmet)
                if stored_entry:
                    frontier.append(key)  # the stored key (fields already interned) is a frontier entry
                elif fast_flat and nmid == 0 and type(nstate) is scls:
                    frontier.append(nstate if ikey is None else ikey(nstate, 0))
                else:
                    frontier.append(flat_key(nstate, nmid, ikey))
                if nidx + 1 == limit:
                    self.truncated = True
                    self.stopped_by = "max_states"
                    break
            else:
                if not ticking or ((pidx + 1) & 255) or not self._tick(transitions):
                    continue
                self.truncated = True
                self.stopped_by = "max_seconds"
            self.stopped = True
            break
        self.transitions, self.graph_ok = transitions, graph_ok

    # -- the rare cases of the loop ------------------------------------------

    def _widen(self, nidx: int, pidx: int, ai: int) -> tuple[array, array]:
        """Store the links of state ``nidx`` in wider arrays (an index outgrew
        the item type)."""
        self.parents = _append_wide(self.parents, nidx, pidx, "q")
        self.via = _append_wide(self.via, nidx, ai, "l")
        return self.parents, self.via

    def _new_edge(self, key: Hashable, pidx: int, nidx: int, act: Any) -> bool:
        """Record a new state in the graph; False once the graph is too big."""
        self.index_of[key] = nidx  # type: ignore[index]
        self.edges.append((pidx, nidx, str(act)))
        return nidx < self.graph_limit

    def _quiet(self, pidx: int, mid: int, pb: Any) -> bool:
        """A state that enables nothing: the end of its history.  True when
        the search should stop."""
        if self.check_deadlock and self.template is not None:
            ends = self.mons.monitor(mid).end_violations()
            if ends and self._record("deadlock", ends[0].invariant, pidx, ends[0].message):
                return True
        if pb is not None:
            found = pb.finish()
            if found and self._record("violation", found[0].invariant, pidx, found[0].message):
                return True
        return False

    def _judge(self, nidx: int, bad: tuple[Violation, ...], pb: Any, events: Any) -> bool | None:
        """A new state ``nidx`` that the monitor rejects (``bad``) or that has
        a data backend ``pb`` to run the events on: True ends the search,
        False leaves the state unexpanded, None expands it (its backend
        queued)."""
        if bad:
            stop = self._record("violation", bad[0].invariant, nidx, bad[0].message)
            if pb is not None:
                _, found = _run_backend(pb, events, True)
                if found and self._record("violation", found[0].invariant, nidx, found[0].message):
                    stop = True
            return stop
        cb, found = _run_backend(pb, events, False)
        if found:
            return self._record("violation", found[0].invariant, nidx, found[0].message)
        self.bfront.append(cb)  # type: ignore[union-attr]
        return None

    def _record(self, kind: str, inv: str, idx: int, message: str) -> bool:
        """Remember a finding at state ``idx``; True when the search should stop."""
        if inv not in self.found_ids:
            self.found_ids.add(inv)
            self.pending.append((kind, inv, idx, message))
        return self.stop_on_first

    def _check_state(self, state: Any, idx: int) -> bool:
        if self.unmet:
            for name in _meet(self.unmet, state):
                self.met[name] = None
        if self.invariants:
            for name, pred in self.invariants.items():
                if not pred(state) and self._record(
                    "state-invariant", name, idx, f"state invariant {name!r} fails"
                ):
                    return True
        return False

    def _tick(self, transitions: int) -> bool:
        """Report progress when it is time; True once ``max_seconds`` is over."""
        now = time.perf_counter()
        if now >= self.deadline:
            return True
        if self.progress is not None and now >= self.next_report:
            self.next_report = now + self.progress_interval
            self.progress(
                {  # type: ignore[misc]
                    "states": len(self.parents),
                    "transitions": transitions,
                    "depth": self.depth,
                    "queue": len(self.frontier),
                    "seconds": now - self.t0,
                    "violations": len(self.pending),
                    "level": self.depth,
                    "frontier": len(self.frontier),
                    "memory": _rss(),
                    "levels": self.levels,
                }
            )
        return False

    # -- the result ----------------------------------------------------------

    def _result(self) -> ExploreResult:
        parents, model = self.parents, self.model
        n = len(parents)
        depth_reached = len(_path(parents, self.via, n - 1)[1]) if n else 0
        if self.progress is not None:
            self.progress(
                {
                    "states": n,
                    "transitions": self.transitions,
                    "depth": depth_reached,
                    "queue": len(self.frontier),
                    "seconds": self.seconds,
                    "violations": len(self.pending),
                    "done": True,
                }
            )
        self.peak_frontier = max(self.peak_frontier, len(self.frontier))
        self.frontier.clear()
        if self.bfront is not None:
            self.bfront.clear()
        found: dict[str, list[Counterexample]] = {"violation": [], "deadlock": [], "state-invariant": []}
        for kind, inv, idx, message in self.pending:
            found[kind].append(
                _counterexample(
                    model,
                    self.header,
                    self.template,
                    parents,
                    self.via,
                    idx,
                    kind,
                    inv,
                    message,
                    self.backend,
                )
            )
        memory: dict[str, int] = {"links": parents.itemsize * n + self.via.itemsize * len(self.via)}
        coll = self.visited.account(memory, n)
        bps = sum(memory.values()) / n if n else None
        memory["peak_frontier_entries"] = self.peak_frontier
        memory["monitor_states"] = len(self.mons.keys)
        memory["memo_entries"] = len(self.mons.memo)
        graph = None
        if self.keep_graph and self.graph_ok:
            graph = _build_graph(model.name if hasattr(model, "name") else "model", n, self.edges, parents)
        sometimes = self.sometimes
        return ExploreResult(
            model=getattr(model, "name", type(model).__name__),
            states=n,
            transitions=self.transitions,
            depth=depth_reached,
            seconds=self.seconds,
            violations=tuple(found["violation"]),
            deadlocks=tuple(found["deadlock"]),
            invariant_failures=tuple(found["state-invariant"]),
            unmet_sometimes=tuple(self.unmet),
            met_sometimes=tuple(s for s in sometimes if s in self.met),
            complete=not self.stopped,
            truncated=self.truncated,
            symmetry=self.sym_mode,
            fingerprint=self.fingerprint,
            bytes_per_state=bps,
            collision_probability=coll,
            monitor_states=len(self.mons.keys),
            graph=graph,
            header=self.header,
            memory=memory,
            stopped_by=(self.stopped_by or "counterexample") if self.stopped else None,
        )


def _meet(unmet: dict[str, Callable], state: Any) -> tuple[str, ...]:
    """The ``sometimes`` properties of ``unmet`` that ``state`` meets, taken
    out of it."""
    hits: tuple[str, ...] = ()
    for name, p in unmet.items():
        if p(state):
            hits += (name,)
    for name in hits:
        del unmet[name]
    return hits


def _rss() -> int:
    """Resident set size of this process in bytes (0 where unknown)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:  # pragma: no cover - not Linux
        return 0


def _run_backend(parent: Any, events: Any, finish: bool) -> tuple[Any, list]:
    """A copy of data backend ``parent`` with ``events`` applied (and the
    history finished, when ``finish`` and nothing showed): (backend, findings)."""
    b = parent.copy()
    found: list = []
    for ev in events:
        found.extend(b.apply(ev))
    if finish and not found:
        found.extend(b.finish())
    return b, found


def _append_wide(items: array, n: int, value: int, wider: str) -> array:
    """``items`` with ``value`` as its item ``n`` (unless it is there), in an
    array of type ``wider`` when it does not fit."""
    if len(items) == n:
        try:
            items.append(value)
        except OverflowError:
            items = array(wider, items)
            items.append(value)
    return items
