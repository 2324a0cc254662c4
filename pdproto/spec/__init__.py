"""The specification: history events, the history file format, and the monitor
that judges a history against the named invariants.  Imports nothing else of
pdproto but its errors."""

from ._events import EVENT_TYPES as EVENT_TYPES
from ._events import FEATURE_FIELDS as FEATURE_FIELDS
from ._events import FEATURE_KINDS as FEATURE_KINDS
from ._events import FEATURES as FEATURES
from ._events import OMITTABLE as OMITTABLE
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
from ._events import Share as Share
from ._events import Submit as Submit
from ._events import TransferAbort as TransferAbort
from ._events import TransferFailed as TransferFailed
from ._events import TransferReadDone as TransferReadDone
from ._events import TransferStart as TransferStart
from ._events import TransferWriteDone as TransferWriteDone
from ._events import event_from_dict as event_from_dict
from ._events import parse_event as parse_event
from ._history import BOUNDARIES as BOUNDARIES
from ._history import FORMAT_VERSION as FORMAT_VERSION
from ._history import FORMAT_VERSIONS as FORMAT_VERSIONS
from ._history import FP8_DTYPES as FP8_DTYPES
from ._history import KV_DTYPES as KV_DTYPES
from ._history import KV_LAYOUTS as KV_LAYOUTS
from ._history import KV_SCALES as KV_SCALES
from ._history import MAX_LINE_BYTES as MAX_LINE_BYTES
from ._history import POLICIES as POLICIES
from ._history import ROLES as ROLES
from ._history import HistoryHeader as HistoryHeader
from ._history import HistoryReader as HistoryReader
from ._history import HistoryWriter as HistoryWriter
from ._history import KVSpec as KVSpec
from ._history import WorkerSpec as WorkerSpec
from ._history import open_history as open_history
from ._history import read_events as read_events
from ._history import write_history as write_history
from ._monitor import END_INVARIANTS as END_INVARIANTS
from ._monitor import INVARIANT_NEEDS as INVARIANT_NEEDS
from ._monitor import INVARIANTS as INVARIANTS
from ._monitor import Monitor as Monitor
from ._monitor import Violation as Violation
from ._monitor import check_invariant_ids as check_invariant_ids
from ._monitor import not_judged as not_judged
from ._observed import Observation as Observation
from ._partial import PartialMonitor as PartialMonitor

__all__ = [
    "parse_event",
    "MAX_LINE_BYTES",
    "Event",
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
    "FEATURES",
    "FEATURE_KINDS",
    "FEATURE_FIELDS",
    "EVENT_TYPES",
    "OMITTABLE",
    "event_from_dict",
    "Observation",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "KV_DTYPES",
    "FP8_DTYPES",
    "KV_SCALES",
    "KV_LAYOUTS",
    "KVSpec",
    "POLICIES",
    "ROLES",
    "BOUNDARIES",
    "WorkerSpec",
    "HistoryHeader",
    "HistoryReader",
    "HistoryWriter",
    "open_history",
    "read_events",
    "write_history",
    "INVARIANTS",
    "END_INVARIANTS",
    "Violation",
    "Monitor",
    "check_invariant_ids",
    "INVARIANT_NEEDS",
    "not_judged",
    "PartialMonitor",
]
