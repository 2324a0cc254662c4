"""The drivers: explore a model exhaustively, load models from the catalogue.
They feed every event a model emits to the monitor."""

from ._explore import Step as Step
from ._explore import Counterexample as Counterexample
from ._explore import ExploreResult as ExploreResult
from ._explore import explore as explore
from ._explore import rerun as rerun
from ._explore import rename_monitor_key as rename_monitor_key
from ._loader import load_model as load_model
from ._loader import list_models as list_models
from ._loader import ModelInfo as ModelInfo
from ._audit import audit as audit
from ._audit import AuditResult as AuditResult
from ._replay import replay as replay
from ._replay import ReplayResult as ReplayResult
from ._replay import load_torch_backend as load_torch_backend
from ._replay import torch_backend_factory as torch_backend_factory
from ._fuzz import fuzz as fuzz
from ._fuzz import FuzzResult as FuzzResult
from ._fuzz import FuzzStats as FuzzStats
from ._fuzz import HandoffFailure as HandoffFailure
from ._fuzz import reachable_states as reachable_states

__all__ = [
    "Step",
    "Counterexample",
    "ExploreResult",
    "explore",
    "rerun",
    "rename_monitor_key",
    "load_model",
    "list_models",
    "ModelInfo",
    "audit",
    "AuditResult",
    "replay",
    "ReplayResult",
    "load_torch_backend",
    "torch_backend_factory",
    "fuzz",
    "FuzzResult",
    "FuzzStats",
    "HandoffFailure",
    "reachable_states",
]
