"""The visited set of a search and the stored forms of its states.

A stored key is *flat* when the model's states are tuples or named tuples:
the state itself with monitor id 0, else the state's fields followed by the
monitor state's id and ``_PAIR``, one tuple (a model state never holds
``_PAIR``, so the two forms never meet).  Other states are stored as
``(_PAIR, state, mid)``, or bare with monitor id 0.  In exact mode the keys are kept, their parts hash-consed
(:class:`_Interner`); in fingerprint mode only 64-bit hashes (:class:`_FPSet`).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Hashable
from typing import Any

_BAD = object()  # marks a violating transition's target in the visited set
_PAIR = object()  # tags (state, monitor id) keys; a model state can never hold it


def _collision_probability(n: int) -> float:
    """Probability that some pair among ``n`` uniformly random 64-bit
    fingerprints collides (so that a state was wrongly taken as seen)."""
    return -math.expm1(-n * (n - 1) / 2.0 / 2.0**64)


class _FPSet:
    """An open-addressing set of nonzero 64-bit fingerprints in one
    ``array('q')``: 8 bytes a slot, at most 3/4 full."""

    __slots__ = ("table", "mask", "n", "limit")

    def __init__(self, capacity: int = 1 << 16) -> None:
        size = 1 << max(4, (capacity * 4 // 3).bit_length())
        self.table = array("q", bytes(8 * size))
        self.mask = size - 1
        self.n = 0
        self.limit = size * 3 // 4

    def add(self, fp: int) -> bool:
        """Add ``fp``; return True when it was new."""
        table = self.table
        mask = self.mask
        i = fp & mask
        while True:
            v = table[i]
            if v == 0:
                table[i] = fp
                self.n += 1
                if self.n > self.limit:
                    self.grow()
                return True
            if v == fp:
                return False
            i = (i + 1) & mask

    def grow(self) -> tuple[array, int]:
        """Double the table; return the new table and mask."""
        old = self.table
        size = len(old) * 2
        table = array("q", bytes(8 * size))
        mask = size - 1
        for v in old:
            if v:
                i = v & mask
                while table[i]:
                    i = (i + 1) & mask
                table[i] = v
        self.table = table
        self.mask = mask
        self.limit = size * 3 // 4
        return table, mask

    def nbytes(self) -> int:
        return len(self.table) * 8


def _fingerprint(key: Hashable) -> int:
    fp = hash(key)  # 64-bit on 64-bit builds; never 0 below
    return fp if fp else 1


_MISS = object()


def _flat_type(cls: type) -> bool:
    """Whether states of type ``cls`` can be stored flat (their fields followed
    by the monitor id) and rebuilt: plain tuples and named tuples without an
    instance ``__dict__``."""
    if cls is tuple:
        return True
    return (
        issubclass(cls, tuple)
        and hasattr(cls, "_fields")
        and all("__slots__" in c.__dict__ for c in cls.__mro__[:-2])
    )


class _Interner:
    """Hash-consing of the fields of flat states, two levels deep.

    Neighbouring states share most of their parts (a request's sub-tuple, the
    budget, the list of messages), but a model's step builds fresh objects
    for them.  ``key(flat)`` returns an equal tuple whose fields are the first
    equal object of the same type seen at that position; a field that is
    itself a tuple has its tuple elements interned the same way (one table
    per element type).  A part is only ever replaced by an equal part of the
    same type, so a stored state is equal to the one the model produced (the
    visited set already identifies equal states).  A position whose values
    rarely repeat (a table past 64k entries holding more than half of its
    lookups) stops being interned: its table would cost more than it saves.
    """

    __slots__ = ("tables", "calls", "subs", "saved", "active")

    #: lookups before the interner drops the positions where interning never
    #: gave another object (small ints, interned strings: already shared)
    PROBE = 4096

    def __init__(self) -> None:
        self.tables: list[dict | None] = []
        self.calls = 0
        self.subs: dict[type, dict] = {}
        self.saved: list[bool] = []  # position -> interning ever replaced an object (probe phase)
        self.active: list[int] | None = None  # the positions still interned, once probed

    def key(self, flat: tuple, tail: int = 2) -> tuple:
        """``flat`` with its fields interned: the last ``tail`` items (the
        monitor id and tag of a flat key) are left alone.  A bare state
        (``tail`` 0) keeps its type."""
        active = self.active
        if active is not None and not active:
            return flat  # nothing this model builds is worth sharing
        tables = self.tables
        n = len(flat) - tail
        if len(tables) < n:
            tables.extend({} for _ in range(n - len(tables)))
            self.saved.extend(False for _ in range(n - len(self.saved)))
            self.active = active = None
        self.calls += 1
        out = list(flat)
        saved = self.saved if active is None else None
        for i in range(n) if active is None else active:
            d = tables[i]
            if d is None:
                continue
            v = out[i]
            r = d.get(v, _MISS)
            if r is not _MISS:
                if type(r) is type(v):
                    if saved is not None and r is not v:
                        saved[i] = True
                    out[i] = r
                continue
            if isinstance(v, tuple) and v:
                v = self._sub(v)
                out[i] = v
                if saved is not None:
                    saved[i] = True
            d[v] = v
            if len(d) > 65536 and 2 * len(d) > self.calls:
                tables[i] = None
        if saved is not None and self.calls >= self.PROBE:
            self.active = [i for i in range(len(tables)) if saved[i] and tables[i] is not None]
            for i in range(len(tables)):
                if not saved[i]:
                    tables[i] = None
        if tail == 0 and type(flat) is not tuple:
            return tuple.__new__(type(flat), out)
        return tuple(out)

    def _sub(self, v: tuple) -> tuple:
        cls = type(v)
        if not _flat_type(cls):
            return v
        subs = self.subs
        changed = False
        elems = list(v)
        for j, x in enumerate(elems):
            if isinstance(x, tuple):
                tx = type(x)
                st = subs.get(tx)
                if st is None:
                    st = subs[tx] = {}
                r = st.setdefault(x, x)
                if r is not x:
                    elems[j] = r
                    changed = True
        if not changed:
            return v
        return tuple(elems) if cls is tuple else tuple.__new__(cls, elems)

    def nbytes(self) -> int:
        total = 0
        for d in self.tables:
            if d:
                total += sys.getsizeof(d) + sum(map(sys.getsizeof, d))
        for d in self.subs.values():
            total += sys.getsizeof(d) + sum(map(sys.getsizeof, d))
        return total


def _deep_size(obj: Any, seen: set[int]) -> int:
    """Bytes of ``obj`` and the tuples / frozensets inside it not counted yet."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (tuple, frozenset)):
        for x in obj:
            size += _deep_size(x, seen)
    return size


def _key_bytes(visited: set, interner: _Interner | None) -> int:
    """Bytes of the stored keys: each key tuple, plus (deep, each object once)
    the parts that no intern table accounts for."""
    total = sum(map(sys.getsizeof, visited))
    active = set()
    if interner is not None:
        active = {i for i, d in enumerate(interner.tables) if d is not None}
    seen: set[int] = set()
    flat: dict[type, bool] = {}
    for k in visited:
        if type(k) is tuple and k and k[-1] is _PAIR:
            for i in range(len(k) - 2):
                if i not in active:
                    total += _deep_size(k[i], seen)
        elif (
            isinstance(k, tuple)
            and k
            and k[0] is not _BAD
            and k[0] is not _PAIR
            and (flat.get(type(k)) if type(k) in flat else flat.setdefault(type(k), _flat_type(type(k))))
        ):
            for i in range(len(k)):  # a bare flat state (monitor id 0)
                if i not in active:
                    total += _deep_size(k[i], seen)
        elif type(k) is tuple:
            for x in k:
                total += _deep_size(x, seen)
    return total


def _unpack(entry: Any, cls: type) -> tuple[Any, int]:
    """(state, monitor id) of a frontier entry: a bare state (monitor id 0),
    flat ``fields + (mid, _PAIR)``, or ``(_PAIR, state, mid)``."""
    if type(entry) is not tuple or not entry:
        return entry, 0  # a bare state (a named tuple, another type)
    if entry[-1] is _PAIR:
        return (entry[:-2] if cls is tuple else tuple.__new__(cls, entry[:-2])), entry[-2]
    if len(entry) == 3 and entry[0] is _PAIR:
        return entry[1], entry[2]
    return entry, 0


class _Visited:
    """The visited set: exact (keys with interned parts) or fingerprints.

    The search's hot loop probes ``keys`` or ``fpset.table`` itself; this
    class sets them up, adds the initial states and accounts for memory."""

    __slots__ = ("fpset", "keys", "interner", "kinterner")

    def __init__(self, fingerprint: bool, intern: bool, symmetric: bool) -> None:
        self.fpset = _FPSet() if fingerprint else None
        self.keys: set | None = None if fingerprint else set()
        self.interner = _Interner() if intern else None  # frontier entries (concrete states)
        # canonical keys get their own tables: a symmetry hook may build parts of
        # other types that compare equal to the model's (a tuple and a named tuple)
        self.kinterner = _Interner() if intern and symmetric else self.interner

    def add(self, key: Hashable) -> Hashable | None:
        """Add ``key``; return the key as stored, or None when it was seen."""
        if self.fpset is not None:
            return key if self.fpset.add(_fingerprint(key)) else None
        assert self.keys is not None
        if key in self.keys:
            return None
        if self.kinterner is not None and type(key) is tuple and key and key[-1] is _PAIR:
            key = self.kinterner.key(key)
        self.keys.add(key)
        return key

    def account(self, memory: dict[str, int], n: int) -> float | None:
        """Add the bytes of the stored structures to ``memory``; return the
        probability of a fingerprint collision (None in exact mode)."""
        coll: float | None = None
        if self.fpset is not None:
            memory["fingerprints"] = self.fpset.nbytes()
            coll = _collision_probability(n)
        else:
            assert self.keys is not None
            memory["visited_set"] = sys.getsizeof(self.keys)
            memory["keys"] = _key_bytes(self.keys, self.kinterner)
        interner, kinterner = self.interner, self.kinterner
        memory["interned_parts"] = interner.nbytes() if interner is not None else 0
        if kinterner is not None and kinterner is not interner:
            memory["interned_parts"] += kinterner.nbytes()
        return coll
