"""Every table keyed by event kind covers every event kind: the monitor's
handlers, the torch backend's handlers, the history reader's parsers.

A new event class registered in ``EVENT_TYPES`` but missing from one of them
would otherwise be rejected (the monitor), silently ignored (the backend) or
parsed on the slow path only (the reader)."""

from __future__ import annotations

import importlib
from typing import Mapping

import pytest

from pdproto.spec import _events, _monitor
from pdproto.spec import EVENT_TYPES, Event

KINDS = frozenset(EVENT_TYPES)
CLASSES = frozenset(EVENT_TYPES.values())


def _event_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _event_subclasses(sub)
    return out


#: mappings that name some event kinds on purpose: the format 1.1 features
#: (one of them, "share", is also the name of its event kind) and the kinds
#: that exist only with a feature declared
_NOT_PER_KIND = {"FEATURES", "FEATURE_KINDS", "_FEATURE_FIELDS_OF"}


def _per_kind_tables(module) -> dict[str, Mapping]:
    """The module-level mappings keyed by event classes or event kind names."""
    found = {}
    for name, value in vars(module).items():
        if name in _NOT_PER_KIND:
            continue
        if isinstance(value, Mapping) and value and any(k in CLASSES or k in KINDS for k in value):
            found[name] = value
    return found


def test_event_types_lists_every_event_class_once():
    assert CLASSES == {c for c in _event_subclasses(Event) if c.__module__ == _events.__name__}
    assert all(cls.EV == kind for kind, cls in EVENT_TYPES.items())


def test_monitor_dispatch_covers_every_event_kind():
    assert set(_monitor._DISPATCH) == CLASSES
    assert all(callable(handler) for handler in _monitor._DISPATCH.values())


def test_torch_backend_dispatch_covers_every_event_kind():
    pytest.importorskip("torch")
    _torch = importlib.import_module("pdproto.backends._torch")
    assert set(_torch._DISPATCH) == CLASSES
    assert all(callable(handler) for handler in _torch._DISPATCH.values())


def test_history_reader_has_a_parser_for_every_event_kind():
    assert set(_events._FAST) == KINDS
    assert all(callable(parse) for parse in _events._FAST.values())


@pytest.mark.parametrize("module", ["pdproto.spec._events", "pdproto.spec._history", "pdproto.spec._monitor",
                                    "pdproto.backends._torch"])
def test_every_per_kind_table_is_complete(module):
    """Whatever tables a module keys by event kind (found by their keys), each
    names every kind, as classes or as names."""
    if module.endswith("_torch"):
        pytest.importorskip("torch")
    tables = _per_kind_tables(importlib.import_module(module))
    if module.endswith(("_events", "_monitor", "_torch")):
        assert tables, f"{module} has no table keyed by event kind"
    for name, table in tables.items():
        keys = set(table)
        assert keys in (set(CLASSES), set(KINDS)), f"{module}.{name} misses {sorted(map(str, (CLASSES | KINDS) - keys))}"



def test_torch_backend_rejects_a_foreign_object_and_changes_nothing():
    pytest.importorskip("torch")
    from pdproto import HistoryHeader, Submit, TorchBackend, UsageError

    backend = TorchBackend(HistoryHeader())
    backend.apply(Submit("r1", 0, prompt_len=4))
    before = (backend.line, backend.events, list(backend.violations))
    for foreign in ({"ev": "submit", "request": "r2", "gen": 0}, "submit", None):
        with pytest.raises(UsageError) as info:
            backend.apply(foreign)  # type: ignore[arg-type]
        assert info.value.value == foreign
        assert (backend.line, backend.events, list(backend.violations)) == before
