"""The one place where pdproto reaches past Hypothesis's public API.

Why: the fuzzer's action choice must *mean* an index (so that a shrunk or
replayed example means the same action whatever the steering weights are),
while fresh examples should pick indexes by those weights.  Hypothesis's
public strategies offer no weighted integer draw; its engine does
(``ConjectureData.draw_integer(..., weights=...)``).  This module uses it
when the installed Hypothesis is one we tested (6.x) and it answers as
expected, and falls back to the public uniform draw (``st.integers``)
otherwise: fuzzing then finds bugs a little more slowly, but still works.

The example database is kept apart per model and configuration with the
public :class:`hypothesis.database.ExampleDatabase` interface
(:func:`namespaced_database`): no private test attribute is set.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import hypothesis
from hypothesis import strategies as st
from hypothesis.database import ExampleDatabase

#: the Hypothesis major versions whose engine has the weighted integer draw
#: used below (checked against 6.170)
TESTED_MAJOR = 6
#: the share of a weighted draw given to the weights; the rest is uniform over
#: every index (so every index stays reachable)
WEIGHTED_SHARE = 0.96
#: the engine's weighted draw accepts at most this many weighted values
MAX_WEIGHTED = 255

_weighted_ok = [getattr(hypothesis, "__version_info__", (0,))[0] == TESTED_MAJOR]


def weighted_draw_available() -> bool:
    """Whether :func:`weighted_index` uses the engine's weighted draw (False
    on an untested Hypothesis, or after the engine refused it once)."""
    return _weighted_ok[0]


def weighted_index(data: Any, weights: Sequence[float], label: str) -> int:
    """Draw an index into ``len(weights)`` candidates from ``st.data()``.

    The drawn value is the index alone; the weights only shape how often
    fresh examples pick each one.  A uniform public draw where the engine's
    weighted draw is not available."""
    n = len(weights)
    if n == 1:
        return 0
    total = sum(weights)
    if total > 0 and n <= MAX_WEIGHTED and _weighted_ok[0]:
        scale = WEIGHTED_SHARE / total
        w = {i: x * scale for i, x in enumerate(weights) if x > 0}
        try:
            return data.conjecture_data.draw_integer(0, n - 1, weights=w)
        except (AttributeError, TypeError):  # the engine changed: no weighted draw
            _weighted_ok[0] = False
    return data.draw(st.integers(0, n - 1), label=label)


class _Namespaced(ExampleDatabase):
    """``inner`` with every key prefixed by ``prefix``."""

    def __init__(self, inner: ExampleDatabase, prefix: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"_Namespaced({self.inner!r}, {self.prefix!r})"

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def namespaced_database(inner: ExampleDatabase | None, identity: str) -> ExampleDatabase | None:
    """``inner`` seen through keys prefixed by a digest of ``identity``.

    Hypothesis keys a state machine's examples by the machine class's
    source, which is the same for every model; this keeps the failures of
    each model and configuration apart (None stays None)."""
    if inner is None:
        return None
    return _Namespaced(inner, hashlib.sha256(identity.encode()).digest())


__all__ = ["weighted_index", "weighted_draw_available", "namespaced_database"]
