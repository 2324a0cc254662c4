"""Backends execute a history on real memory and verify the data decode reads.

The torch backend needs the ``torch`` extra (``pip install 'pdproto[torch]'``),
the model backend (a real transformer beside it) the ``model`` extra; their
names are loaded on first use, so importing this package imports neither
torch nor transformers.  The transports of the torch backend (``copy``,
``nixl``, ``mooncake``: :func:`make_transport`) come from the registry in
``._registry``; their classes are in ``._transport``, ``._nixl`` and
``._mooncake`` (the ``nixl`` and ``mooncake`` extras).
"""

from __future__ import annotations

from .._errors import MissingExtraError
from .._errors import TransportError as TransportError
from ._registry import TRANSPORTS as TRANSPORTS
from ._registry import make_transport as make_transport

__all__ = [
    "require_torch",
    "load_transformer",
    "torch_threads",
    "NixlTransport",
    "prompt_tokens",
    "BlockMove",
    "CopyTransport",
    "Transfer",
    "block_views",
    "byte_runs",
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
_LAZY.update({name: "._transport" for name in ("Transport", "TransportStatistics")})

_LAZY["load_transformer"] = "._builtin_models"
_LAZY["torch_threads"] = "._torch"
_LAZY["NixlTransport"] = "._nixl"
_LAZY["prompt_tokens"] = "._transformer"
_LAZY["BlockMove"] = "._transport"
_LAZY["CopyTransport"] = "._transport"
_LAZY["Transfer"] = "._transport"
_LAZY["block_views"] = "._transport"
_LAZY["byte_runs"] = "._transport"


def require_torch() -> None:
    """Import torch and the torch backend; a :class:`~pdproto.MissingExtraError`
    naming ``pip install 'pdproto[torch]'`` when PyTorch is not installed
    (checked on every call: a test may hide torch after a first load)."""
    import importlib

    try:
        importlib.import_module("torch")
        importlib.import_module("._torch", __name__)
    except ImportError as exc:
        # ModuleNotFoundError names the module; torch blocked in sys.modules
        # (set to None) raises a plain ImportError that names it in the text
        missing = getattr(exc, "name", None) or ""
        if missing == "torch" or missing.startswith("torch.") or "'torch'" in str(exc):
            raise MissingExtraError("the torch backend", "PyTorch", "torch") from None
        raise


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdproto.backends' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
