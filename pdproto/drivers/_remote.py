"""What the parallel explorer and the parallel fuzzer share to run a model in
another interpreter (a worker process, a Ray actor or task): the model in a
form that survives pickling (:func:`portable`, :func:`rebuilt`), the
environment a spawned worker needs to hash like its peers
(:func:`hash_seed_env`), and Ray itself (:func:`import_ray`, imported only
when a run asks for it; :func:`pickle_by_value` for a model file that is not
an importable module).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .._errors import MissingExtraError


def portable(model: Any) -> Any:
    """What to send to another interpreter (a worker process, a Ray actor or
    task) for ``model``: ``("build", class, config)`` for a
    :class:`~pdproto.HandoffModel` (or a subclass that keeps its
    constructor), whose rule caches are keyed by object identity and do not
    survive pickling; ``("model", model)`` otherwise.  :func:`rebuilt` undoes it."""
    from ..protocol import HandoffModel

    if isinstance(model, HandoffModel) and type(model).__init__ is HandoffModel.__init__:
        return ("build", type(model), model.config)
    return ("model", model)


def rebuilt(sent: Any) -> Any:
    """The model :func:`portable` sent (anything else is returned as it is)."""
    if isinstance(sent, tuple) and len(sent) in (2, 3) and sent[0] in ("build", "model"):
        return sent[1](sent[2]) if sent[0] == "build" else sent[1]
    return sent


def hash_seed_env() -> dict[str, str]:
    """The environment a spawned worker needs to hash like its peers."""
    return {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}


def import_ray(command: str = "pdproto fuzz --ray") -> Any:
    """The ``ray`` module, or :class:`~pdproto.MissingExtraError` naming
    ``command`` (the one that needs Ray) and ``pip install 'pdproto[ray]'``."""
    try:
        import ray
    except ImportError:
        raise MissingExtraError(command, "ray", "ray") from None
    return ray


def pickle_by_value(model: Any) -> None:
    """Let Ray pickle the model's module by value when a fresh process could
    not import it by name (a model file loaded from a path)."""
    try:
        from ray import cloudpickle
    except ImportError:  # pragma: no cover - Ray without its cloudpickle
        return
    name = getattr(type(model), "__module__", "") or ""
    # pdproto's own modules import by name in the actors; the catalogue may not:
    # run from a checkout, the loader loads the repository's models/ as
    # pdproto.models, which a fresh process finds nowhere (pdproto/ has no models/)
    if (name.startswith(("pdproto.", "builtins")) or name == "pdproto") and not name.startswith(
        "pdproto.models."
    ):
        return
    mod = sys.modules.get(name)
    if mod is not None:
        try:
            cloudpickle.register_pickle_by_value(mod)
        except (ValueError, TypeError):  # already registered, or not a module
            pass


__all__ = ["portable", "rebuilt", "hash_seed_env", "import_ray", "pickle_by_value"]
