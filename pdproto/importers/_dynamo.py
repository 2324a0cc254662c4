"""The Dynamo importer: the KV router's request bookkeeping lines -> a partial history.

Formats read from Dynamo's source (:data:`SOURCE`): the KV-aware router
(``lib/llm/src/kv_router.rs`` and its push router) tracks each request it
routed, marks its prefill completed when the first token comes back and frees
it when the response stream ends, warning when either fails.  A Dynamo log
line is ``TIMESTAMP  LEVEL SPANS: TARGET: MESSAGE FIELDS`` (``tracing``'s
text format) or, with ``DYN_LOGGING_JSONL``, one JSON object; the request id
is either in the message (``for request R: E``) or a field (``request_id=R``,
``"request_id": "R"``), and both are read.

| line (level, target) | events |
|---|---|
| ``Failed to mark prefill completed for request R: E`` (WARN, ``dynamo_llm::kv_router``) | none: R's first token reached the router (its prefill is over) but the router's books did not hold R; a ``prefill_done`` needs the first token and the prompt length, which the line lacks |
| ``Failed to free request R: E`` (WARN, same) | none: the response stream of R ended (finished or cancelled: the line does not say which), and the router's books did not hold R |
| ``Request R cancelled, ending stream`` (DEBUG, same), or as current Dynamo logs it, ``Request cancelled, ending stream`` with a ``request_id`` field (DEBUG, ``kv_router::push_router``) | ``cancel`` (R) |

The router's books are not KV blocks on a worker, so "Failed to free request"
is no ``free``: both router warnings are counted (``recognised``, and the
import summary) and write no event; at DEBUG level the router's cancels are
the events.  A Dynamo log at INFO level thus gives an empty history (every
invariant not judged) and the count of the router's book-keeping misses.  The workers' own lines come from the engine inside each
worker (vLLM, SGLang): import those with their importer.
"""

from __future__ import annotations

import re
from typing import ClassVar

from ._base import Bounded, LogImporter, Pattern

__all__ = ["DynamoImporter", "SOURCE"]

#: The Dynamo source whose log formats this importer reads.
SOURCE = "Dynamo 0.7.x (lib/llm/src/kv_router.rs as of December 2025; the later request_id= field form too)"

#: the request id after the message: ``for request R:`` / ``request R:`` in the
#: message, or a ``request_id`` field (text or JSON)
_ID = r"(?:\s(?P<id>[^\s:=\"']+):|.*?request_id[\"']?\s*[=:]\s*[\"']?(?P<fid>[^\s\"',}]+))?"
#: a ``request_id`` field anywhere in a line (text ``request_id=R`` /
#: ``request_id="R"``, JSON ``"request_id": "R"``)
_FIELD = re.compile(r"\brequest_id[\"']?\s*[=:]\s*[\"']?(?P<fid>[^\s\"',}]+)")


class DynamoImporter(LogImporter):
    ENGINE = "dynamo"
    SOURCE = SOURCE
    POLICY = "push"
    KEYWORDS = ("request", "Request")
    KINDS = ()
    DEBUG_KINDS = ("cancel",)
    RECORDS = {"cancel": ("request", "reason")}
    DEBUG_MARKS = (" DEBUG ", '"level":"DEBUG"', '"level": "DEBUG"')
    HANDOFF: ClassVar[tuple[re.Pattern[str], ...]] = (
        re.compile(r"(?i)\brequest(?:_id)?\b"),
        re.compile(r"(?i)\b(?:prefill|kv|free|transfer)\w*"),
    )
    PATTERNS = (
        Pattern(
            "mark_prefill_failed",
            "Failed to mark prefill completed",
            re.compile(r"Failed to mark prefill completed(?: for request)?" + _ID),
            "known",
            "WARN",
        ),
        Pattern(
            "free_failed",
            "Failed to free request",
            re.compile(r"Failed to free request" + _ID),
            "known",
            "WARN",
        ),
        Pattern(
            "cancelled",
            "cancelled, ending stream",
            re.compile(r"Request(?: (?P<id>[^\s\"']+))? cancelled, ending stream"),
            "_cancelled",
            "DEBUG",
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._once = Bounded()

    def _cancelled(self, match: re.Match[str]) -> list | None:
        request = match.group("id")
        if request is None:  # the request_id field, before or after the message
            field = _FIELD.search(match.string)
            if field is None:
                return None  # a cancel that names no request: warned
            request = field.group("fid")
        if not self._once.add(("cancel", request)):
            return []
        return [{"ev": "cancel", "request": request, "reason": "abort"}]
