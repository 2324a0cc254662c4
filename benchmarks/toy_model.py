"""A model whose step is nearly free, to measure the explorer's own overhead.

``K`` counters, each 0..N: ``inc(i)`` adds one to counter ``i`` below ``N``;
``wrap(i)`` sets a full counter back to 0.  There are ``(N + 1) ** K``
distinct states, every one reachable, and no events: the monitor key stays
that of the empty history.  The counters are interchangeable, so
``symmetry`` (sorting them) leaves ``C(N + K, K)`` states.

    pdproto check benchmarks/toy_model.py
"""

from __future__ import annotations

from pdproto.spec import HistoryHeader
from pdproto.protocol import Action

EXPECTED = None


class Counters:
    def __init__(self, counters: int = 4, top: int = 24) -> None:
        self.name = f"toy-counters-{counters}x{top}"
        self.header = HistoryHeader(policy="push", complete=True)
        self.k = counters
        self.top = top
        self._inc = [Action("inc", f"c{i}", (i,)) for i in range(counters)]
        self._wrap = [Action("wrap", f"c{i}", (i,)) for i in range(counters)]
        self.invariants = {}
        self.sometimes = {"all full": lambda s: min(s) == top}

    def initial_states(self):
        return [(0,) * self.k]

    def actions(self, state):
        top = self.top
        inc, wrap = self._inc, self._wrap
        return [inc[i] if c < top else wrap[i] for i, c in enumerate(state)]

    def step(self, state, action):
        i = action.args[0]
        s = list(state)
        s[i] = s[i] + 1 if action.kind == "inc" else 0
        return tuple(s), ()

    def symmetry(self, state):
        return tuple(sorted(state)), None

    def states(self) -> int:
        return (self.top + 1) ** self.k


DEFAULT_CONFIG = (4, 24)


def build(config=DEFAULT_CONFIG) -> Counters:
    return Counters(*config)


model = build()
