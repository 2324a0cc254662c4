"""The vLLM importer: the NIXL connector's handoff lines -> a partial history.

Formats read from vLLM 0.32.0's own source (:data:`SOURCE`), the version the
vLLM adapter targets; the older wording of 0.10 and 0.11 (one file,
``nixl_connector.py``, a timeout instead of a lease) is recognised too, since
public reports quote it.  A vLLM log line is
``(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [FILE:LINE] MESSAGE`` (``vllm/logger.py``);
only the message is matched, so older prefixes, colours and shrunk paths read
the same.

| line (level, file) | side | events |
|---|---|---|
| ``NIXLConnector request_finished(R), request_status=S, kv_transfer_params=P`` (DEBUG, ``nixl/pull_scheduler.py``) | P (``do_remote_decode`` in P) | S finished: none (P's part is over, its blocks held for D under a lease); S aborted or errored: ``cancel`` / ``fail`` and ``free`` (R on P0, freed at once) |
| same | D | ``remote_request_id`` in P names R on P (R's events, earlier ones too, are written under it); S stopped or length: ``finish`` and ``free`` (R on D0); aborted / errored: ``cancel`` / ``fail``, and ``free`` when R's KV had arrived (else vLLM holds the blocks until the READ ends, vllm#32255: see ``Finished recving``) |
| ``Finished sending KV transfer for request R`` (DEBUG, ``v1/core/sched/scheduler.py``) | P | ``transfer_read_done`` (D said it read, or that it never will) and ``free`` (R on P0); nothing after a lease expiry of R (already freed) |
| ``Finished recving KV transfer for request R`` (DEBUG, same) | D | ``transfer_write_done`` (R's READ landed in D), none after a transfer failure of R (vLLM reports a failed READ as finished too); and ``free`` (R on D0) when R was already cancelled |
| ``Releasing expired KV blocks for request R which were retrieved by N remote worker(s) before lease expired.`` (WARNING, ``nixl/base_worker.py``) | P | ``free`` (R on P0): the lease ran out, the source blocks go back |
| ``Potentially invalid KV blocks for unrecognized request R were retrieved by a decode worker. They may have expired.`` (ERROR, ``nixl/pull_worker.py``) | P | ``transfer_read_done`` (R): a READ of R's source ended now |
| ``NIXL transfer failure: TYPE | Context: {...'request_id': 'R'...}`` (ERROR, ``nixl/base_worker.py``) | D | TYPE ``transfer_failed``, ``transfer_exception``, ``transfer_setup_failed``, ``handshake_failed``: ``transfer_failed`` (R; under its P name when the context has ``remote_request_id``); ``notification_failed``, ``transfer_release_failed``, ``handshake_setup_failed``: none; any other type, or no request: warned |

Known lines that mean no event: ``request_finished(R) waiting for N seconds``,
``get_num_new_matched_tokens``, ``update_state_after_alloc``, heartbeats,
``get_finished`` counts.  P and D name a request differently (vLLM adds
a random suffix per instance): D's events are written under P's name, which
D's ``remote_request_id`` gives.  The kinds declared observed are those of the
sides whose lines the log holds (:meth:`VllmImporter.observed`); with both,
a request seen on one side only is left out (:meth:`VllmImporter.left_out`).  Worker-side lines come once per TP
rank; the importer writes one event per request for them.
"""

from __future__ import annotations

import collections
import re
from typing import Any, ClassVar

from ._base import MAX_TRACKED, Bounded, LogImporter, Pattern

__all__ = ["VllmImporter", "SOURCE"]

#: The vLLM source whose log formats this importer reads.
SOURCE = "vLLM 0.32.0 (NIXL connector: vllm/distributed/kv_transfer/kv_connector/v1/nixl/, v1/core/sched/scheduler.py)"

P, D = "P0", "D0"

_FINISHED = {
    "FINISHED_STOPPED": ("finish", "stop"),
    "FINISHED_LENGTH_CAPPED": ("finish", "length"),
    "FINISHED_ABORTED": ("cancel", "abort"),
    "FINISHED_ERROR": ("fail", "error"),
    "FINISHED_IGNORED": ("fail", "ignored"),
    "FINISHED_REPETITION": ("finish", "repetition"),
}
#: NIXL failure types after which no byte of that request's READ can still move
#: (``nixl/base_worker.py``, ``pull_worker.py``: ``_log_failure``).
_FAILED_TYPES = frozenset(
    {"transfer_failed", "transfer_exception", "transfer_setup_failed", "handshake_failed"}
)
#: NIXL failure types that mean no event: a notification to P that could not be
#: sent (P frees at its lease's end, logged then), a handle whose release failed
#: (the READ's end is logged when it finally finishes), a handshake with an
#: engine that failed (no request: each waiting request gets its own
#: ``handshake_failed`` line).  Any other type is warned about, never guessed at.
_NO_EVENT_TYPES = frozenset({"notification_failed", "transfer_release_failed", "handshake_setup_failed"})
_REQUEST_ID = re.compile(r"""['"]request_id['"]:\s*(?:'([^']*)'|"([^"]*)"|None)""")
_REMOTE_REQUEST_ID = re.compile(r"""['"]remote_request_id['"]:\s*(?:'([^']*)'|"([^"]*)")""")


def _id(pattern: re.Pattern[str], text: str) -> str | None:
    found = pattern.search(text)
    return (found.group(1) or found.group(2)) if found else None


def _status(text: str) -> str:
    # 0.32 prints the name (RequestStatus.__str__); older versions RequestStatus.NAME
    return text.rstrip(",").rsplit(".", 1)[-1]


class VllmImporter(LogImporter):
    ENGINE = "vllm"
    SOURCE = SOURCE
    POLICY = "pull"
    KEYWORDS = ("KV", "NIXL")
    KINDS = ("free", "transfer_failed", "transfer_read_done")
    DEBUG_KINDS = ("cancel", "fail", "finish", "transfer_write_done")
    #: the fields each kind records: no block ids (vLLM logs none), no
    #: generation (vLLM has none: a retry is a new request id), no transfer id
    #: (the NIXL connector keys transfers by request)
    RECORDS = {
        "free": ("worker", "request"),
        "transfer_read_done": ("request", "src"),
        "transfer_write_done": ("request", "dst"),
        "transfer_failed": ("request", "dst"),
        "finish": ("request", "reason"),
        "cancel": ("request", "reason"),
        "fail": ("request", "reason"),
    }
    HANDOFF: ClassVar[tuple[re.Pattern[str], ...]] = (
        re.compile(r"\brequest\b|\breq(?:uest)?_id\b"),
        re.compile(r"(?i)\b(?:kv|nixl|transfer|blocks?|lease)\b"),
    )
    # the most frequent first: a line is tried against each anchor in turn
    PATTERNS = (
        Pattern(
            "get_num_new_matched_tokens",
            "get_num_new_matched_tokens",
            re.compile(r"get_num_new_matched_tokens: num_computed_tokens="),
            "known",
            "DEBUG",
        ),
        Pattern(
            "update_state_after_alloc",
            "update_state_after_alloc",
            re.compile(r"update_state_after_alloc: num_external_tokens="),
            "known",
            "DEBUG",
        ),
        Pattern(
            "request_finished",
            "request_finished(",
            re.compile(r"request_finished\((.+?)\), request_status=(\S+), kv_transfer_params=(.*)$"),
            "_request_finished",
            "DEBUG",
        ),
        Pattern(
            "request_finished_waiting",
            "request_finished(",
            re.compile(r"request_finished\((.+?)\) waiting for \d+ seconds"),
            "known",
            "DEBUG",
        ),
        Pattern(
            "finished_recving",
            "Finished recving KV transfer",
            re.compile(r'Finished recving KV transfer for request ([^\s"]+)'),
            "_finished_recving",
            "DEBUG",
        ),
        Pattern(
            "finished_sending",
            "Finished sending KV transfer",
            re.compile(r'Finished sending KV transfer for request ([^\s"]+)'),
            "_finished_sending",
            "DEBUG",
        ),
        Pattern(
            "lease_expired",
            "Releasing expired KV blocks",
            re.compile(
                r'Releasing expired KV blocks for request ([^\s"]+) which were retrieved by (\d+) '
                r"(?:remote|decode) worker\(s\)"
            ),
            "_lease_expired",
            "WARNING",
        ),
        Pattern(
            "read_after_expiry",
            "Potentially invalid KV blocks",
            re.compile(r'Potentially invalid KV blocks for unrecognized request ([^\s"]+) were retrieved'),
            "_late_read",
            "ERROR",
        ),
        Pattern(
            "transfer_failure",
            "NIXL transfer failure",
            re.compile(r"NIXL transfer failure: ([A-Za-z_]+)\S*.*? \| Context: (.*)$"),
            "_failure",
            "ERROR",
        ),
        Pattern(
            "heartbeat",
            "Heartbeat extended lease",
            re.compile(r"Heartbeat extended lease for request \S+"),
            "known",
            "DEBUG",
        ),
        Pattern(
            "get_finished",
            "get_finished:",
            re.compile(r"get_finished: \d+ requests done sending"),
            "known",
            "DEBUG",
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._expired = Bounded()  # P requests whose lease ran out: their free is written
        self._cancelled = Bounded()  # D requests ended while loading: a late finished_recving frees them
        self._received = Bounded()  # D requests whose KV arrived and that have not ended
        self._failed = Bounded()  # D requests whose READ failed: their finished_recving wrote nothing
        self._once = Bounded()  # (line kind, request) of worker-side lines: one per TP rank
        #: D id -> P id of the D requests whose name on P is known (the
        #: oldest forgotten beyond MAX_TRACKED: a D request's lines after its
        #: link are those of its own end)
        self._name: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._unnamed: set[str] = set()  # D requests with events written, their name on P not yet known
        # Pairing, when the log holds both sides: a request the history names
        # must have its events of both sides in it (an observed kind is
        # complete), so a request seen on one side only is left out.
        self._p_open: set[str] = set()  # P requests seen on P, no D request linked to them yet
        self._d_only: set[str] = set()  # P names of D requests, not (yet) seen on P
        self._paired = Bounded()  # P names seen on both sides
        self.p_side = False  # lines only a prefill instance logs were read
        self.d_side = False  # lines only a decode instance logs were read

    def observed(self, debug: bool | None = None) -> tuple[str, ...]:
        """The kinds of which this log shows every event for the requests
        it names: P's kinds when P's lines are in it, D's when D's are (with
        both, the requests seen on one side only are left out: see
        :meth:`left_out`)."""
        debug = self.debug if debug is None else debug
        kinds: set[str] = set()
        if self.p_side:
            kinds |= {"free", "transfer_read_done"}
            if debug:
                kinds |= {"cancel", "fail"}
        if self.d_side:
            kinds.add("transfer_failed")
            if debug:
                kinds |= {"cancel", "fail", "finish", "free", "transfer_write_done"}
        return tuple(sorted(kinds))

    def left_out(self) -> frozenset[str]:
        """With both sides in the log, the requests seen on one side only
        (the log's excerpt cut them, or their other side ran on an instance
        whose log is not in it): their events of the other side's kinds are
        not in the log, so none of their events is written."""
        if not (self.p_side and self.d_side):
            return frozenset()
        if not self.debug:
            # at INFO the sides pair only through a failure's context, which
            # names the P request whenever vLLM knows it: a P request without
            # one had no failure (D's only kind at INFO), and is kept
            return frozenset(self._unnamed)
        return frozenset(self._p_open | self._d_only | self._unnamed)

    def _p(self, request: str) -> str:
        """``request`` was seen on P."""
        self.p_side = True
        if request in self._d_only:
            self._d_only.discard(request)
            self._paired.add(request)
        elif request not in self._paired:
            self._p_open.add(request)
        return request

    def _link(self, d_request: str, p_request: str) -> None:
        """D's ``d_request`` is ``p_request`` on P: its events are written
        under P's name (those already written are renamed at the end)."""
        if d_request in self._unnamed:
            self._unnamed.discard(d_request)
            if d_request != p_request:
                self.renames[d_request] = p_request
        if d_request != p_request and d_request not in self._name:
            self._name[d_request] = p_request
            if len(self._name) > MAX_TRACKED:
                self._name.popitem(last=False)
        if p_request in self._p_open:
            self._p_open.discard(p_request)
            self._paired.add(p_request)
        elif p_request not in self._paired:
            self._d_only.add(p_request)

    def _d(self, d_request: str) -> str:
        """The name to write for D's ``d_request``: its name on P when known."""
        self.d_side = True
        name = self._name.get(d_request)
        if name is None:
            self._unnamed.add(d_request)
            return d_request
        return name

    def _request_finished(self, match: re.Match[str]) -> list | None:
        request, status, params = match.group(1), _status(match.group(2)), match.group(3)
        if params.strip() in ("None", "{}", ""):
            return []  # not a P/D request
        p_side = "'do_remote_decode': True" in params or '"do_remote_decode": true' in params
        if status not in _FINISHED:
            return None  # a status this importer does not know (a number, a new name): warned
        kind, reason = _FINISHED[status]
        if p_side:
            self._p(request)
            if kind == "finish":
                return []  # P's part is over; its blocks are held for D's READ (a lease)
            return [
                {"ev": kind, "request": request, "reason": reason},
                {"ev": "free", "worker": P, "request": request},
            ]
        # D's params name the request on P (remote_request_id: each instance
        # suffixes the id); without it (older vLLM) both sides share the id
        self._link(request, _id(_REMOTE_REQUEST_ID, params) or request)
        d_request = request
        request = self._d(d_request)
        ended = {"ev": kind, "request": request, "reason": reason}
        if kind == "finish" or self._received.discard(d_request):
            # decoding (its KV arrived): the blocks go back now
            return [ended, {"ev": "free", "worker": D, "request": request}]
        # still waiting for its KV (or never loading it): vLLM holds the
        # blocks until the READ ends (vllm#32255), see finished_recving
        self._cancelled.add(d_request)
        return [ended]

    def _finished_sending(self, match: re.Match[str]) -> list:
        request = self._p(match.group(1))
        if self._expired.discard(request):
            return []  # the expiry's free, written at the expiry line
        return [
            {"ev": "transfer_read_done", "request": request, "src": P},
            {"ev": "free", "worker": P, "request": request},
        ]

    def _finished_recving(self, match: re.Match[str]) -> list:
        d_request = match.group(1)
        request = self._d(d_request)
        # a failed READ is reported as finished too (with its blocks invalid):
        # its failure line came first, and nothing was written
        failed = self._failed.discard(d_request)
        out: list[dict[str, Any]] = (
            [] if failed else [{"ev": "transfer_write_done", "request": request, "dst": D}]
        )
        if self._cancelled.discard(d_request):
            out.append({"ev": "free", "worker": D, "request": request})
        else:
            self._received.add(d_request)
        if not out and request == d_request:
            self._unnamed.discard(d_request)  # nothing written under this name
        return out

    def _lease_expired(self, match: re.Match[str]) -> list:
        request = self._p(match.group(1))
        if not self._once.add(("expired", request)):
            return []
        self._expired.add(request)
        return [
            {
                "ev": "free",
                "worker": P,
                "request": request,
                "reason": "lease expired",
                "retrieved_by": int(match.group(2)),
            }
        ]

    def _late_read(self, match: re.Match[str]) -> list:
        request = self._p(match.group(1))
        if not self._once.add(("late_read", request)):
            return []
        return [
            {
                "ev": "transfer_read_done",
                "request": request,
                "src": P,
                "reason": "read by a decode worker after P released it",
            }
        ]

    def _failure(self, match: re.Match[str]) -> list | None:
        failure, context = match.group(1), match.group(2)
        if failure in _NO_EVENT_TYPES:
            return []
        if failure not in _FAILED_TYPES:
            return None  # a failure type this importer does not know: warned
        d_request = _id(_REQUEST_ID, context)
        if not d_request:
            return None  # a failure that names no request: warned
        if not self._once.add(("failed", d_request)):
            return []
        remote = _id(_REMOTE_REQUEST_ID, context)
        if remote:
            self._link(d_request, remote)
        self._failed.add(d_request)
        return [{"ev": "transfer_failed", "request": self._d(d_request), "dst": D, "reason": failure}]
