"""pdproto: model and verify the prefill->decode KV handoff protocol of
disaggregated LLM serving.

The public API is what this module exports; everything in ``_modules`` is
private.  Importing pdproto imports neither torch, rich nor hypothesis.
"""

from ._errors import HistoryFormatError as HistoryFormatError
from ._errors import PdprotoError as PdprotoError
from ._errors import UsageError as UsageError
from ._events import EVENT_TYPES as EVENT_TYPES
from ._events import Alloc as Alloc
from ._events import Cancel as Cancel
from ._events import Commit as Commit
from ._events import Decode as Decode
from ._events import Event as Event
from ._events import Fail as Fail
from ._events import Finish as Finish
from ._events import Free as Free
from ._events import PrefillDone as PrefillDone
from ._events import PrefillStart as PrefillStart
from ._events import Reserve as Reserve
from ._events import Restart as Restart
from ._events import Submit as Submit
from ._events import TransferAbort as TransferAbort
from ._events import TransferFailed as TransferFailed
from ._events import TransferReadDone as TransferReadDone
from ._events import TransferStart as TransferStart
from ._events import TransferWriteDone as TransferWriteDone
from ._events import event_from_dict as event_from_dict
from ._history import FORMAT_VERSION as FORMAT_VERSION
from ._history import HistoryHeader as HistoryHeader
from ._history import HistoryReader as HistoryReader
from ._history import HistoryWriter as HistoryWriter
from ._history import WorkerSpec as WorkerSpec
from ._history import open_history as open_history
from ._history import read_events as read_events
from ._history import write_history as write_history
from ._monitor import END_INVARIANTS as END_INVARIANTS
from ._monitor import INVARIANTS as INVARIANTS
from ._monitor import Monitor as Monitor
from ._monitor import Violation as Violation
from ._model import Action as Action
from ._model import ActionNotEnabled as ActionNotEnabled
from ._model import Model as Model
from ._config import FAULT_KINDS as FAULT_KINDS
from ._config import ModelConfig as ModelConfig
from ._config import parse_faults as parse_faults
from ._reference import Handoff as Handoff
from ._reference import HandoffModel as HandoffModel
from ._reference import transition_table as transition_table
from ._explore import Counterexample as Counterexample
from ._explore import ExploreResult as ExploreResult
from ._explore import Renaming as Renaming
from ._explore import Step as Step
from ._explore import explore as explore
from ._loader import ModelInfo as ModelInfo
from ._loader import list_models as list_models
from ._loader import load_model as load_model
from ._cost import DTYPES as DTYPES
from ._cost import PRESETS as PRESETS
from ._cost import CostModel as CostModel
from ._cost import CostReport as CostReport
from ._cost import KVShape as KVShape
from ._cost import Link as Link
from ._cost import Timeline as Timeline
from ._cost import Timing as Timing
from ._cost import estimate as estimate

__version__ = "0.1.0"

# The torch backend imports torch, which `import pdproto` must not: its names
# are loaded on first use.
_LAZY = {
    "TorchBackend": "._torch_backend",
    "KVCorruption": "._torch_backend",
    "KV_CORRUPTION": "._torch_backend",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdproto' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
