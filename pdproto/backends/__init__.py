"""Backends execute a history on real memory and verify the data decode reads.

The torch backend needs the ``torch`` extra (``pip install 'pdproto[torch]'``),
the model backend (a real transformer beside it) the ``model`` extra; their
names are loaded on first use, so importing this package imports neither
torch nor transformers.  The transports of the torch backend (``copy``,
``nixl``, ``mooncake``: :func:`make_transport`) are in ``._transport``,
``._nixl`` and ``._mooncake`` (the ``nixl`` and ``mooncake`` extras).
"""

from __future__ import annotations

from .._errors import TransportError as TransportError
from ._transports_table import TRANSPORTS as TRANSPORTS

__all__ = [
    "KV_CORRUPTION",
    "KVCorruption",
    "TorchBackend",
    "LOGIT_DIVERGENCE",
    "LogitDivergence",
    "ModelBackend",
    "BUILTIN_MODELS",
    "TRANSPORTS",
    "Transport",
    "TransportError",
    "TransportStatistics",
    "make_transport",
]

_LAZY = {
    name: "._torch"
    for name in (
        "KV_CORRUPTION",
        "KVCorruption",
        "TorchBackend",
        "KVLayout",
        "rank_heads",
        "parse_tp",
        "TORCH_DTYPES",
        "DEFAULT_MAX_MEMORY",
    )
}
_LAZY.update({name: "._transformer" for name in ("LOGIT_DIVERGENCE", "LogitDivergence", "ModelBackend")})
_LAZY.update({name: "._builtin_models" for name in ("BUILTIN_MODELS", "LoadedModel")})
_LAZY.update({name: "._transport" for name in ("Transport", "TransportStatistics", "make_transport")})


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdproto.backends' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
