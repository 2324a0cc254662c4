"""Importers: turn a real engine's own log lines into a (partial) history.

``import_log("vllm", "prefill.log", "out.jsonl")`` reads a vLLM, SGLang or
Dynamo log and writes a history whose header declares which event kinds the
log could show; see docs/importers.md.  This layer sits on
:mod:`pdproto.spec` alone.
"""

from ._base import LOG_LINE_KEY as LOG_LINE_KEY
from ._base import MAX_LOG_LINE as MAX_LOG_LINE
from ._base import Bounded as Bounded
from ._base import ImportResult as ImportResult
from ._base import LogImporter as LogImporter
from ._base import Unrecognised as Unrecognised
from ._base import run_import as run_import
from ._import import ENGINES as ENGINES
from ._import import import_log as import_log
from ._vllm import VllmImporter as VllmImporter

__all__ = [
    "Bounded",
    "LogImporter",
    "MAX_LOG_LINE",
    "run_import",
    "VllmImporter",
    "ENGINES",
    "LOG_LINE_KEY",
    "ImportResult",
    "Unrecognised",
    "import_log",
]
