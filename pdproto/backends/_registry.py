"""The transports' registry: each name ``--transport`` accepts, and where its
class lives (docs/replay.md, "Transports").  It imports no transport until
one is asked for, so it is torch-free: the CLI's ``--transport`` choices come
from here.  A transport's module imports its base from ``._transport`` and
nothing here, so the registry is the only module that names them all (as the
importers' registry does).

A new transport: a :class:`~pdproto.backends.Transport` subclass in its own
module of this package, and one line in :data:`_CLASSES` (docs/development.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._errors import UsageError

if TYPE_CHECKING:
    from ._transport import Transport

__all__ = ["TRANSPORTS", "make_transport"]

#: each transport's name, and its class as (module of this package, class name)
_CLASSES: dict[str, tuple[str, str]] = {
    "copy": ("._transport", "CopyTransport"),
    "nixl": ("._nixl", "NixlTransport"),
    "mooncake": ("._mooncake", "MooncakeTransport"),
}

#: the transports ``--transport`` accepts (:func:`make_transport`)
TRANSPORTS = tuple(_CLASSES)


def make_transport(name: str | Transport | None, **options: Any) -> Transport:
    """The transport called ``name`` (``copy``, ``nixl``, ``mooncake``), or
    ``name`` itself when it is one already.  A missing library is a
    :class:`~pdproto.MissingExtraError` naming its extra.  ``copy`` takes no
    options (any given are ignored)."""
    transport = importlib.import_module("._transport", __package__)
    if name is None or name == "copy":
        return transport.CopyTransport()
    if isinstance(name, transport.Transport):
        return name
    entry = _CLASSES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise UsageError("--transport", name, "one of " + ", ".join(TRANSPORTS))
    module, cls = entry
    made: Transport = getattr(importlib.import_module(module, __package__), cls)(**options)
    return made
