"""A recording KV connector for real vLLM deployments (docs/adapters/vllm-recording.md).

:class:`RecordingConnector` is a vLLM v1 KV connector that wraps the NIXL
connector (pull family): it builds the NIXL connector inside, forwards every
method and property to it unchanged, and on the scheduler side writes a
pdproto history (JSON Lines) of what its hooks see.  Deploy it with::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
      "kv_connector_module_path": "pdproto.adapters.vllm.recording",
      "kv_role": "kv_producer",
      "kv_connector_extra_config": {"pdproto_history": "/var/log/pd/{role}-{engine_id}.jsonl"}}'

(``NixlConnector`` here is this module's recording class of that name, so
vLLM's configuration checks that look for the NIXL connector by name still
apply; ``RecordingConnector`` is the same class.)

What it records, and from which hook (observe, never invent: every event is
a real block table change in the scheduler's block pool, a real request
status, or a real connector metadata entry):

==================================  ===========================================
hook                                 events
==================================  ===========================================
``on_new_request`` (P)               ``submit``
``update_state_after_alloc`` (P)     ``share`` (a local prefix hit), ``prefill_start``
``update_state_after_alloc`` (D)     ``share`` (a local prefix hit), ``reserve``
                                     (only for a remote prefill with KV to load)
``build_connector_meta`` (D)         ``transfer_start`` (an entry of ``reqs_to_recv``
                                     with blocks), ``commit`` (the request scheduled
                                     after its receive), the position of each step
``request_finished`` (P)             ``prefill_done`` (stopped / length), ``cancel``
                                     (aborted), ``fail`` (other endings)
``request_finished`` (D)             the last ``decode``, ``finish`` / ``cancel`` / ``fail``
``update_connector_output`` (D)      ``transfer_read_done`` + ``transfer_write_done``
                                     (``finished_recving``), ``transfer_failed``
                                     (``failed_recving`` or ``invalid_block_ids``)
``update_connector_output`` (P)      ``transfer_read_done`` with ``"if_started": true``
                                     (``finished_sending`` before the lease deadline:
                                     D's notification that it no longer reads)
every hook, ``take_events``,         ``free`` / ``alloc``: each request's real block
``shutdown``                         table (KV cache group 0) against what was
                                     recorded; ``decode`` once its token is sampled
==================================  ===========================================

Each event carries ``"t"``, the wall-clock time in ms.

What a hook-level recorder cannot see (docs/adapters/vllm-recording.md says
more):

- It writes one file per engine; the pair is judged on their merge
  (:func:`merge_histories`, ordered by ``"t"``: across hosts only as good as
  the clocks).  Audit the merge, not a file alone.
- The data plane: a read's end is known to D's scheduler one step after the
  worker saw it, and to P through D's notification (``finished_sending``
  before the lease deadline).  P cannot tell a notification from an expired
  lease after the deadline (the heartbeats renew it in the workers): a read
  that ends within a step of the deadline is then reported as
  ``early-source-free`` though it finished first (a known false alarm).
- A free is seen at the engine's next hook (``take_events`` closes every
  step); an abort's free at the next step or at shutdown.
- An engine's death: its file just stops.  A second file of the same engine
  id is taken as a restart; the generations that died with the engine get no
  ending, so a complete merge reports them ``stuck``.
- After a failed receive vLLM may recompute the prompt on D: no commit and no
  decode are recorded for that generation (its ending and frees are).
- Only KV cache group 0 (the full-attention group) is recorded.
- Each file says ``"complete": false``; :func:`merge_histories` sets it only
  when asked (a drained run).
- The push family pairs blocks in the workers, out of the scheduler's sight:
  it is refused (``pdproto_inner`` must name a pull NIXL connector).
"""

from __future__ import annotations

import heapq
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ._support import require_vllm

require_vllm()  # one clear error outside the supported vLLM versions

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlPullConnector as _NixlPull,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlPushConnector as _NixlPush,
)

from ..._errors import HistoryFormatError, UsageError  # noqa: E402
from ...spec import (  # noqa: E402  # noqa: E402
    Alloc,
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    Free,
    HistoryHeader,
    HistoryWriter,
    KVSpec,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Share,
    Submit,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
    open_history,
)

__all__ = [
    "RecordingConnector",
    "NixlConnector",
    "NixlPullConnector",
    "merge_histories",
    "RECORDER_VERSION",
]

#: written into each header (``"vllm": {"recorder": ...}``)
RECORDER_VERSION = 1

#: the clock of the ``"t"`` field, in nanoseconds (tests of one process replace
#: it with a shared counter, so that the merge order is exact)
clock = time.time_ns

#: the extra-config keys this connector reads
EXTRA_HISTORY = "pdproto_history"
EXTRA_INNER = "pdproto_inner"
#: the environment variable read when the extra config names no history path
ENV_HISTORY = "PDPROTO_HISTORY"
#: which decode steps to record (extra key ``pdproto_decodes``, else this
#: environment variable): ``all`` (default), ``first`` (the first-token
#: boundary only: one event per handoff instead of one per token), ``none``
EXTRA_DECODES = "pdproto_decodes"
ENV_DECODES = "PDPROTO_DECODES"
DECODES = ("all", "first", "none")

#: the extra key of a ``transfer_read_done`` that P records from D's
#: notification: it names the transfer from P's blocks if D started one;
#: :func:`merge_histories` drops it when none started (a notification only)
IF_STARTED = "if_started"

_PULL = {"NixlConnector": _NixlPull, "NixlPullConnector": _NixlPull}


def transfer_id(p_request_id: str) -> str:
    """The id of the transfer that reads the KV of P's request (pull: one
    per P request), known on both sides: D reads it from
    ``remote_request_id``."""
    return f"x-{p_request_id}"


def _nixl_now() -> float | None:
    """Now on the clock of NIXL's lease deadlines (its scheduler module's
    ``time.perf_counter``, which a test harness may replace)."""
    module = sys.modules.get(_NixlPull.__module__.rpartition(".")[0] + ".base_scheduler")
    clock_module = getattr(module, "time", None)
    return clock_module.perf_counter() if clock_module is not None else None


_PUSH = {"NixlPushConnector": _NixlPush}

_FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def _status(request: Any) -> str:
    return getattr(request.status, "name", str(request.status))


class _Gen:
    """What the recorder knows of one local request of a P/D handoff."""

    __slots__ = (
        "request",
        "key",
        "side",
        "table",
        "ticket",
        "transfer",
        "xfer",
        "invalid",
        "committed",
        "pending",
        "ended",
        "hit",
        "allocated",
        "deadline",
        "raw",
        "raw_len",
        "steps",
    )

    def __init__(self, request: Any, key: str, side: str) -> None:
        self.request = request
        self.key = key  # pdproto request id: P's request id (D: remote_request_id)
        self.side = side  # "prefill" or "decode"
        self.table: list[int] = []  # the block table as recorded (group 0)
        self.ticket: str | None = None
        self.transfer: str | None = None
        self.xfer = "none"  # none, started, done, failed
        self.invalid: set[int] = set()
        self.committed = False
        self.pending: list[int] = []  # positions of decode steps whose token is not yet sampled
        self.ended = False  # finish / cancel / fail recorded
        self.hit = 0  # local prefix hit (tokens) the scheduler offered the connector
        self.allocated = False  # prefill_start / reserve recorded
        self.deadline: float | None = None  # P: the lease deadline NIXL set at request_finished
        self.raw: Any = None  # the real pool's block list last seen, and its length
        self.raw_len = 0
        self.steps = 0  # D: steps scheduled after the commit


class _Recorder:
    """The scheduler side's history: one file, the header first, flushed per event."""

    def __init__(
        self, path: str, header: HistoryHeader, worker: str, block_size: int, decodes: str = "all"
    ) -> None:
        self.decodes = decodes
        self.path = _claim(path)
        self._fh = open(self.path, "x", encoding="utf-8")
        self._writer = HistoryWriter(self._fh, header)
        self._fh.flush()
        self.worker = worker
        self.block_size = block_size
        self.gens: dict[str, _Gen] = {}  # local request id -> generation
        self.manager: Any = None  # the scheduler's KVCacheManager (bind_kv_cache_manager)

    # -- writing -------------------------------------------------------------
    def emit(self, cls: type[Event], *, if_started: bool = False, **fields: Any) -> None:
        extra: dict[str, Any] = {"t": round(clock() / 1e6, 3)}
        if if_started:
            extra[IF_STARTED] = True
        if self._fh.closed:
            return  # after shutdown: nothing more to say
        event = cls(**fields, extra=extra)
        self._writer.write(event)
        self._fh.flush()

    @property
    def closed(self) -> bool:
        return self._fh.closed

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    # -- observing the block pool -------------------------------------------
    def _blocks(self, req_id: str) -> Any:
        """The real pool's block list of ``req_id`` (KV cache group 0), or None."""
        if self.manager is None:
            return None
        return self.manager.coordinator.single_type_managers[0].req_to_blocks.get(req_id)

    def real_table(self, req_id: str) -> list[int]:
        blocks = self._blocks(req_id) or ()
        return [b.block_id for b in blocks if not getattr(b, "is_null", False)]

    def sync(self) -> None:
        """Record what changed in the real block tables since the last hook:
        frees first (a block freed and handed out again within one step is
        freed before it is taken), then allocations; then the decode steps
        whose token has been sampled since."""
        changes = []
        for req_id, g in list(self.gens.items()):
            if not g.allocated:
                continue
            raw = self._blocks(req_id)
            # group 0 (full attention) only grows at its end or goes as a whole:
            # the same list at the same length is the same table
            if raw is not None and raw is g.raw and len(raw) == g.raw_len:
                continue
            g.raw, g.raw_len = raw, len(raw) if raw is not None else 0
            real = self.real_table(req_id)
            if real != g.table:
                changes.append((g, real))
        for g, real in changes:
            keep = set(real)
            gone = [b for b in g.table if b not in keep]
            if gone:
                self.emit(Free, worker=self.worker, blocks=gone, request=g.key, gen=0)
        for g, real in changes:
            had = set(g.table)
            new = [b for b in real if b not in had]
            if new:
                self.emit(Alloc, request=g.key, gen=0, worker=self.worker, blocks=new)
            g.table = real
        for req_id, g in list(self.gens.items()):
            if g.pending:
                self.flush_decodes(g)
            if g.ended and not g.table:
                del self.gens[req_id]

    def flush_decodes(self, g: _Gen) -> None:
        tokens = g.request.all_token_ids
        while g.pending and len(tokens) > g.pending[0] + 1:
            pos = g.pending.pop(0)
            self.emit(
                Decode,
                request=g.key,
                gen=0,
                worker=self.worker,
                position=pos,
                input_token=int(tokens[pos]),
                output_token=int(tokens[pos + 1]),
                blocks=g.table,
            )

    # -- hooks ---------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            g = _Gen(request, request.request_id, "prefill")
            self.gens[request.request_id] = g
            self.emit(Submit, request=g.key, gen=0, prompt_len=request.num_prompt_tokens)
        elif params.get("do_remote_prefill"):
            key = params.get("remote_request_id") or request.request_id
            self.gens[request.request_id] = _Gen(request, str(key), "decode")

    def matched(self, request: Any, num_computed_tokens: int) -> None:
        g = self.gens.get(request.request_id)
        if g is not None and not g.allocated:
            g.hit = num_computed_tokens

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, params: dict) -> None:
        g = self.gens.get(request.request_id)
        if g is None:
            return
        real = self.real_table(request.request_id)
        if g.allocated:  # a reallocation (after a preemption): not a new handoff
            return
        if g.side == "decode" and not (params.get("do_remote_prefill") and num_external_tokens > 0):
            return  # no remote KV to receive for this request: not a handoff on D
        shared = min(g.hit // self.block_size, len(real)) if self.block_size else 0
        if shared:
            self.emit(
                Share,
                request=g.key,
                gen=0,
                worker=self.worker,
                blocks=real[:shared],
                tokens=shared * self.block_size,
            )
        rest = real[shared:]
        if g.side == "prefill":
            self.emit(PrefillStart, request=g.key, gen=0, worker=self.worker, blocks=rest)
        else:
            g.ticket = f"t-{request.request_id}"
            self.emit(Reserve, request=g.key, gen=0, ticket=g.ticket, worker=self.worker, blocks=rest)
        g.table = real
        g.raw = self._blocks(request.request_id)
        g.raw_len = len(g.raw) if g.raw is not None else 0
        g.allocated = True

    def meta(self, scheduler_output: Any, meta: Any) -> None:
        for req_id, rm in (getattr(meta, "reqs_to_recv", None) or {}).items():
            g = self.gens.get(req_id)
            if g is None or g.ticket is None or g.transfer is not None or rm.remote is None:
                continue
            local = list(rm.local_block_ids[0]) if rm.local_block_ids else []
            remote = list(rm.remote.block_ids[0]) if rm.remote.block_ids else []
            if not local:
                continue  # a notification only (nothing to read)
            g.transfer = transfer_id(g.key)
            g.xfer = "started"
            self.emit(
                TransferStart,
                transfer=g.transfer,
                ticket=g.ticket,
                request=g.key,
                gen=0,
                src=str(rm.remote.engine_id),
                src_blocks=remote[-len(local) :],
                dst=self.worker,
                dst_blocks=local,
            )
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for req_id, n in scheduled.items():
            g = self.gens.get(req_id)
            if g is None or g.side != "decode" or g.xfer != "done" or g.ended or not n:
                continue
            if not g.committed:
                self.emit(Commit, request=g.key, gen=0, ticket=g.ticket, worker=self.worker)
                g.committed = True
            if self.decodes == "all" or (self.decodes == "first" and not g.steps):
                g.pending.append(g.request.num_computed_tokens + n - 1)
            g.steps += 1

    def connector_output(self, output: Any, now: float | None) -> None:
        for req_id in output.finished_sending or ():
            g = self.gens.get(req_id)
            if g is None or g.side != "prefill" or g.deadline is None or now is None:
                continue
            if now < g.deadline:
                # D's notification, not the lease: no read of these blocks is in flight
                # any more.  Said as the end of the reads of the transfer from them, if
                # D started one (merge_histories drops it otherwise: a notification only).
                self.emit(TransferReadDone, transfer=transfer_id(g.key), if_started=True)
            g.deadline = None
        invalid = set(output.invalid_block_ids or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        if invalid:
            for g in self.gens.values():
                if g.xfer == "started":
                    g.invalid |= invalid.intersection(g.table)
        for req_id in output.finished_recving or ():
            g = self.gens.get(req_id)
            if g is None or g.xfer != "started":
                continue  # a notification-only receive, or a duplicate: nothing started
            if req_id in failed or g.invalid:
                g.xfer = "failed"
                self.emit(TransferFailed, transfer=g.transfer)
            else:
                g.xfer = "done"
                self.emit(TransferReadDone, transfer=g.transfer)
                self.emit(TransferWriteDone, transfer=g.transfer)

    def finished(self, request: Any, deadline: float | None) -> None:
        g = self.gens.get(request.request_id)
        if g is None or g.ended:
            return
        status = _status(request)
        if g.side == "prefill" and status in _FINISHED:
            out = request.output_token_ids
            if out:
                self.emit(
                    PrefillDone,
                    request=g.key,
                    gen=0,
                    worker=self.worker,
                    first_token=int(out[0]),
                    processed_len=request.num_computed_tokens,
                )
            g.deadline = deadline
            g.ended = True  # the generation goes on at D
            return
        self.flush_decodes(g)
        g.pending.clear()
        reason = status.removeprefix("FINISHED_").lower()
        if status in _FINISHED:
            self.emit(Finish, request=g.key, gen=0, reason=reason)
        elif status == "FINISHED_ABORTED":
            self.emit(Cancel, request=g.key, gen=0, reason="abort")
        else:
            self.emit(Fail, request=g.key, gen=0, reason=reason)
        g.ended = True
        if not g.allocated:
            self.gens.pop(request.request_id, None)


def _claim(path: str) -> str:
    """``path``, or ``path`` with ``.1``, ``.2`` ... before its extension when
    it exists (one file per instance: a restarted engine does not overwrite
    the history of the one before)."""
    root, ext = os.path.splitext(path)
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{root}.{n}{ext}"
    return candidate


def _role_of(kv_transfer_config: Any) -> str:
    role = kv_transfer_config.kv_role
    return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "both")


def _inner_class(extra: dict, default: str) -> type:
    name = extra.get(EXTRA_INNER, default)
    if name in _PULL:
        return _PULL[name]
    if name in _PUSH:
        raise UsageError(
            f"kv_connector_extra_config.{EXTRA_INNER}",
            name,
            "a pull NIXL connector (NixlConnector, NixlPullConnector): the push family pairs "
            "blocks in the workers, which a scheduler-side recorder cannot see",
        )
    raise UsageError(f"kv_connector_extra_config.{EXTRA_INNER}", name, f"one of {', '.join(_PULL)}")


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """The NIXL connector (pull), recording a pdproto history from its
    scheduler-side hooks (module docstring).  ``kv_connector_extra_config``:

    - ``pdproto_history``: the path to write, with ``{role}`` (``prefill``,
      ``decode``, ``both``), ``{engine_id}`` and ``{pid}`` filled in (else the
      environment variable ``PDPROTO_HISTORY``); no recording without either
      (the connector is then the NIXL connector alone).
      An existing file is never overwritten (``.1``, ``.2`` ... are added).
    - ``pdproto_inner``: the connector wrapped, ``NixlConnector`` (default)
      or ``NixlPullConnector``.
    - ``pdproto_decodes``: ``all`` (default), ``first`` or ``none`` (else the
      environment variable ``PDPROTO_DECODES``): which decode steps to record.
      Each event costs tens of microseconds; ``first`` keeps the first-token
      boundary and drops the per-token events of a busy decode engine.
    """

    _default_inner = "NixlConnector"

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self._inner = _inner_class(extra, self._default_inner)(vllm_config, role, kv_cache_config)
        self._recorder: _Recorder | None = None
        template = extra.get(EXTRA_HISTORY) or os.environ.get(ENV_HISTORY)
        if role == KVConnectorRole.SCHEDULER and template:
            who = _role_of(ktc)
            engine = str(ktc.engine_id)
            try:
                path = str(template).format(role=who, engine_id=engine, pid=os.getpid())
            except (KeyError, IndexError, ValueError):
                raise UsageError(
                    f"kv_connector_extra_config.{EXTRA_HISTORY}",
                    template,
                    "a path whose only {fields} are {role}, {engine_id} and {pid}",
                ) from None
            block_size = vllm_config.cache_config.block_size
            decodes = extra.get(EXTRA_DECODES) or os.environ.get(ENV_DECODES) or "all"
            if decodes not in DECODES:
                raise UsageError(f"kv_connector_extra_config.{EXTRA_DECODES}", decodes, " or ".join(DECODES))
            header = HistoryHeader(
                policy="pull",
                complete=False,
                features={"share", "kv", "boundary"},
                kv=KVSpec(block_size=block_size),
                boundary="recompute",
                extra={
                    "vllm": {
                        "engine_id": engine,
                        "role": who,
                        "kv_role": ktc.kv_role,
                        "num_blocks": int(kv_cache_config.num_blocks),
                        "block_size": block_size,
                        "connector": type(self._inner).__name__,
                        "recorder": RECORDER_VERSION,
                        "started": round(clock() / 1e6, 3),
                        "decodes": decodes,
                    }
                },
            )
            self._recorder = _Recorder(path, header, engine, block_size, decodes)

    # -- where the history goes ---------------------------------------------
    @property
    def history_path(self) -> str | None:
        """The file this instance writes (None: not recording)."""
        return self._recorder.path if self._recorder is not None else None

    @property
    def inner(self) -> KVConnectorBase_V1:
        """The wrapped NIXL connector."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        # anything the base class does not define (connector_scheduler, engine_id, ...)
        if name in ("_inner", "_recorder"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    # -- scheduler side: recorded --------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self._recorder is not None:
            self._recorder.manager = kv_cache_manager
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        result = self._inner.on_new_request(request)
        if self._recorder is not None:
            self._recorder.sync()
            self._recorder.on_new_request(request)
        return result

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if self._recorder is not None:
            self._recorder.matched(request, num_computed_tokens)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rec = self._recorder
        params = dict(request.kv_transfer_params or {})  # the inner connector changes them in place
        if rec is not None:
            g = rec.gens.get(request.request_id)
            if g is not None and g.allocated:
                rec.sync()  # a reallocation after a preemption: an alloc, seen from the table
        result = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if rec is not None:
            rec.sync()
            rec.after_alloc(request, blocks, num_external_tokens, params)
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._inner.build_connector_meta(scheduler_output)
        if self._recorder is not None:
            self._recorder.sync()
            self._recorder.meta(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._recorder is not None:
            self._recorder.sync()
            self._recorder.connector_output(connector_output, _nixl_now())
        return self._inner.update_connector_output(connector_output)

    def _lease_deadline(self, request: Any) -> float | None:
        """The deadline NIXL's scheduler side just gave the blocks it keeps
        for ``request`` (its ``_reqs_need_send``), if any."""
        pending = getattr(getattr(self._inner, "connector_scheduler", None), "_reqs_need_send", None)
        deadline = pending.get(request.request_id) if isinstance(pending, dict) else None
        return float(deadline) if isinstance(deadline, (int, float)) else None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._recorder is not None:
            self._recorder.sync()
        result = self._inner.request_finished(request, block_ids)
        if self._recorder is not None:
            self._recorder.finished(request, self._lease_deadline(request))
        return result

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._recorder is not None:
            self._recorder.sync()
        if supports_hma(self._inner):
            result = self._inner.request_finished_all_groups(request, block_ids)
        else:
            assert len(block_ids) == 1
            result = self._inner.request_finished(request, block_ids[0])
        if self._recorder is not None:
            self._recorder.finished(request, self._lease_deadline(request))
        return result

    def take_events(self) -> Any:
        # the scheduler asks for these last in update_from_output, after it freed
        # what finished_sending / finished_recving released: the frees are seen here
        events = self._inner.take_events()
        if self._recorder is not None:
            self._recorder.sync()
        return events

    def shutdown(self) -> Any:
        if self._recorder is not None and not self._recorder.closed:
            self._recorder.sync()
        try:
            return self._inner.shutdown()
        finally:
            if self._recorder is not None:
                self._recorder.close()

    # -- forwarded properties ------------------------------------------------
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    # -- forwarded class methods ---------------------------------------------
    @classmethod
    def _inner_for(cls, vllm_config: Any = None, extra: dict | None = None) -> type:
        if extra is None and vllm_config is not None and vllm_config.kv_transfer_config is not None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return _inner_class(dict(extra or {}), cls._default_inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return cls._inner_for(vllm_config).get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return cls._inner_for(extra=extra_config).requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return cls._inner_for().build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        return cls._inner_for(vllm_config).build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


def _forward(name: str) -> Any:
    def method(self: RecordingConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Forwarded to the wrapped connector's ``{name}``."
    return method


# Every other method of the connector interface goes to the wrapped connector
# unchanged (worker side included: its metadata is bound on the inner one).
for _name, _value in list(vars(KVConnectorBase_V1).items()):
    if (
        callable(_value)
        and not isinstance(_value, (classmethod, staticmethod, property))
        and not (_name.startswith("__") and _name.endswith("__"))
        and _name not in vars(RecordingConnector)
    ):
        setattr(RecordingConnector, _name, _forward(_name))
RecordingConnector.__abstractmethods__ = frozenset()
del _name, _value

#: the names vLLM looks up with ``kv_connector_module_path`` set to this
#: module: ``kv_connector: "NixlConnector"`` keeps vLLM's checks of the NIXL
#: connector by name
NixlConnector = RecordingConnector


class NixlPullConnector(RecordingConnector):
    """:class:`RecordingConnector` under the name of the pull connector."""

    _default_inner = "NixlPullConnector"


# -- merging the per-engine files ------------------------------------------------


def _events(path: str, index: int) -> Iterator[tuple[float, int, int, Event]]:
    with open_history(path) as reader:
        for line, event in reader:
            t = event.extra.get("t")
            if type(t) not in (int, float):
                raise HistoryFormatError(
                    f"field 't' is missing or not a number, got {t!r}: merge needs each event's time",
                    source=path,
                    line=line,
                    field="t",
                    value=t,
                )
            yield float(t), index, line, event


def merge_histories(
    paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *, complete: bool = False
) -> int:
    """Merge the histories the engines of one deployment recorded (one file
    per P and D instance) into one history at ``out``, ordered by each
    event's ``"t"`` (ties keep the order of ``paths``, then of lines), and
    return the number of lines written.  Audit the result with ``pdproto
    audit OUT``.

    The header declares every worker when every worker the events name has a
    file (then ``capacity`` is checked); ``complete`` sets the header's
    ``complete`` (only for a run drained to the end: otherwise ``leak`` and
    ``stuck`` flag work still in flight).  Two files of one engine id mean
    that engine started again: a ``restart`` goes in at the later one's
    start.  A ``transfer_read_done`` P recorded from D's notification
    (extra ``"if_started": true``) is kept only when the transfer started
    before it.  Files that disagree on the policy,
    the first-token convention or the block size are one
    :class:`~pdproto.UsageError`."""
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise UsageError("paths", paths, "at least one history file")
    headers = []
    for p in paths:
        with open_history(p) as reader:
            headers.append(reader.header if reader.header is not None else HistoryHeader())
    first = headers[0]
    for p, h in zip(paths, headers):
        for what, mine, theirs in (
            ("policy", h.policy, first.policy),
            ("boundary", getattr(h, "boundary", None), getattr(first, "boundary", None)),
            ("block size", h.block_size, first.block_size),
        ):
            if mine != theirs:
                raise UsageError(
                    f"{p}: {what}", mine, f"{theirs!r}, the {what} of {paths[0]} (one deployment)"
                )
    features = frozenset().union(*(h.features for h in headers))
    declared: dict[str, WorkerSpec] = {}
    for h in headers:
        info = h.extra.get("vllm") or {}
        if info.get("role") in ("prefill", "decode") and "engine_id" in info:
            declared[str(info["engine_id"])] = WorkerSpec(info["role"], int(info["num_blocks"]))
    named: set[str] = set()
    for p in paths:
        with open_history(p) as reader:
            for _line, event in reader:
                for field in ("worker", "src", "dst"):
                    value = getattr(event, field, None)
                    if value is not None:
                        named.add(value)
    workers = declared if named <= set(declared) and declared else None
    # a later file of the same engine: that engine started again
    restarts: list[tuple[float, int, int, Event]] = []
    by_engine: dict[str, list[float]] = {}
    for h in headers:
        info = h.extra.get("vllm") or {}
        if "engine_id" in info and type(info.get("started")) in (int, float):
            by_engine.setdefault(str(info["engine_id"]), []).append(float(info["started"]))
    for engine, starts in by_engine.items():
        for n, t in enumerate(sorted(starts)[1:], 1):
            restarts.append((t, -1, 0, Restart(worker=engine, incarnation=n, extra={"t": t})))
    restarts.sort(key=lambda item: item[0])
    header_kwargs: dict[str, Any] = dict(
        policy=first.policy,
        complete=complete,
        workers=workers,
        features=features,
        kv=first.kv,
        extra={"merged": [os.path.basename(p) for p in paths]},
    )
    if hasattr(first, "boundary"):
        header_kwargs["boundary"] = first.boundary
    header = HistoryHeader(**header_kwargs)
    tmp = f"{os.fspath(out)}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            writer = HistoryWriter(fh, header)
            streams = [iter(restarts)] + [_events(p, i) for i, p in enumerate(paths)]
            started: set[str] = set()
            for _t, _i, _line, event in heapq.merge(*streams, key=lambda item: (item[0], item[1])):
                if type(event) is TransferStart:
                    started.add(event.transfer)
                elif event.extra.get(IF_STARTED) is True and event.transfer not in started:
                    continue  # P heard D was done with its blocks, and D never read them
                writer.write(event)
        os.replace(tmp, os.fspath(out))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return writer.line
