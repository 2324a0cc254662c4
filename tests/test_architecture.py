"""The layering of docs/architecture.md, enforced: imports run only downwards,
and each heavy or optional dependency is imported only by the layer that owns
it.  Every import statement counts, also the lazy ones inside functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

from conftest import ROOT

PACKAGE = pathlib.Path(ROOT) / "pdproto"
MODELS = pathlib.Path(ROOT) / "models"

#: Layers, lowest first (docs/architecture.md draws the same list).
LAYERS = (
    ("pdproto._errors", "pdproto._version"),
    ("pdproto.spec",),
    ("pdproto.importers",),
    ("pdproto.protocol",),
    ("pdproto.backends",),
    ("pdproto.drivers",),
    ("pdproto.models",),
    ("pdproto.adapters",),
    ("pdproto.cost",),
    ("pdproto.sim",),
    ("pdproto.testing", "pdproto._pytest_plugin"),
    ("pdproto._cli", "pdproto.__main__"),
    ("pdproto",),
)

#: Layers that stand apart: they may import only these layers, not every lower one.
NARROW = {
    "pdproto.importers": ("pdproto._errors", "pdproto._version", "pdproto.spec"),
    "pdproto.backends": ("pdproto._errors", "pdproto.spec"),
    "pdproto.cost": ("pdproto._errors",),
    "pdproto.sim": ("pdproto._errors", "pdproto._version", "pdproto.spec", "pdproto.cost"),
}

#: Third-party packages and the layers allowed to import them.
THIRD_PARTY = {
    "torch": ("pdproto.backends", "pdproto.adapters"),
    "numpy": ("pdproto.backends",),
    "rich": ("pdproto._cli",),
    "hypothesis": ("pdproto.drivers", "pdproto.testing", "pdproto._pytest_plugin"),
    "pytest": ("pdproto._pytest_plugin",),
    "networkx": ("pdproto.drivers", "pdproto._cli"),
    "matplotlib": ("pdproto.cost", "pdproto.sim"),
    "orjson": ("pdproto.spec",),
    "vllm": ("pdproto.adapters",),
    "transformers": ("pdproto.backends",),
    "nixl": ("pdproto.backends",),
    "nixl_cu12": ("pdproto.backends",),
    "mooncake": ("pdproto.backends",),
    "ray": ("pdproto.drivers",),
}


def layer_of(module: str) -> int:
    """The index of the layer holding ``module`` (the longest prefix wins)."""
    best, best_len = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best < 0:
        raise AssertionError(f"{module} is in no layer of LAYERS")
    return best


def module_name(path: pathlib.Path) -> str:
    if path.is_relative_to(MODELS):
        rel = ("pdproto", "models") + path.relative_to(MODELS).with_suffix("").parts
    else:
        rel = ("pdproto",) + path.relative_to(PACKAGE).with_suffix("").parts
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``source``, the text of
    module ``name``."""
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: x may be a submodule
                    out.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
                    continue
            out.append((node.lineno, target))
    return out


SOURCES = sorted(PACKAGE.rglob("*.py")) + sorted(MODELS.glob("*.py"))


def _resolve(target: str) -> str:
    """``pdproto.spec.Monitor`` (a name imported from a package) -> its module."""
    parts = target.split(".")
    while len(parts) > 1:
        cand = PACKAGE.parent.joinpath(*parts)
        if cand.with_suffix(".py").exists() or (cand / "__init__.py").exists():
            break
        if parts[:2] == ["pdproto", "models"] and len(parts) == 2:
            break
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_only_downwards(path):
    here = module_name(path)
    mine = layer_of(here)
    bad = []
    for line, target in imports_of(path):
        if target == "pdproto" or target.startswith("pdproto."):
            target = _resolve(target)
            if layer_of(target) > mine:
                bad.append(f"{path.name}:{line} imports {target} (layer {layer_of(target)} > {mine})")
            bad.extend(_narrow(here, target, f"{path.name}:{line}"))
    assert not bad, "\n".join(bad)


def _narrow(here: str, target: str, where: str) -> list[str]:
    for layer, allowed in NARROW.items():
        inside = here == layer or here.startswith(layer + ".")
        own = target == layer or target.startswith(layer + ".")
        if inside and not own and not any(target == a or target.startswith(a + ".") for a in allowed):
            return [f"{where} imports {target}; {layer} may import only {', '.join(allowed)}"]
    return []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_heavy_dependencies_stay_in_their_layer(path):
    here = module_name(path)
    bad = []
    for line, target in imports_of(path):
        top = target.split(".")[0]
        allowed = THIRD_PARTY.get(top)
        if allowed is not None and not any(here == a or here.startswith(a + ".") for a in allowed):
            bad.append(f"{path.name}:{line} imports {top}; only {', '.join(allowed)} may")
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_layer():
    for path in SOURCES:
        layer_of(module_name(path))


def test_the_layer_check_catches_an_upward_import():
    """The check itself can fail: an import from a higher layer is seen as one."""
    found = imports_in("def f():\n    from ..drivers import explore\n", "pdproto.spec._x", False)
    assert found == [(2, "pdproto.drivers")]
    assert layer_of(_resolve("pdproto.drivers")) > layer_of("pdproto.spec._x")
