"""Finding the model ``pdproto check MODEL`` names.

MODEL is a name from the catalogue (``pdproto.models``, the repository's
``models/`` directory), a path to a model file (``.py``), or
``module:attribute``.  A model file (or module) follows the catalogue
contract: ``build(config) -> Model`` and ``DEFAULT_CONFIG``, with
``EXPECTED`` naming the invariant a mutant is meant to break (``None`` for a
correct model).  A module without ``build`` may instead define a ``model``
attribute holding a Model instance.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from types import ModuleType
from typing import Any, Mapping

import attrs

from .._errors import UsageError

__all__ = ["load_model", "list_models", "ModelInfo"]

_DEFAULT = "reference"
_REPO_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")


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


def _load_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise UsageError("model file", path, "an existing .py file")
    mod_name = "_pdproto_user_model_" + str(abs(hash(os.path.abspath(path))))
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UsageError("model file", path, "a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
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
        raise


def _is_model(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("initial_states", "actions", "step")) and not isinstance(obj, type)


def load_model(
    spec: str | None = None,
    *,
    mode: str | None = None,
    requests: int | None = None,
    blocks: int | None = None,
    faults: Mapping[str, int] | None = None,
    max_states: int | None = None,
    prefill_workers: int | None = None,
    decode_workers: int | None = None,
) -> tuple[Any, ModelInfo]:
    """Resolve ``spec`` to a model; return ``(model, info)``.

    ``mode``, ``requests``, ``blocks`` and ``faults`` (budgets replacing the
    default ones: kinds not named get 0) evolve the module's ``DEFAULT_CONFIG``; they are an error
    for a bare model instance.  ``max_states`` is accepted for symmetry with
    the command line and ignored here.
    """
    overrides: dict[str, Any] = {}
    if mode is not None:
        overrides["mode"] = mode
    if requests is not None:
        overrides["requests"] = requests
    if blocks is not None:
        overrides["blocks"] = blocks
    if prefill_workers is not None:
        overrides["prefill_workers"] = prefill_workers
    if decode_workers is not None:
        overrides["decode_workers"] = decode_workers
    given = spec if spec is not None else _DEFAULT
    target: Any
    module: ModuleType | None = None
    if spec is not None and ":" in spec and not (len(spec) > 1 and spec[1] == ":" and os.sep == "\\"):
        mod_part, _, attr = spec.rpartition(":")
        if not mod_part or not attr:
            raise UsageError("MODEL", spec, "NAME, PATH.py or module:attribute")
        if mod_part.endswith(".py") or os.sep in mod_part:
            module = _load_file(mod_part)
        else:
            module = _import(mod_part, spec)
        try:
            target = getattr(module, attr)
        except AttributeError:
            raise UsageError("MODEL", spec, f"an attribute of module {mod_part!r}") from None
    elif spec is not None and (spec.endswith(".py") or os.sep in spec):
        module = _load_file(spec)
        target = module
    else:
        name = given.replace("-", "_")
        _, pkg = _catalogue()
        names = _model_names()
        if pkg is None or name not in names:
            shown = ", ".join(n.replace("_", "-") for n in names) or "(none installed)"
            raise UsageError("model", given, f"a model file, module:attribute, or one of: {shown}")
        module = importlib.import_module(f"pdproto.models.{name}")
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

    expected = getattr(module, "EXPECTED", None) if module is not None else None
    has_expected = module is not None and hasattr(module, "EXPECTED")
    config = None
    if _is_model(target):
        if overrides or faults is not None:
            raise UsageError(
                "--mode/--requests/--blocks/--faults", given,
                "no configuration flags: this MODEL is a model instance, not a builder",
            )
        model = target
    elif callable(target):
        if module is not None and hasattr(module, "DEFAULT_CONFIG"):
            config = module.DEFAULT_CONFIG
        else:
            from ..protocol._config import ModelConfig

            config = ModelConfig()
        if overrides or faults is not None:
            if not attrs.has(type(config)):
                raise UsageError(
                    "--mode/--requests/--blocks/--faults", given,
                    "no configuration flags: this model's DEFAULT_CONFIG is not a ModelConfig",
                )
            if faults is not None:
                overrides["faults"] = dict(faults)  # replaces the budgets: unnamed kinds get 0
            try:
                config = attrs.evolve(config, **overrides)
            except TypeError as exc:
                raise UsageError("configuration flag", sorted(overrides), f"fields of the model's configuration ({exc})") from None
        model = target(config)
        if not _is_model(model):
            raise UsageError("MODEL", given, "a builder returning a model (initial_states, actions, step)")
    else:
        raise UsageError("MODEL", given, "a Model instance, a builder callable(config), or a module with build()")

    name = getattr(model, "name", None) or given
    doc = _first_line(module.__doc__) if module is not None else ""
    return model, ModelInfo(given, name, expected, has_expected, config, module, doc)
