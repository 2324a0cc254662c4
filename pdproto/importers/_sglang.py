"""The SGLang importer: PD disaggregation failure lines -> a partial history.

Formats read from SGLang's source (:data:`SOURCE`): the scheduler's prefill
and decode queues (``python/sglang/srt/disaggregation/prefill.py`` and
``decode.py``) log one line per TP rank when a request's KV handoff fails,
then abort the request (``prepare_abort``, HTTP 500).  An SGLang log line is
``[YYYY-MM-DD HH:MM:SS PREFIX] MESSAGE`` with PREFIX the ranks (``TP0``,
``DP6 TP6 EP6``) and no level; only the message is matched.

| line (level, file) | events |
|---|---|
| ``Prefill transfer failed for request rank=N req.rid='R' req.bootstrap_room=B with exception E`` (WARNING, ``prefill.py``) | ``transfer_failed`` (R, ticket B) and R's end; only ``cancel`` when E is ``Aborted by AbortReq`` |
| ``Decode transfer failed for request rank=N decode_req.req.rid='R' decode_req.req.bootstrap_room=B with exception E`` (ERROR, ``decode.py``) | same |
| ``Prefill bootstrap failed for request rank=N ...`` (WARNING, ``prefill.py``), ``Decode handshake failed for request rank=N ...`` (ERROR, ``decode.py``) | R's end (no transfer started) |

R's end is ``cancel`` (reason ``abort``) when E says ``Aborted by AbortReq``:
the client aborted the request, and SGLang reports the abort through the same
failure path (``req.to_abort`` set), so no transfer failed and only the
``cancel`` is written; else it is ``fail`` (reason: the failure, ``timeout`` when E
says it timed out).  Both spellings of the ids are read: ``req.rid='R'
req.bootstrap_room=B`` (0.5.x) and ``rid=R bootstrap_room=B`` (the newer
handshake line).  Each rank logs the same line: one transfer failure per
(request, room) and one end per request are written.  The bootstrap room is
SGLang's handoff id, kept as the event's ``ticket`` key.
"""

from __future__ import annotations

import re
from typing import ClassVar

from ._base import Bounded, LogImporter, Pattern

__all__ = ["SglangImporter", "SOURCE"]

#: The SGLang source whose log formats this importer reads.
SOURCE = "SGLang 0.5.x (python/sglang/srt/disaggregation/prefill.py, decode.py)"

_IDS = r"rank=(\d+) \S*?rid='?([^'\s:]+)'? \S*?bootstrap_room='?(\w+)'?:?(.*)$"


#: what the exception of a request the client aborted says
_ABORTED = "Aborted by AbortReq"


def _end(request: str, rest: str, what: str) -> dict:
    if _ABORTED in rest:
        return {"ev": "cancel", "request": request, "reason": "abort"}
    reason = "timeout" if "timed out" in rest else what
    return {"ev": "fail", "request": request, "reason": reason}


class SglangImporter(LogImporter):
    ENGINE = "sglang"
    SOURCE = SOURCE
    POLICY = "push"
    KEYWORDS = ("failed for request", "KV", "bootstrap")
    KINDS = ("cancel", "fail", "transfer_failed")
    #: the fields each kind records: the request, no generation (SGLang has
    #: none: a retry is a new rid), no transfer id
    RECORDS = {
        "transfer_failed": ("request",),
        "cancel": ("request", "reason"),
        "fail": ("request", "reason"),
    }
    DEBUG_MARKS = ()  # SGLang lines carry no level
    HANDOFF: ClassVar[tuple[re.Pattern[str], ...]] = (
        re.compile(r"\b(?:rid|bootstrap_room)=|\brequest\b"),
        re.compile(r"(?i)\b(?:kv|transfer|bootstrap|handshake|rid|bootstrap_room)\b"),
    )
    PATTERNS = (
        Pattern(
            "prefill_transfer_failed",
            "Prefill transfer failed for request",
            re.compile(r"Prefill transfer failed for request " + _IDS),
            "_transfer",
            "WARNING",
        ),
        Pattern(
            "decode_transfer_failed",
            "Decode transfer failed for request",
            re.compile(r"Decode transfer failed for request " + _IDS),
            "_transfer",
            "ERROR",
        ),
        Pattern(
            "prefill_bootstrap_failed",
            "Prefill bootstrap failed for request",
            re.compile(r"Prefill bootstrap failed for request " + _IDS),
            "_bootstrap",
            "WARNING",
        ),
        Pattern(
            "decode_handshake_failed",
            "Decode handshake failed for request",
            re.compile(r"Decode handshake failed for request " + _IDS),
            "_bootstrap",
            "ERROR",
        ),
        Pattern(
            "transfer_timeout_notice",
            "fail to receive KV Cache transfer done signal",
            re.compile(r"Some requests fail to receive KV Cache transfer done signal"),
            "known",
            "WARNING",
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._failed = Bounded()  # (request, room) whose transfer failure is written
        self._ended = Bounded()  # requests whose end is written

    def _ending(self, request: str, rest: str, what: str) -> list:
        return [_end(request, rest, what)] if self._ended.add(request) else []

    def _transfer(self, match: re.Match[str]) -> list:
        rank, request, room, rest = match.groups()
        out = []
        if _ABORTED in rest:  # the client's abort, reported on the failure path: no transfer failed
            return self._ending(request, rest, "abort")
        if self._failed.add((request, room)):
            out.append({"ev": "transfer_failed", "request": request, "ticket": room, "rank": int(rank)})
        return out + self._ending(request, rest, "transfer failed")

    def _bootstrap(self, match: re.Match[str]) -> list:
        _, request, room, rest = match.groups()
        return self._ending(request, rest, "bootstrap failed")
