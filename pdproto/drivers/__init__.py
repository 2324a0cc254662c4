"""The drivers: explore a model exhaustively, fuzz it, load models from the
catalogue, and drive real systems through adapters (docs/adapters.md).
They feed every event a model or a real system emits to the monitor."""

from typing import TYPE_CHECKING, Any

from ._adapter import Adapter as Adapter
from ._adapter import ModelAdapter as ModelAdapter
from ._adapter import load_adapter as load_adapter
from ._adapter_fuzz import AdapterFailure as AdapterFailure
from ._adapter_fuzz import AdapterFuzzResult as AdapterFuzzResult
from ._adapter_fuzz import fuzz_adapter as fuzz_adapter
from ._adapter_fuzz import run_actions as run_actions
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
from ._explore import trace_header as trace_header
from ._fuzz import fuzz as fuzz
from ._fuzz_results import FuzzResult as FuzzResult
from ._fuzz_results import FuzzStats as FuzzStats
from ._fuzz_results import HandoffFailure as HandoffFailure
from ._fuzz_results import reachable_states as reachable_states
from ._loader import ModelInfo as ModelInfo
from ._loader import list_models as list_models
from ._loader import load_model as load_model
from ._replay import LOGIT_DIVERGENCE as LOGIT_DIVERGENCE
from ._replay import ReplayResult as ReplayResult
from ._replay import level as level
from ._replay import load_torch_backend as load_torch_backend
from ._replay import load_transport as load_transport
from ._replay import model_backend_factory as model_backend_factory
from ._replay import replay as replay
from ._replay import torch_backend_factory as torch_backend_factory

__all__ = [
    "run_actions",
    "corpus_dir",
    "list_rows",
    "run_corpus",
    "trace_header",
    "namespaced_database",
    "handoff_machine",
    "uniform_machine",
    "FuzzWorkerError",
    "max_local_workers",
    "merge",
    "BudgetSlice",
    "plan",
    "split_examples",
    "worker_seed",
    "import_ray",
    "LOGIT_DIVERGENCE",
    "level",
    "model_backend_factory",
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

#: names loaded on first use (they import hypothesis, or the catalogue)
_LAZY = {
    "handoff_machine": "._machine",
    "uniform_machine": "._machine",
    "namespaced_database": "._hypothesis",
    "import_ray": "._remote",
    "corpus_dir": "._catalogue",
    "list_rows": "._catalogue",
    "run_corpus": "._catalogue",
    "FuzzWorkerError": "._fuzz_budget",
    "max_local_workers": "._fuzz_budget",
    "merge": "._parallel_fuzz",
    "plan": "._fuzz_budget",
    "split_examples": "._fuzz_budget",
    "worker_seed": "._fuzz_budget",
    "BudgetSlice": "._fuzz_budget",
}


if TYPE_CHECKING:  # the lazy names' real types, for the type checker
    from ._catalogue import corpus_dir, list_rows, run_corpus
    from ._fuzz_budget import (
        BudgetSlice,
        FuzzWorkerError,
        max_local_workers,
        plan,
        split_examples,
        worker_seed,
    )
    from ._hypothesis import namespaced_database
    from ._machine import handoff_machine, uniform_machine
    from ._parallel_fuzz import merge
    from ._remote import import_ray


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdproto.drivers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
