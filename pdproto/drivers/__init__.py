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
]
