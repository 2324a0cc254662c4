"""The one place where pdproto reaches past Hypothesis's public API.

Why: in the state machine of :func:`pdproto.testing.handoff_machine` each
step makes a choice that Hypothesis must record (so that it can replay and
shrink the example).  Through the public API (``data.draw(strategy)``) a
draw costs several times what the engine's own draws cost
(``ConjectureData.draw_boolean`` / ``draw_integer``, the ones Hypothesis's
stateful testing uses), and the public strategies offer no biased boolean.
:class:`Draws` uses the engine's draws when the installed Hypothesis is one
we tested (6.x) and they answer as expected, and falls back to public draws
(``st.integers``) otherwise: fuzzing then still works.
:func:`phase_statistics` reads the time Hypothesis spent in each phase
through its statistics hook (nothing where the hook is missing).

The example database is kept apart per model and configuration with the
public :class:`hypothesis.database.ExampleDatabase` interface
(:func:`namespaced_database`): no private test attribute is set.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import hypothesis
from hypothesis import strategies as st
from hypothesis.database import ExampleDatabase

#: the Hypothesis major versions whose engine draws are used below (checked
#: against 6.155)
TESTED_MAJOR = 6

_engine_ok = [getattr(hypothesis, "__version_info__", (0,))[0] == TESTED_MAJOR]


def engine_draws_available() -> bool:
    """Whether :class:`Draws` uses the engine's draws (False on an untested
    Hypothesis, or after the engine refused them once)."""
    return _engine_ok[0]


class Draws:
    """The choices of one example, drawn from ``st.data()``.

    Every method is one recorded choice (or two), so that Hypothesis can
    replay and shrink the example; each shrinks toward the choice that
    changes least (let the walk choose)."""

    __slots__ = ("data", "cd")

    def __init__(self, data: Any) -> None:
        self.data = data
        self.cd = getattr(data, "conjecture_data", None) if _engine_ok[0] else None

    def _refused(self) -> None:
        _engine_ok[0] = False
        self.cd = None

    def integer(self, lo: int, hi: int, label: str) -> int:
        """An integer in ``lo..hi`` (shrinks toward ``lo``)."""
        if self.cd is not None:
            try:
                return self.cd.draw_integer(lo, hi)
            except (AttributeError, TypeError):
                self._refused()
        return self.data.draw(st.integers(lo, hi), label=label)

    def boolean(self, p_true: float, label: str) -> bool:
        """True with probability about ``p_true`` when fresh (shrinks toward
        False)."""
        if self.cd is not None:
            try:
                return bool(self.cd.draw_boolean(p_true))
            except (AttributeError, TypeError):
                self._refused()
        return self.data.draw(st.integers(0, 999), label=label) < round(p_true * 1000)

    def override(self, n: int, one_in: int) -> int:
        """0 (about ``one_in - 1`` times in ``one_in`` when fresh: let the
        walk choose), or ``1..n``: the caller's option ``i - 1``.  Shrinks
        toward 0."""
        if self.cd is not None:
            try:
                if not self.cd.draw_boolean(1.0 / one_in):
                    return 0
                return 1 + self.cd.draw_integer(0, n - 1)
            except (AttributeError, TypeError):
                self._refused()
        if self.data.draw(st.integers(0, one_in - 1), label="override") < one_in - 1:
            return 0
        return 1 + self.data.draw(st.integers(0, n - 1), label="action")


@contextlib.contextmanager
def phase_statistics() -> Iterator[dict[str, float]]:
    """Collect the wall seconds Hypothesis spends in each phase (``reuse``,
    ``generate``, ``shrink``, ``explain``) of the test run inside the block;
    the dict stays empty where Hypothesis has no statistics hook."""
    seconds: dict[str, float] = {}

    def note(stats: Mapping[str, Any]) -> None:
        for key, value in stats.items():
            if key.endswith("-phase") and isinstance(value, Mapping):
                phase = key[: -len("-phase")]
                seconds[phase] = seconds.get(phase, 0.0) + float(value.get("duration-seconds", 0.0))

    try:
        from hypothesis.statistics import collector
    except ImportError:
        yield seconds
        return
    with collector.with_value(note):
        yield seconds


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


__all__ = ["Draws", "engine_draws_available", "phase_statistics", "namespaced_database"]
