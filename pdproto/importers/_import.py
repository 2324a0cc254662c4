"""The importer of each engine, by name, and :func:`import_log`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO

from .._errors import UsageError
from ._base import ImportResult, LogImporter, run_import
from ._dynamo import DynamoImporter
from ._sglang import SglangImporter
from ._vllm import VllmImporter

__all__ = ["ENGINES", "import_log"]

#: The engines whose logs can be imported: name -> the source version read.
_IMPORTERS: Mapping[str, type[LogImporter]] = {
    "vllm": VllmImporter,
    "sglang": SglangImporter,
    "dynamo": DynamoImporter,
}
ENGINES: Mapping[str, str] = {name: cls.SOURCE for name, cls in _IMPORTERS.items()}


def import_log(engine: str, log: str, out: str | IO[str] | None = None) -> ImportResult:
    """Import the ``engine`` log at ``log`` ('-': standard input) as a partial
    history written to ``out`` (a path, replaced only once complete; an open
    text stream; None: standard output).  Raises :class:`UsageError` for an
    unknown engine or an unreadable log."""
    cls = _IMPORTERS.get(engine)
    if cls is None:
        raise UsageError("ENGINE", engine, f"one of {', '.join(_IMPORTERS)}")
    return run_import(cls(), log, out)
