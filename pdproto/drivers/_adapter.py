"""What a system under test offers pdproto's drivers: the adapter interface.

A model is pure: the drivers fork its states at will.  A real engine is not:
it has one live state, which only moves forward, and which the drivers can
only bring back by resetting it.  An :class:`Adapter` is that engine seen
through pdproto's vocabulary:

- ``header``: the history header of what it produces (policy, workers, the
  first-token ``boundary`` convention);
- ``reset()``: back to the initial configuration, cheaply (build the engine
  once per process, then reset it);
- ``actions()``: the actions the real state allows now, in a deterministic
  order, each a :class:`~pdproto.protocol.Action` whose ``fault`` flag marks
  fault injections;
- ``apply(action)``: do it to the real system and return the history events
  the real system produced, observed from real state (a block really taken
  from or returned to the real block pool, a real request status change, a
  real connector metadata entry), never invented.  An action not offered by
  ``actions()`` raises :class:`~pdproto.protocol.ActionNotEnabled` and
  changes nothing;
- ``close()``: release what the engine holds.

Optional (looked up with ``getattr``):

- ``signature() -> Hashable``: a summary of the real state, for counting the
  distinct states a run reached;
- ``decision(event) -> Action | None``: the action that makes the engine do
  what ``event`` records (for ``pdproto replay --adapter``), None when the
  event is only a consequence of an earlier decision;
- ``known``: invariant id -> a one-line triage of a real behaviour of the
  engine that breaks it (docs/adapters/<engine>.md says more).

docs/adapters.md states the rules an adapter keeps.  :func:`load_adapter`
finds an adapter by name: a built-in one (``vllm``, ``vllm:pull``,
``vllm:push``), ``model:NAME`` (a model of the catalogue driven as if it were
an engine: the drivers' own test bed), or ``module:attribute`` of your own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .._errors import UsageError
from ..protocol import Action, ActionNotEnabled
from ..spec import Event, HistoryHeader

__all__ = ["Adapter", "ModelAdapter", "load_adapter", "ADAPTERS"]


@runtime_checkable
class Adapter(Protocol):
    """A real system under test, driven one pdproto action at a time (see the
    module docstring for the contract)."""

    name: str
    header: HistoryHeader

    def reset(self) -> None: ...

    def actions(self) -> Sequence[Action]: ...

    def apply(self, action: Action) -> tuple[Event, ...]: ...

    def close(self) -> None: ...


class ModelAdapter:
    """A pdproto model driven through the adapter interface: one live state,
    moved by ``apply``, brought back by ``reset``.  It is what the adapter
    drivers are tested on, and the yardstick a real engine's adapter is
    compared with (the same actions, the same verdicts)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.name = f"model:{model.name}"
        self.header: HistoryHeader = model.header
        self._initial = next(iter(model.initial_states()))
        self.state = self._initial
        self.known: Mapping[str, str] = {}

    def reset(self) -> None:
        self.state = self._initial

    def actions(self) -> Sequence[Action]:
        return tuple(self.model.actions(self.state))

    def apply(self, action: Action) -> tuple[Event, ...]:
        enabled = self.actions()
        if action not in enabled:
            raise ActionNotEnabled(action, enabled)
        self.state, events = self.model.step(self.state, action)
        return tuple(events)

    def signature(self) -> Hashable:
        return self.state

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"ModelAdapter({self.model.name!r})"


#: built-in adapters: name -> ("module:factory", keyword arguments); the
#: factory is called with those keywords (and the caller's) and returns an
#: :class:`Adapter`
ADAPTERS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "vllm": ("pdproto.adapters.vllm:VllmAdapter", {"family": "pull"}),
    "vllm:pull": ("pdproto.adapters.vllm:VllmAdapter", {"family": "pull"}),
    "vllm:push": ("pdproto.adapters.vllm:VllmAdapter", {"family": "push"}),
}


def load_adapter(name: str, **options: Any) -> Adapter:
    """The adapter called ``name``: one of :data:`ADAPTERS`, ``model:NAME``
    (a model of the catalogue, see :class:`ModelAdapter`), or
    ``module:attribute`` naming a factory (a class or function) of your own.
    A name that is none of these is one :class:`~pdproto.UsageError`."""
    if name.startswith("model:"):
        from ._loader import load_model  # the catalogue, only when asked for

        model, _info = load_model(name[len("model:") :], **options)
        return ModelAdapter(model)
    spec, defaults = ADAPTERS.get(name, (name, {}))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError("--adapter", name, f"one of {', '.join(ADAPTERS)}, model:NAME, or module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if name not in ADAPTERS and exc.name and module_name.startswith(exc.name):
            raise UsageError(
                "--adapter", name, f"an importable module (no module named {module_name!r})"
            ) from None
        raise
    factory: Callable[..., Adapter] | None = getattr(module, attr, None)
    if factory is None:
        raise UsageError("--adapter", name, f"an attribute of module {module_name!r} (it has no {attr!r})")
    adapter = factory(**{**defaults, **options})
    missing = [m for m in ("name", "header", "reset", "actions", "apply", "close") if not hasattr(adapter, m)]
    if missing:
        raise UsageError("--adapter", name, f"an adapter (docs/adapters.md); it lacks {', '.join(missing)}")
    return adapter
