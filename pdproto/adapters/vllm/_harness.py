"""Real vLLM schedulers for a P and a D instance, with fake workers.

:class:`VllmHarness` builds vLLM's own ``Scheduler`` twice, a prefill (P)
and a decode (D) instance, each with the NIXL connector's scheduler side
(pull: ``NixlPullConnectorScheduler``, the default; push:
``NixlPushConnectorScheduler``), on ``DeviceConfig("cpu")`` with a local
model ``config.json`` and no weights.  Everything above the worker boundary
is vLLM's code; below it, :class:`FakeWorker` plays the GPU worker and its
NIXL connector worker: it turns what the scheduler ships in its connector
metadata (``reqs_to_recv``, ``reqs_to_send``, ``reqs_in_batch``,
``reqs_not_processed``, ``push_registrations``, ``push_finished_blocks``)
into data-plane transfers, and reports what real workers report back in
``KVConnectorOutput`` (``finished_sending``, ``finished_recving``,
``failed_recving`` with ``invalid_block_ids``), keeping the same books as
vLLM's ``NixlBaseConnectorWorker`` (leases per request, a notification for
an unknown request ignored, the done notification withheld after a failed
read).  The model runner is fake too: it samples deterministic token ids.

The first vLLM import and the first scheduler cost most of a minute; a
scheduler after that costs milliseconds, so :meth:`VllmHarness.rebuild`
(used by reset and restart) builds fresh ones from the same configuration.

Time is injected: the NIXL scheduler modules read ``time.perf_counter`` for
lease deadlines; while a harness is open they read the process's one
:class:`Clock` instead (restored when the last harness closes).  Harnesses
in one process share that clock, and each reset sets it back: run them one
after the other, not interleaved.

``connector=(class_name, module_path)`` loads another connector class (for
example a recording wrapper around NIXL's) through vLLM's
``kv_connector_module_path``; it must expose the NIXL scheduler object as
``connector_scheduler`` (or wrap an object that does, as ``connector``,
``_connector`` or ``wrapped``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time as _time
from typing import Any

from ._support import import_vllm, require_vllm

require_vllm()
import_vllm()

import logging  # noqa: E402

__all__ = ["Clock", "FakeWorker", "Transfer", "VllmHarness", "token_for"]

#: the NIXL scheduler-side modules whose ``time`` the clock replaces
_CLOCKED = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler",
)

_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
}


class Clock:
    """The injected clock: seconds that move only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _TimeShim:
    """``time`` as the NIXL scheduler modules see it: the clock for
    ``perf_counter``/``monotonic``/``time``, the real module otherwise."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def perf_counter(self) -> float:
        return self._clock.now

    monotonic = perf_counter
    time = perf_counter

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


#: the process's injected clock, its patched modules' saved ``time``, the open harnesses
_CLOCK = Clock()
_SAVED_TIME: dict[str, Any] = {}
_OPEN: set[int] = set()


def token_for(request_id: str, position: int) -> int:
    """The deterministic token the fake model runner samples for the
    request at ``position`` (an id in ``[100, 900)``)."""
    h = 0
    for ch in request_id:
        h = (h * 131 + ord(ch)) % 1_000_003
    return 100 + (h * 7 + position * 37) % 800


class Transfer:
    """One data-plane transfer (a NIXL READ in pull, a WRITE in push) of one
    request's KV, from P's blocks to D's."""

    __slots__ = ("p_id", "d_id", "src_blocks", "dst_blocks", "state")

    def __init__(self, p_id: str, d_id: str, src_blocks: list[int], dst_blocks: list[int]) -> None:
        self.p_id = p_id
        self.d_id = d_id
        self.src_blocks = list(src_blocks)
        self.dst_blocks = list(dst_blocks)
        self.state = "running"  # running, done, failed

    def __repr__(self) -> str:
        return f"Transfer({self.p_id!r}, {self.d_id!r}, {self.src_blocks}, {self.dst_blocks})"


class FakeWorker:
    """The worker side of one instance: NIXL connector worker plus model
    runner, as far as the scheduler can tell.  It keeps the books vLLM's
    ``NixlBaseConnectorWorker`` keeps (``_reqs_to_process``,
    ``_reqs_to_send`` with lease deadlines, ``_recving_metadata``) and
    reports completions in the next ``KVConnectorOutput``."""

    def __init__(self, role: str) -> None:
        self.role = role  # "P" or "D"
        self.reqs_to_process: set[str] = set()
        self.reqs_to_send: dict[str, float] = {}
        #: D: requests whose KV is expected: d_id -> (local blocks, remote blocks, p_id)
        self.recving: dict[str, tuple[list[int], list[int], str]] = {}
        #: notifications that arrived and are read at the next step: (kind, req_id)
        #: kinds: "done" (the peer finished reading / writing req_id),
        #: "read" (D: its own READ of req_id completed), "failed" (D: its READ failed),
        #: "reg" (P, push: D registered blocks for req_id)
        self.inbox: list[tuple[str, str]] = []
        #: notifications already read (kept for the duplicate fault)
        self.read_notifs: list[tuple[str, str]] = []
        #: P, push: registrations by P request id: (d_id, D blocks)
        self.registrations: dict[str, tuple[str, list[int]]] = {}
        #: P, push: finished blocks not yet matched with a registration
        self.finished_blocks: dict[str, list[int]] = {}
        #: P, push: WRITEs that completed (reported as finished_sending) or failed
        self.pushed: set[str] = set()

    def signature(self) -> tuple:
        return (
            tuple(sorted(self.reqs_to_process)),
            tuple(sorted(self.reqs_to_send)),
            tuple(sorted(self.recving)),
            tuple(sorted(self.inbox)),
            tuple(sorted(self.registrations)),
            tuple(sorted(self.finished_blocks)),
            tuple(sorted(self.pushed)),
        )


def _nixl_scheduler(connector: Any) -> Any:
    """The NIXL scheduler object behind a (possibly wrapping) connector."""
    seen = 0
    obj = connector
    while obj is not None and seen < 4:
        sched = getattr(obj, "connector_scheduler", None)
        if sched is not None:
            return sched
        obj = next(
            (
                getattr(obj, a)
                for a in ("connector", "_connector", "wrapped")
                if getattr(obj, a, None) is not None
            ),
            None,
        )
        seen += 1
    raise TypeError(f"connector {type(connector).__name__} exposes no NIXL connector_scheduler")


class VllmHarness:
    """Two real vLLM schedulers (P and D) with fake workers, built once.

    ``family`` is ``"pull"`` or ``"push"``; ``block_size`` tokens per block;
    ``num_blocks`` per instance (block 0 is vLLM's null block, never handed
    out); ``lease`` is ``kv_lease_duration`` in seconds; ``connector``
    optionally ``(class_name, module_path)`` of another connector class,
    loaded through ``kv_connector_module_path``; ``extra_config`` is merged
    into both instances' ``kv_connector_extra_config``."""

    P_ENGINE = "engine-P"
    D_ENGINE = "engine-D"

    def __init__(
        self,
        family: str = "pull",
        *,
        block_size: int = 4,
        num_blocks: int = 9,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 64,
        lease: int = 30,
        connector: tuple[str, str | None] | None = None,
        extra_config: dict | None = None,
        quiet: bool = True,
    ) -> None:
        if family not in ("pull", "push"):
            raise ValueError(f"family must be 'pull' or 'push', got {family!r}")
        self.family = family
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lease = lease
        self.extra_config = dict(extra_config or {})
        self.clock = _CLOCK
        self._model_dir = tempfile.mkdtemp(prefix="pdproto-vllm-model-")
        with open(os.path.join(self._model_dir, "config.json"), "w") as f:
            json.dump(_MODEL_CONFIG, f)
        if quiet:
            for name in ("vllm", "vllm.distributed", "vllm.v1"):
                logging.getLogger(name).setLevel(logging.ERROR)
        default = "NixlConnector" if family == "pull" else "NixlPushConnector"
        name, module_path = connector if connector is not None else (default, None)
        self.connector = (name, module_path)
        self._install_clock()
        t0 = _time.perf_counter()
        self._configs = {
            side: self._make_configs(side, name, module_path, max_num_seqs, max_num_batched_tokens)
            for side in ("P", "D")
        }
        self.sched: dict[str, Any] = {}
        self.workers: dict[str, FakeWorker] = {}
        self.transfers: dict[str, Transfer] = {}  # by d_id (one per D request)
        self._reg_payload: dict[str, list[int]] = {}  # push: D's registered blocks by d_id
        self._p_of_d: dict[str, str] = {}  # the router's pairing: d_id -> p_id
        for side in ("P", "D"):
            self.rebuild(side)
        self.startup_seconds = _time.perf_counter() - t0

    # -- building -----------------------------------------------------------------

    def _make_configs(
        self, side: str, name: str, module_path: str | None, max_num_seqs: int, max_num_batched_tokens: int
    ) -> tuple[Any, Any]:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        model = ModelConfig(
            model=self._model_dir,
            tokenizer=self._model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=256,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=256,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=False)
        transfer = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module_path,
            kv_role="kv_producer" if side == "P" else "kv_consumer",
            engine_id=self.P_ENGINE if side == "P" else self.D_ENGINE,
            kv_connector_extra_config={**self.extra_config, "kv_lease_duration": self.lease},
            kv_load_failure_policy="fail",
        )
        config = VllmConfig(
            model_config=model,
            scheduler_config=scheduler,
            cache_config=cache,
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = self.num_blocks
        kv_cache = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=self.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
        return config, kv_cache

    def rebuild(self, side: str) -> None:
        """A fresh scheduler and worker for ``side`` (``"P"`` or ``"D"``):
        what reset and a restart of that instance get."""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        config, kv_cache = self._configs[side]
        old = self.sched.get(side)
        if old is not None:
            self._shutdown(old)
        self.sched[side] = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(config),
            block_size=self.block_size,
        )
        self.workers[side] = FakeWorker(side)

    def reset(self) -> None:
        """Both instances fresh, no transfer, the clock back at its start."""
        self.clock.now = 1000.0
        self.transfers.clear()
        self._reg_payload.clear()
        self._p_of_d.clear()
        for side in ("P", "D"):
            self.rebuild(side)

    def _install_clock(self) -> None:
        import importlib

        if not _SAVED_TIME:
            for name in _CLOCKED:
                module = importlib.import_module(name)
                _SAVED_TIME[name] = module.time
                module.time = _TimeShim(_CLOCK)
        _OPEN.add(id(self))

    @staticmethod
    def _shutdown(sched: Any) -> None:
        try:
            sched.shutdown()
        except Exception:  # pragma: no cover - best effort
            pass

    def close(self) -> None:
        import importlib

        for sched in self.sched.values():
            self._shutdown(sched)
        self.sched.clear()
        _OPEN.discard(id(self))
        if not _OPEN:
            for name, saved in _SAVED_TIME.items():
                importlib.import_module(name).time = saved
            _SAVED_TIME.clear()
        shutil.rmtree(self._model_dir, ignore_errors=True)

    # -- looking ---------------------------------------------------------------------

    def nixl(self, side: str) -> Any:
        return _nixl_scheduler(self.sched[side].connector)

    def block_ids(self, side: str) -> dict[str, list[int]]:
        """Request id -> the block ids the real KV cache manager holds for it."""
        manager = self.sched[side].kv_cache_manager.coordinator.single_type_managers[0]
        return {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items() if blocks}

    def ref_counts(self, side: str) -> list[int]:
        return [b.ref_cnt for b in self.sched[side].kv_cache_manager.block_pool.blocks]

    def free_blocks(self, side: str) -> int:
        return self.sched[side].kv_cache_manager.block_pool.get_num_free_blocks()

    def connector_pending(self, side: str) -> bool:
        """Whether the connector's scheduler side has something to ship to
        its worker at the next step."""
        c = self.nixl(side)
        return bool(
            c._reqs_need_recv
            or c._reqs_not_processed
            or c._reqs_need_send
            or c._reqs_in_batch
            or getattr(c, "_push_pending_registrations", None)
            or getattr(c, "_newly_finished_push_blocks", None)
        )

    def leases_due(self, side: str = "P") -> list[str]:
        w = self.workers[side]
        return [rid for rid, deadline in w.reqs_to_send.items() if self.clock.now >= deadline]

    def worker_has_output(self, side: str) -> bool:
        """Whether the worker would report something at the next step."""
        w = self.workers[side]
        if w.inbox or self.leases_due(side):
            return True
        if side == "P" and self.family == "push":
            if any(rid in w.reqs_to_send or rid in w.reqs_to_process for rid in w.pushed):
                return True
            if any(rid in w.registrations for rid in w.finished_blocks):
                return True
        return False

    # -- one engine step, in phases --------------------------------------------------

    def add_request(
        self, side: str, request_id: str, prompt: list[int], max_tokens: int, params: dict | None
    ) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=sampling,
            pooling_params=None,
            mm_features=None,
            block_hasher=None,
        )
        request.kv_transfer_params = copy.deepcopy(params)
        self.sched[side].add_request(request)

    def schedule(self, side: str) -> Any:
        return self.sched[side].schedule()

    def start_load(self, side: str, scheduler_output: Any) -> list[Transfer]:
        """The worker reads the connector metadata the scheduler built:
        returns the transfers it started."""
        meta = scheduler_output.kv_connector_metadata
        w = self.workers[side]
        started: list[Transfer] = []
        if meta is None:
            return started
        for rid in getattr(meta, "reqs_in_batch", ()) or ():
            w.reqs_to_process.add(rid)
        for rid in getattr(meta, "reqs_not_processed", ()) or ():
            w.reqs_to_process.discard(rid)
        for rid, deadline in (getattr(meta, "reqs_to_send", None) or {}).items():
            if rid in w.reqs_to_process:
                w.reqs_to_send[rid] = deadline
        peer = self.workers["P" if side == "D" else "D"]
        for rid, req_meta in (getattr(meta, "reqs_to_recv", None) or {}).items():
            local = [int(b) for b in _first_group(req_meta.local_block_ids)]
            remote = req_meta.remote
            remote_ids = [int(b) for b in _first_group(remote.block_ids)] if remote is not None else []
            p_id = remote.request_id if remote is not None else None
            if self.family == "pull":
                if not local:
                    # nothing to read (aborted before scheduling, or a full local hit):
                    # the worker only tells P to free its blocks
                    if p_id is not None:
                        peer.inbox.append(("done", p_id))
                    continue
                w.recving[rid] = (local, remote_ids, p_id)
                t = Transfer(p_id, rid, remote_ids, local)
                self.transfers[rid] = t
                started.append(t)
            else:
                if not local:
                    continue
                w.recving[rid] = (local, [], p_id)
        for rid, reg in (getattr(meta, "push_registrations", None) or {}).items():
            # D -> P: a PUSH_REG notification naming D's blocks
            peer.inbox.append(("reg", rid))
            self._reg_payload[rid] = [int(b) for b in _first_group(reg["local_block_ids"])]
        for rid, blocks in (getattr(meta, "push_finished_blocks", None) or {}).items():
            w.finished_blocks[rid] = [int(b) for b in _first_group(blocks)]
        if side == "P" and self.family == "push":
            started.extend(self._match_pushes())
        return started

    def _match_pushes(self) -> list[Transfer]:
        """P, push: start a WRITE for each finished request whose D
        registration has arrived."""
        w = self.workers["P"]
        started = []
        for p_id in sorted(w.finished_blocks):
            reg = w.registrations.get(p_id)
            if reg is None:
                continue
            d_id, dst = reg
            src = w.finished_blocks.pop(p_id)
            del w.registrations[p_id]
            t = Transfer(p_id, d_id, src, dst)
            self.transfers[d_id] = t
            started.append(t)
        return started

    def execute(self, side: str, scheduler_output: Any) -> tuple[Any, list[Transfer]]:
        """The fake model runner and connector worker: sampled tokens and the
        ``KVConnectorOutput`` of this step.  Returns the output and the
        transfers started while reading notifications (push registrations)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.sched[side]
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid in scheduler_output.num_scheduled_tokens:
            req = sched.requests.get(rid)
            req_ids.append(rid)
            if req is None or req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # a chunk of the prompt: nothing sampled
            else:
                sampled.append([token_for(rid, req.num_computed_tokens)])
        kv, started = self._get_finished(side)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(**kv) if kv else None,
        )
        return output, started

    def _get_finished(self, side: str) -> tuple[dict, list[Transfer]]:
        w = self.workers[side]
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        started: list[Transfer] = []
        inbox, w.inbox = w.inbox, []
        for kind, rid in inbox:
            w.read_notifs.append((kind, rid))
            if kind == "reg":  # P, push
                d_id = rid
                p_id = self._p_of_d.get(d_id)
                if p_id is not None:
                    w.registrations[p_id] = (d_id, self._reg_payload.get(d_id, []))
            elif kind == "read":  # D's own READ completed (pull)
                if rid in w.recving:
                    del w.recving[rid]
                    done_recving.add(rid)
            elif kind == "failed":  # D's READ failed (pull) or P's peer died
                if rid in w.recving:
                    local, _remote, _p = w.recving.pop(rid)
                    done_recving.add(rid)
                    failed.add(rid)
                    invalid.update(local)
            elif kind == "done":
                if side == "P":
                    # D finished reading rid: free unless unknown (expired, restarted)
                    if rid in w.reqs_to_send or rid in w.reqs_to_process:
                        w.reqs_to_process.discard(rid)
                        w.reqs_to_send.pop(rid, None)
                        done_sending.add(rid)
                else:
                    # push: P's WRITE into rid landed
                    if rid in w.recving:
                        del w.recving[rid]
                        done_recving.add(rid)
        if side == "P" and self.family == "push":
            started.extend(self._match_pushes())
            for p_id in sorted(w.pushed):
                w.pushed.discard(p_id)
                if p_id in w.reqs_to_send or p_id in w.reqs_to_process:
                    w.reqs_to_send.pop(p_id, None)
                    w.reqs_to_process.discard(p_id)
                    done_sending.add(p_id)
        # leases: an expired one is reported as done sending (the blocks go back)
        for rid in self.leases_due(side):
            del w.reqs_to_send[rid]
            w.reqs_to_process.discard(rid)
            w.finished_blocks.pop(rid, None)
            done_sending.add(rid)
        kv: dict[str, Any] = {}
        if done_sending:
            kv["finished_sending"] = done_sending
        if done_recving:
            kv["finished_recving"] = done_recving
        if failed:
            kv["failed_recving"] = failed
            kv["invalid_block_ids"] = invalid
        return kv, started

    def pair(self, p_id: str, d_id: str) -> None:
        """Tell the data plane which P request a D request reads (the
        router's pairing, which NIXL learns from the request ids)."""
        self._p_of_d[d_id] = p_id

    def update(self, side: str, scheduler_output: Any, output: Any) -> dict:
        return self.sched[side].update_from_output(scheduler_output, output)

    # -- the data plane --------------------------------------------------------------

    def complete(self, d_id: str) -> Transfer:
        """The transfer into ``d_id`` completes: pull, D's READ is done (D
        reports it, and notifies P); push, P's WRITE is done (P reports it,
        and notifies D)."""
        t = self.transfers[d_id]
        t.state = "done"
        if self.family == "pull":
            self.workers["D"].inbox.append(("read", d_id))
            self.workers["P"].inbox.append(("done", t.p_id))
        else:
            self.workers["P"].pushed.add(t.p_id)
            self.workers["D"].inbox.append(("done", d_id))
        return t

    def fail(self, d_id: str) -> Transfer:
        """The transfer into ``d_id`` fails: pull, D's READ fails (D reports
        ``failed_recving`` and its blocks as invalid; no notification goes
        to P, whose lease frees the blocks); push, P's WRITE fails (P keeps
        the blocks until the lease; D hears nothing)."""
        t = self.transfers[d_id]
        t.state = "failed"
        if self.family == "pull":
            self.workers["D"].inbox.append(("failed", d_id))
        return t

    def running_transfers(self) -> list[Transfer]:
        return [t for t in self.transfers.values() if t.state == "running"]


def _first_group(block_ids: Any) -> list[int]:
    """The block ids of the first (only) KV cache group."""
    if block_ids is None:
        return []
    block_ids = list(block_ids)
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return block_ids
