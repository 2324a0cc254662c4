"""The protocol: the model interface, the configuration of a handoff model, the
reference handoff protocol as rule tables (push and pull), the model that runs
them and its symmetry reduction.  Imports only the spec."""

from ._config import FAULT_KINDS as FAULT_KINDS
from ._config import ModelConfig as ModelConfig
from ._config import parse_faults as parse_faults
from ._model import Action as Action
from ._model import ActionNotEnabled as ActionNotEnabled
from ._model import Model as Model
from ._model import Renaming as Renaming
from ._push_pull import PULL as PULL
from ._push_pull import PUSH as PUSH
from ._push_pull import REFERENCE as REFERENCE
from ._reference import Handoff as Handoff
from ._reference import HandoffModel as HandoffModel
from ._reference import HState as HState
from ._reference import Msg as Msg
from ._reference import Req as Req
from ._reference import Xfer as Xfer
from ._reference import transition_table as transition_table
from ._reference import transition_table_markdown as transition_table_markdown
from ._rules import Kind as Kind
from ._rules import Rule as Rule
from ._rules import RuleBook as RuleBook
from ._rules import RuleTable as RuleTable
from ._state import End as End
from ._state import MsgKind as MsgKind
from ._state import Phase as Phase
from ._state import XferState as XferState

__all__ = [
    "Action",
    "Model",
    "ActionNotEnabled",
    "Renaming",
    "FAULT_KINDS",
    "ModelConfig",
    "parse_faults",
    "Phase",
    "End",
    "XferState",
    "MsgKind",
    "Kind",
    "Rule",
    "RuleTable",
    "RuleBook",
    "PUSH",
    "PULL",
    "REFERENCE",
    "HandoffModel",
    "Handoff",
    "HState",
    "Req",
    "Xfer",
    "Msg",
    "transition_table",
    "transition_table_markdown",
]
