"""The names of the transports the torch backend moves KV with (torch-free:
the CLI's ``--transport`` choices come from here)."""

from __future__ import annotations

__all__ = ["TRANSPORTS"]

#: the transports ``--transport`` accepts (``make_transport``)
TRANSPORTS = ("copy", "nixl", "mooncake")
