"""Finding the model ``pdproto check MODEL`` names.

MODEL is a name from the catalogue (``pdproto.models``, the repository's
``models/`` directory), a path to a model file (``.py``), or
``module:attribute``.  A model file (or module) follows the catalogue
contract: ``build(config) -> Model`` and ``DEFAULT_CONFIG``, with
``EXPECTED`` naming the invariant a mutant is meant to break (``None`` for a
correct model).  A module without ``build`` may instead define a ``model``
attribute holding a Model instance.

A model whose ``DEFAULT_CONFIG`` is not a handoff :class:`ModelConfig` (a
counter, say) takes its sizes from its own configuration: an override that
names no field of it is refused, saying which flags do not apply.  A model
that fails while it is imported or built is reported as one
:class:`ModelLoadError` naming its file, line and exception.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import attrs

from .._errors import ModelLoadError, UsageError

__all__ = [
    "load_model",
    "list_models",
    "ModelInfo",
    "MAX_REQUESTS",
    "MAX_BLOCKS",
    "MAX_WORKERS",
    "MAX_CHUNKS",
    "MAX_BLOCK_SIZE",
    "MAX_PROMPT_LEN",
]

#: Sizes the loader accepts for a handoff configuration.  Far larger than any
#: exhaustive search can finish (see :func:`reach_warning`), but small enough
#: that building the model itself stays instant.
MAX_REQUESTS = 64
MAX_BLOCKS = 1024
MAX_WORKERS = 6
MAX_CHUNKS = 64
MAX_BLOCK_SIZE = 1024
MAX_PROMPT_LEN = 4096

# keyword of load_model -> the command-line flag that sets it
_FLAGS = {
    "mode": "--mode",
    "policy": "--mode",
    "requests": "--requests",
    "blocks": "--blocks",
    "faults": "--faults",
    "prefill_workers": "--workers",
    "decode_workers": "--workers",
    "prefix_cache": "--prefix-cache",
    "chunks": "--chunks",
    "layerwise": "--layerwise",
    "block_size": "--block-size",
    "prompt_len": "--prompt-len",
}

_DEFAULT = "reference"
_REPO_MODELS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models"
)


@attrs.frozen
class ModelInfo:
    """Where a model came from: ``spec`` as given, ``module`` (or None),
    ``expected`` invariant (``None`` for a correct model or when unknown:
    ``has_expected`` says which), the configuration used (or None)."""

    spec: str
    name: str
    expected: str | None = None
    has_expected: bool = False
    config: Any = None
    module: ModuleType | None = attrs.field(default=None, eq=False, repr=False)
    doc: str = ""
    warnings: tuple[str, ...] = ()


def _first_line(doc: str | None) -> str:
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def _catalogue() -> tuple[str, ModuleType | None]:
    """The package holding the catalogue: ``pdproto.models`` when installed,
    else the repository's ``models`` directory loaded as that package."""
    try:
        pkg = importlib.import_module("pdproto.models")
        return "pdproto.models", pkg
    except ImportError:
        pass
    init = os.path.join(_REPO_MODELS, "__init__.py")
    if os.path.exists(init):
        spec = importlib.util.spec_from_file_location(
            "pdproto.models", init, submodule_search_locations=[_REPO_MODELS]
        )
        if spec is not None and spec.loader is not None:
            pkg = importlib.util.module_from_spec(spec)
            sys.modules["pdproto.models"] = pkg
            try:
                spec.loader.exec_module(pkg)
            except BaseException:
                del sys.modules["pdproto.models"]
                raise
            return "pdproto.models", pkg
    return "pdproto.models", None


def _model_names() -> list[str]:
    _, pkg = _catalogue()
    if pkg is None:
        return []
    names = []
    for info in pkgutil.iter_modules(list(getattr(pkg, "__path__", []))):
        if not info.name.startswith("_"):
            names.append(info.name)
    return sorted(names, key=lambda n: (n != _DEFAULT, n))


def list_models() -> list[tuple[str, str | None, str]]:
    """Every catalogue model as ``(name, EXPECTED, first docstring line)``;
    a module that fails to import is listed with its error as the line."""
    out = []
    for name in _model_names():
        try:
            mod = importlib.import_module(f"pdproto.models.{name}")
        except Exception as exc:  # a broken module is listed, not fatal
            out.append((name.replace("_", "-"), None, f"(cannot import: {exc})"))
            continue
        out.append((name.replace("_", "-"), getattr(mod, "EXPECTED", None), _first_line(mod.__doc__)))
    return out


def _where(exc: BaseException, files: tuple[str, ...] = ()) -> tuple[str | None, int]:
    """The file and line where a model's own code raised ``exc``: a syntax
    error's position, else the innermost traceback frame outside pdproto's
    loader and importlib (preferring ``files``)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 0
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and "importlib" not in f.filename and not f.filename.startswith("<frozen")
    ]
    wanted = [f for f in frames if os.path.abspath(f.filename) in files]
    pick = (wanted or frames)[-1:]
    if not pick:
        return (files[0] if files and files[0].endswith(".py") else None), 0
    return pick[0].filename, pick[0].lineno or 0


def _failed(spec: str, stage: str, exc: BaseException, files: tuple[str, ...] = ()) -> ModelLoadError:
    file, line = _where(exc, files)
    error = ModelLoadError(spec, stage, exc, file, line)
    error.__cause__ = exc
    return error


def _load_file(path: str, given: str) -> ModuleType:
    if "\0" in path or not os.path.isfile(path):
        raise UsageError("model file", path, "an existing .py file")
    mod_name = "_pdproto_user_model_" + str(abs(hash(os.path.abspath(path))))
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UsageError("model file", path, "a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except (Exception, SystemExit) as exc:  # the model's own error: one line, exit 2
        sys.modules.pop(mod_name, None)
        if isinstance(exc, ValueError) and "null bytes" in str(exc):  # Python < 3.12
            raise ModelLoadError(given, "import", exc, path, 0) from exc
        raise _failed(given, "import", exc, (os.path.abspath(path),)) from exc
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return mod


def _import(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError("model module", spec, "an importable module") from None
        raise _failed(spec, "import", exc) from exc
    except (Exception, SystemExit) as exc:
        raise _failed(spec, "import", exc) from exc


def _is_model(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("initial_states", "actions", "step")) and not isinstance(obj, type)


def load_model(
    spec: str | None = None,
    *,
    policy: str | None = None,
    requests: int | None = None,
    blocks: int | None = None,
    faults: Mapping[str, int] | None = None,
    prefill_workers: int | None = None,
    decode_workers: int | None = None,
    mode: str | None = None,
    prefix_cache: bool | None = None,
    chunks: int | None = None,
    layerwise: bool | None = None,
    block_size: int | None = None,
    prompt_len: int | None = None,
) -> tuple[Any, ModelInfo]:
    """Resolve ``spec`` to a model; return ``(model, info)``.

    ``policy`` (``mode`` is an alias), ``requests``, ``blocks``, the worker
    counts and ``faults`` (budgets replacing the default ones: kinds not named
    get 0) evolve the module's ``DEFAULT_CONFIG``; they are an error for a
    bare model instance, and for a configuration with no such field.
    ``prefix_cache``, ``chunks``, ``layerwise``, ``block_size`` and
    ``prompt_len`` set the handoff configuration's fields of those names
    (format 1.1 behaviour: see :class:`~pdproto.ModelConfig`).
    ``info.warnings`` says when the configuration is likely out of reach of
    an exhaustive search.

    Raises:
        UsageError: an unknown model, a flag that does not apply, a size over
            :data:`MAX_REQUESTS`, :data:`MAX_BLOCKS` or :data:`MAX_WORKERS`.
        ModelLoadError: the model's own code raised while it was imported or built.
    """
    overrides = _overrides(policy, mode, requests, blocks, prefill_workers, decode_workers)
    overrides.update(_v11_overrides(prefix_cache, chunks, layerwise, block_size, prompt_len))
    given = spec if spec is not None else _DEFAULT
    target, module = _resolve(spec, given)
    model, config = _instantiate(target, module, overrides, faults, given)
    expected = getattr(module, "EXPECTED", None) if module is not None else None
    has_expected = module is not None and hasattr(module, "EXPECTED")
    name = getattr(model, "name", None) or given
    doc = _first_line(module.__doc__) if module is not None else ""
    warning = reach_warning(config)
    return model, ModelInfo(
        given, name, expected, has_expected, config, module, doc, (warning,) if warning else ()
    )


def _overrides(
    policy: str | None,
    mode: str | None,
    requests: int | None,
    blocks: int | None,
    prefill_workers: int | None,
    decode_workers: int | None,
) -> dict[str, Any]:
    """The configuration fields the caller sets, validated."""
    if policy is not None and mode is not None and policy != mode:
        raise UsageError("policy", (policy, mode), "one value (mode is an alias of policy)")
    policy = policy if policy is not None else mode
    for what, value, top in (
        ("--requests", requests, MAX_REQUESTS),
        ("--blocks", blocks, MAX_BLOCKS),
        ("--workers", prefill_workers, MAX_WORKERS),
        ("--workers", decode_workers, MAX_WORKERS),
    ):
        if value is not None and (type(value) is not int or not 1 <= value <= top):
            raise UsageError(what, value, f"an integer from 1 to {top}")
    given = {
        "policy": policy,
        "requests": requests,
        "blocks": blocks,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
    }
    return {k: v for k, v in given.items() if v is not None}


def _v11_overrides(
    prefix_cache: bool | None,
    chunks: int | None,
    layerwise: bool | None,
    block_size: int | None,
    prompt_len: int | None,
) -> dict[str, Any]:
    """The format 1.1 fields (and the prompt's shape) the caller sets, validated."""
    out: dict[str, Any] = {}
    for what, name, value in (
        ("--prefix-cache", "prefix_cache", prefix_cache),
        ("--layerwise", "layerwise", layerwise),
    ):
        if value is not None:
            if type(value) is not bool:
                raise UsageError(what, value, "True or False")
            out[name] = value
    for what, name, value, top in (
        ("--chunks", "chunks", chunks, MAX_CHUNKS),
        ("--block-size", "block_size", block_size, MAX_BLOCK_SIZE),
        ("--prompt-len", "prompt_len", prompt_len, MAX_PROMPT_LEN),
    ):
        if value is not None:
            if type(value) is not int or not 1 <= value <= top:
                raise UsageError(what, value, f"an integer from 1 to {top}")
            out[name] = value
    return out


def _resolve(spec: str | None, given: str) -> tuple[Any, ModuleType | None]:
    """``(target, module)``: what ``spec`` names (a module, a builder or a
    model) and the module it lives in."""
    if spec is not None and ":" in spec and not (len(spec) > 1 and spec[1] == ":" and os.sep == "\\"):
        mod_part, _, attr = spec.rpartition(":")
        if not mod_part or not attr:
            raise UsageError("MODEL", spec, "NAME, PATH.py or module:attribute")
        if mod_part.endswith(".py") or os.sep in mod_part:
            module = _load_file(mod_part, spec)
        else:
            module = _import(mod_part, spec)
        try:
            target = getattr(module, attr)
        except AttributeError:
            raise UsageError("MODEL", spec, f"an attribute of module {mod_part!r}") from None
    elif spec is not None and (spec.endswith(".py") or os.sep in spec):
        module = _load_file(spec, spec)
        target = module
    else:
        name = given.replace("-", "_")
        _, pkg = _catalogue()
        names = _model_names()
        if pkg is None or name not in names:
            shown = ", ".join(n.replace("_", "-") for n in names) or "(none installed)"
            raise UsageError("model", given, f"a model file, module:attribute, or one of: {shown}")
        module = _import(f"pdproto.models.{name}", given)
        target = module
    if isinstance(target, ModuleType):
        module = target
        build = getattr(module, "build", None)
        if callable(build):
            target = build
        elif _is_model(getattr(module, "model", None)):
            target = module.model
        else:
            raise UsageError("MODEL", given, "a module with build(config) or a model attribute")
    return target, module


def _instantiate(
    target: Any,
    module: ModuleType | None,
    overrides: dict[str, Any],
    faults: Mapping[str, int] | None,
    given: str,
) -> tuple[Any, Any]:
    """``(model, config)``: a model instance as is, or a builder called with its
    module's ``DEFAULT_CONFIG`` evolved by ``overrides`` and ``faults``."""
    if _is_model(target):
        if overrides or faults is not None:
            raise UsageError(
                "--mode/--requests/--blocks/--faults",
                given,
                "no configuration flags: this MODEL is a model instance, not a builder",
            )
        return target, None
    if not callable(target):
        raise UsageError(
            "MODEL", given, "a Model instance, a builder callable(config), or a module with build()"
        )
    if module is not None and hasattr(module, "DEFAULT_CONFIG"):
        config = module.DEFAULT_CONFIG
    else:
        from ..protocol import ModelConfig

        config = ModelConfig()
    if faults is not None:
        overrides["faults"] = dict(faults)  # replaces the budgets: unnamed kinds get 0
    if overrides:
        config = _configure(config, overrides, given)
    try:
        model = target(config)
    except (Exception, SystemExit) as exc:  # the builder's own error: one line, exit 2
        files = (
            (os.path.abspath(module.__file__),)
            if module is not None and getattr(module, "__file__", None)
            else ()
        )
        raise _failed(given, "build", exc, files) from exc
    if not _is_model(model):
        raise UsageError("MODEL", given, "a builder returning a model (initial_states, actions, step)")
    return model, config


def _configure(config: Any, overrides: dict[str, Any], given: str) -> Any:
    """``config`` with ``overrides``; a clear error naming the flags that do
    not apply when the configuration has no such field."""
    if attrs.has(type(config)):
        fields = {a.name for a in attrs.fields(type(config))}
    elif isinstance(config, dict):
        fields = set(config)
    else:
        fields = set()
    if "policy" in overrides and "policy" not in fields and "mode" in fields:
        overrides["mode"] = overrides.pop("policy")  # a configuration that still calls it mode
    missing = [k for k in overrides if k not in fields]
    if missing:
        flags = sorted({_FLAGS.get(k, k) for k in missing})
        kind = type(config).__name__ if config is not None else "no DEFAULT_CONFIG"
        has = ", ".join(sorted(fields)) or "none"
        raise UsageError(
            " ".join(flags),
            given,
            f"a model these flags apply to: model {given!r} takes its sizes from its own "
            f"configuration ({kind}; fields: {has})",
        )
    try:
        if isinstance(config, dict):
            return {**config, **overrides}
        return attrs.evolve(config, **overrides)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(
            "configuration flag", sorted(overrides), f"fields of the model's configuration ({exc})"
        ) from None


def reach_warning(config: Any) -> str | None:
    """A warning when an exhaustive search of a handoff configuration is
    likely out of reach (over about 10**7 states), or None.

    The estimate is rough, fitted on the reference model with symmetry: one
    request with every fault kind at budget 1 has about 2,800 states, two
    about 100,000; without faults a request adds little (2 requests 24
    states, 4 requests 75).  So about ``10**(1.1 + 0.29 B + (R-1)(0.25 +
    0.16 B))`` for R requests and a total fault budget B, more with more
    blocks and workers.
    """
    requests = getattr(config, "requests", None)
    if type(requests) is not int:
        return None
    blocks = getattr(config, "blocks", 1)
    workers = getattr(config, "prefill_workers", 1) + getattr(config, "decode_workers", 1)
    faults = getattr(config, "faults", {}) or {}
    budget = sum(v for v in faults.values() if type(v) is int)
    log10 = (
        1.1
        + 0.29 * budget
        + (requests - 1) * (0.25 + 0.16 * budget)
        + 0.2 * max(0, blocks - 1) * (requests - 1)
        + 0.5 * max(0, workers - 2) * requests
    )
    if log10 < 7:
        return None
    return (
        f"this configuration ({requests} requests, {blocks} blocks, {workers} workers, total fault "
        f"budget {budget}) has very roughly 10**{int(log10)} states: likely out of reach of an "
        "exhaustive search; use --max-states, --fingerprint, a smaller configuration, or pdproto fuzz"
    )
