"""The protocol: the model interface, the configuration of a handoff model, and
the reference handoff protocol (push and pull).  Imports only the spec."""

from ._model import Action as Action
from ._model import Model as Model
from ._model import ActionNotEnabled as ActionNotEnabled
from ._model import Renaming as Renaming
from ._config import FAULT_KINDS as FAULT_KINDS
from ._config import ModelConfig as ModelConfig
from ._config import parse_faults as parse_faults
from ._reference import HandoffModel as HandoffModel
from ._reference import Handoff as Handoff
from ._reference import HState as HState
from ._reference import Req as Req
from ._reference import Xfer as Xfer
from ._reference import Msg as Msg
from ._reference import transition_table as transition_table
from ._reference import transition_table_markdown as transition_table_markdown

__all__ = [
    "Action",
    "Model",
    "ActionNotEnabled",
    "Renaming",
    "FAULT_KINDS",
    "ModelConfig",
    "parse_faults",
    "HandoffModel",
    "Handoff",
    "HState",
    "Req",
    "Xfer",
    "Msg",
    "transition_table",
    "transition_table_markdown",
]
