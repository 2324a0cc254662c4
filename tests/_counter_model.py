"""A model that is no handoff: two counters that each count up to LIMIT.

It has no header and its actions no actor, and it emits no events: it is
checked against its own ``invariants`` and ``sometimes`` alone
(``pdproto check --no-monitor``).  ``model`` holds its invariant (the sum
never passes 2 * LIMIT); ``broken`` claims the sum stays below 2 * LIMIT,
which the shortest run of 2 * LIMIT steps breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

LIMIT = 3


@dataclass(frozen=True)
class Inc:
    """Count counter ``which`` up by one."""

    which: int
    kind = "inc"
    fault = False

    def __str__(self) -> str:
        return f"inc({self.which})"


class Counter:
    name = "counter"

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.invariants = {"within-bound": lambda s: s[0] + s[1] <= self.bound}
        self.sometimes = {"both-at-limit": lambda s: s == (LIMIT, LIMIT)}

    def initial_states(self) -> list[tuple[int, int]]:
        return [(0, 0)]

    def actions(self, state: tuple[int, int]) -> list[Inc]:
        return [Inc(i) for i in (0, 1) if state[i] < LIMIT]

    def step(self, state: tuple[int, int], action: Inc) -> tuple[tuple[int, int], tuple]:
        nxt = list(state)
        nxt[action.which] += 1
        return (nxt[0], nxt[1]), ()


model = Counter(2 * LIMIT)
broken = Counter(2 * LIMIT - 1)
