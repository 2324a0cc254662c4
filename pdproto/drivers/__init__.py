"""The drivers: explore a model exhaustively, fuzz it, load models from the
catalogue, and drive real systems through adapters (docs/adapters.md).
They feed every event a model or a real system emits to the monitor."""

from ._adapter import Adapter as Adapter
from ._adapter import ModelAdapter as ModelAdapter
from ._adapter import load_adapter as load_adapter
from ._adapter_fuzz import AdapterFailure as AdapterFailure
from ._adapter_fuzz import AdapterFuzzResult as AdapterFuzzResult
from ._adapter_fuzz import fuzz_adapter as fuzz_adapter
from ._adapter_replay import AdapterReplayResult as AdapterReplayResult
from ._adapter_replay import Divergence as Divergence
from ._adapter_replay import replay_on_adapter as replay_on_adapter
from ._audit import AuditResult as AuditResult
from ._audit import audit as audit
from ._conform import ConformanceResult as ConformanceResult
from ._conform import conform as conform
from ._explore import Counterexample as Counterexample
from ._explore import ExploreResult as ExploreResult
from ._explore import Step as Step
from ._explore import explore as explore
from ._explore import rename_monitor_key as rename_monitor_key
from ._explore import rerun as rerun
from ._fuzz import FuzzResult as FuzzResult
from ._fuzz import FuzzStats as FuzzStats
from ._fuzz import HandoffFailure as HandoffFailure
from ._fuzz import fuzz as fuzz
from ._fuzz import reachable_states as reachable_states
from ._loader import ModelInfo as ModelInfo
from ._loader import list_models as list_models
from ._loader import load_model as load_model
from ._replay import ReplayResult as ReplayResult
from ._replay import load_torch_backend as load_torch_backend
from ._replay import load_transport as load_transport
from ._replay import replay as replay
from ._replay import torch_backend_factory as torch_backend_factory

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
    "conform",
    "ConformanceResult",
    "replay",
    "ReplayResult",
    "load_torch_backend",
    "torch_backend_factory",
    "load_transport",
    "fuzz",
    "FuzzResult",
    "FuzzStats",
    "HandoffFailure",
    "reachable_states",
    "Adapter",
    "ModelAdapter",
    "load_adapter",
    "fuzz_adapter",
    "AdapterFuzzResult",
    "AdapterFailure",
    "replay_on_adapter",
    "AdapterReplayResult",
    "Divergence",
]
