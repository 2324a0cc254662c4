"""The model interface every explorer and fuzzer drives.

A model is a pure, sans-IO state machine (the shape stateright and TLA+
use): initial states, the enabled actions of a state in a fixed order, and a
step function returning the next state plus the history events (format v1)
the step emitted.  Faults are actions too.  States and actions are frozen
and hashable; their reprs are valid Python.

Drivers judge a model only through the events it emits, with the
:class:`~pdproto.Monitor`; a model never checks an invariant itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from ..spec import Event, HistoryHeader

__all__ = ["Action", "Model", "ActionNotEnabled", "Renaming"]

from .._errors import PdprotoError


@attrs.frozen
class Action:
    """One enabled move of a model.

    ``kind`` names what happens (``"reserve"``, ``"deliver"``, ``"restart"``),
    ``actor`` who does it (``"router"``, ``"P0"``, ``"D0"``, ``"net"``,
    ``"client"``), ``args`` the hashable details, and ``fault`` marks fault
    injections (cancel, duplicate, loss, restart, timeout, transfer failure,
    retry) so drivers can weight and report them.
    """

    kind: str
    actor: str
    args: tuple = ()
    fault: bool = False

    def __str__(self) -> str:
        inner = ", ".join(repr(a) for a in self.args)
        return f"{self.kind}({inner})"


class ActionNotEnabled(PdprotoError, ValueError):
    """``step`` was given an action that ``actions(state)`` does not offer.
    Nothing changes; ``action`` and ``enabled`` say what was asked and what
    was allowed."""

    def __init__(self, action: object, enabled: Sequence[object]) -> None:
        self.action = action
        self.enabled = tuple(enabled)
        shown = ", ".join(map(str, self.enabled[:8])) + (" ..." if len(self.enabled) > 8 else "")
        super().__init__(f"action {action!s} is not enabled here; enabled: {shown or '(none)'}")


@runtime_checkable
class Model(Protocol):
    """What a model offers.  Required: ``name``, ``header``,
    ``initial_states``, ``actions`` and ``step``.  Optional (looked up with
    ``getattr``): ``canonical(state) -> Hashable`` for symmetry reduction,
    ``invariants`` (name -> predicate on a state, must always hold),
    ``sometimes`` (name -> predicate on a state, must hold somewhere).
    """

    name: str
    #: the history header of this model's traces: policy and declared workers
    header: HistoryHeader

    def initial_states(self) -> Iterable[Hashable]: ...

    def actions(self, state: Any) -> Sequence[Action]: ...

    def step(self, state: Any, action: Action) -> tuple[Any, tuple[Event, ...]]: ...


StatePredicate = Callable[[Any], bool]
Predicates = Mapping[str, StatePredicate]


@attrs.frozen
class Renaming:
    """A renaming of a model's ids.  ``names`` maps strings (request ids,
    worker names, ticket ids, transfer ids); ``blocks`` maps ``(worker,
    block)`` (original names) to the new block id on the renamed worker.
    Ids not mentioned keep their name."""

    names: Mapping[str, str] = attrs.field(factory=dict)
    blocks: Mapping[tuple[str, int], int] = attrs.field(factory=dict)

    def key(self) -> tuple:
        return (tuple(sorted(self.names.items())), tuple(sorted(self.blocks.items())))
