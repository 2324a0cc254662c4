"""pdproto: model and verify the prefill->decode KV handoff protocol of
disaggregated LLM serving.

The public API is ``__all__`` below (a test pins it).  The subpackages, in the
order the data flows (docs/architecture.md):

- :mod:`pdproto.spec`: history events, the history format, the monitor;
- :mod:`pdproto.protocol`: the model interface, configuration, the reference
  handoff protocol;
- :mod:`pdproto.backends`: execute a history on real KV memory (torch);
- :mod:`pdproto.drivers`: explore, fuzz, audit and replay;
- :mod:`pdproto.cost`: the cost model of one handoff;
- :mod:`pdproto.testing`: the Hypothesis state machine for your own tests.

Importing pdproto imports neither torch, rich nor hypothesis.
"""

from ._errors import FileFormatError as FileFormatError
from ._errors import HistoryFormatError as HistoryFormatError
from ._errors import LimitError as LimitError
from ._errors import MissingExtraError as MissingExtraError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import PdprotoError as PdprotoError
from ._errors import TransportError as TransportError
from ._errors import UsageError as UsageError
from ._version import __version__ as __version__
from .drivers import Adapter as Adapter
from .drivers import AuditResult as AuditResult
from .drivers import ConformanceResult as ConformanceResult
from .drivers import Counterexample as Counterexample
from .drivers import ExploreResult as ExploreResult
from .drivers import FuzzResult as FuzzResult
from .drivers import ModelAdapter as ModelAdapter
from .drivers import ModelInfo as ModelInfo
from .drivers import ReplayResult as ReplayResult
from .drivers import Step as Step
from .drivers import audit as audit
from .drivers import conform as conform
from .drivers import explore as explore
from .drivers import fuzz as fuzz
from .drivers import fuzz_adapter as fuzz_adapter
from .drivers import list_models as list_models
from .drivers import load_adapter as load_adapter
from .drivers import load_model as load_model
from .drivers import replay as replay
from .drivers import replay_on_adapter as replay_on_adapter
from .protocol import FAULT_KINDS as FAULT_KINDS
from .protocol import Action as Action
from .protocol import ActionNotEnabled as ActionNotEnabled
from .protocol import Handoff as Handoff
from .protocol import HandoffModel as HandoffModel
from .protocol import Model as Model
from .protocol import ModelConfig as ModelConfig
from .protocol import Renaming as Renaming
from .protocol import parse_faults as parse_faults
from .protocol import transition_table as transition_table
from .spec import END_INVARIANTS as END_INVARIANTS
from .spec import EVENT_TYPES as EVENT_TYPES
from .spec import FEATURES as FEATURES
from .spec import FORMAT_VERSION as FORMAT_VERSION
from .spec import FORMAT_VERSIONS as FORMAT_VERSIONS
from .spec import INVARIANT_NEEDS as INVARIANT_NEEDS
from .spec import INVARIANTS as INVARIANTS
from .spec import Alloc as Alloc
from .spec import Cancel as Cancel
from .spec import Commit as Commit
from .spec import Decode as Decode
from .spec import Event as Event
from .spec import Fail as Fail
from .spec import Finish as Finish
from .spec import Free as Free
from .spec import HistoryHeader as HistoryHeader
from .spec import HistoryReader as HistoryReader
from .spec import HistoryWriter as HistoryWriter
from .spec import KVSpec as KVSpec
from .spec import Monitor as Monitor
from .spec import Observation as Observation
from .spec import PartialMonitor as PartialMonitor
from .spec import PrefillDone as PrefillDone
from .spec import PrefillStart as PrefillStart
from .spec import Reserve as Reserve
from .spec import Restart as Restart
from .spec import Share as Share
from .spec import Submit as Submit
from .spec import TransferAbort as TransferAbort
from .spec import TransferFailed as TransferFailed
from .spec import TransferReadDone as TransferReadDone
from .spec import TransferStart as TransferStart
from .spec import TransferWriteDone as TransferWriteDone
from .spec import Violation as Violation
from .spec import WorkerSpec as WorkerSpec
from .spec import event_from_dict as event_from_dict
from .spec import open_history as open_history
from .spec import read_events as read_events
from .spec import write_history as write_history

__all__ = [
    # errors
    "PdprotoError",
    "HistoryFormatError",
    "FileFormatError",
    "UsageError",
    "LimitError",
    "MissingExtraError",
    "ModelLoadError",
    "TransportError",
    # the spec: events, histories, the monitor
    "Event",
    "EVENT_TYPES",
    "Submit",
    "Reserve",
    "PrefillStart",
    "PrefillDone",
    "Alloc",
    "TransferStart",
    "TransferReadDone",
    "TransferWriteDone",
    "TransferFailed",
    "TransferAbort",
    "Commit",
    "Decode",
    "Finish",
    "Cancel",
    "Fail",
    "Free",
    "Restart",
    "Share",
    "event_from_dict",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "FEATURES",
    "KVSpec",
    "HistoryHeader",
    "HistoryReader",
    "HistoryWriter",
    "WorkerSpec",
    "open_history",
    "read_events",
    "write_history",
    "INVARIANTS",
    "END_INVARIANTS",
    "INVARIANT_NEEDS",
    "Monitor",
    "PartialMonitor",
    "Observation",
    "Violation",
    # the protocol: models
    "Action",
    "ActionNotEnabled",
    "Model",
    "Renaming",
    "FAULT_KINDS",
    "ModelConfig",
    "parse_faults",
    "Handoff",
    "HandoffModel",
    "transition_table",
    # the drivers
    "explore",
    "ExploreResult",
    "audit",
    "AuditResult",
    "conform",
    "ConformanceResult",
    "replay",
    "ReplayResult",
    "fuzz",
    "FuzzResult",
    "Counterexample",
    "Step",
    "load_model",
    "list_models",
    "ModelInfo",
    "Adapter",
    "ModelAdapter",
    "load_adapter",
    "fuzz_adapter",
    "replay_on_adapter",
    # the torch backend (loaded on first use)
    "TorchBackend",
    "KVCorruption",
    "KV_CORRUPTION",
    # the model backend (loaded on first use)
    "ModelBackend",
    "LogitDivergence",
    "LOGIT_DIVERGENCE",
]

# The backends import torch (and transformers), which `import pdproto` must
# not: their names are loaded on first use.
_LAZY = frozenset(
    {"TorchBackend", "KVCorruption", "KV_CORRUPTION", "ModelBackend", "LogitDivergence", "LOGIT_DIVERGENCE"}
)


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdproto' has no attribute {name!r}")
    from . import backends

    value = getattr(backends, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
