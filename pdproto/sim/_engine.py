"""The discrete-event simulator: three serving arms at the same device budget.

Arms (``SimConfig.arm``):

``colocated``
    ``devices // tp`` instances, each continuous batching, prefill first
    (vLLM without chunked prefill): a step is either a prefill batch of
    waiting prompts (while KV blocks and ``max_batch_tokens`` allow) or one
    decode token for every running sequence.
``chunked``
    the same instances, Sarathi-style: every step decodes one token for each
    running sequence and fills the rest of a ``chunk_tokens`` budget with
    prompt chunks.
``pd``
    ``n_p`` prefill instances (tp ``tp_p``) and ``n_d`` decode instances (tp
    ``tp_d``).  Every handoff is the reference protocol, push policy:
    submit -> reserve (D blocks for the prompt) -> prefill_start ->
    prefill_done -> transfer_start -> transfer_read_done -> free (P) ->
    transfer_write_done -> commit -> decode ... -> finish -> free (D), as
    :mod:`pdproto.spec` events.  With a monitor (the default) each event is
    judged as it happens and the first violation stops the run, naming the
    request and the simulated time.  ``history`` writes the events.

KV capacity is in blocks of ``block_size`` tokens per instance and enforced:
a prompt is admitted only when its blocks are free; a decode that needs a new
block when none is free preempts the most recently admitted sequence
(recompute, vLLM's default): colocated it goes back to the queue, on D its
generation fails and a new generation goes through the whole handoff again.
A prompt larger than an instance, a queue over ``max_queue`` or a wait over
``queue_timeout_s`` rejects the request.

Transfers (PD): ``latency_ms + bytes / bandwidth`` per P instance's egress
(``links`` links of ``bandwidth_gibps`` each), fair-shared among the
transfers leaving the same P instance.  ``layerwise`` overlaps the transfer
with the prefill: only what the egress could not carry during the prefill,
and at least one layer's share, is left after it.  Faults: a transfer fails
with probability ``transfer_fail_rate``; one still running after
``transfer_timeout_ms`` is aborted.  Either fails the generation and retries
with a new one (at most ``max_retries`` times; then the request fails).
Client cancellations come with the workload (``cancel_at`` / ``cancel_phase``).

Everything streams: finished requests go to ``sink`` as
``RequestRecord``s, events to the monitor and the history; the simulator
keeps only live requests.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
import random
import time as _time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import attrs

from .._errors import PdprotoError, UsageError
from ..spec import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Fail,
    Finish,
    Free,
    HistoryHeader,
    HistoryWriter,
    Monitor,
    PrefillDone,
    PrefillStart,
    Reserve,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
)
from ._latency import DEVICES, MODELS, PiecewiseLinear, Roofline, device_spec, model_spec

__all__ = ["ARMS", "SimConfig", "SimResult", "SimulationCheckError", "simulate", "latency_for"]

ARMS = ("colocated", "chunked", "pd")
DECODE_EVENTS = ("first", "all")
CANCEL_PHASES = ("queued", "prefill", "transfer", "decode")
GIB = 2**30

# event kinds on the heap
_ARRIVE, _STEP, _XSTART, _XJOIN, _XDONE, _CANCEL, _TIMEOUT, _QTIMEOUT = range(8)
_PHASE = ("queued", "queued", "prefill", "transfer", "transfer", "decode", "done")
_DSTEP = ("d",)  # the batch of a pure decode step
_MACRO = 64  # most decode steps one macro-step event covers
# request states
_RQ, _PQ, _PRE, _COORD, _XFER, _DEC, _DONE = range(7)


def _pos(_i: object, a: attrs.Attribute, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == math.inf:
        raise UsageError(a.name, v, "a positive finite number")


def _nonneg(_i: object, a: attrs.Attribute, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == math.inf:
        raise UsageError(a.name, v, "a finite number >= 0")


def _posint(_i: object, a: attrs.Attribute, v: object) -> None:
    if type(v) is not int or v < 1:
        raise UsageError(a.name, v, "an integer >= 1")


def _optpos(_i: object, a: attrs.Attribute, v: object) -> None:
    if v is not None:
        _pos(_i, a, v)


def _rate(_i: object, a: attrs.Attribute, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise UsageError(a.name, v, "a probability in [0, 1)")


@attrs.frozen
class SimConfig:
    """One configuration of one arm.  ``devices`` is the budget of the
    colocated arms (``devices // tp`` instances); the PD arm uses ``n_p * tp_p
    + n_d * tp_d`` devices.  ``kv_blocks`` is per instance (None: what fits
    beside the weights, from the model and device)."""

    arm: str = attrs.field(default="pd", validator=attrs.validators.in_(ARMS))
    model: str = "llama-3-8b"
    device: str = "h100-sxm"
    devices: int = attrs.field(default=2, validator=_posint)
    tp: int = attrs.field(default=1, validator=_posint)
    n_p: int = attrs.field(default=1, validator=_posint)
    n_d: int = attrs.field(default=1, validator=_posint)
    tp_p: int = attrs.field(default=1, validator=_posint)
    tp_d: int = attrs.field(default=1, validator=_posint)
    block_size: int = attrs.field(default=64, validator=_posint)
    kv_blocks: int | None = attrs.field(default=None)
    memory_fraction: float = attrs.field(default=0.9, validator=_pos)
    max_batch_tokens: int = attrs.field(default=8192, validator=_posint)
    max_batch_seqs: int = attrs.field(default=256, validator=_posint)
    chunk_tokens: int = attrs.field(default=512, validator=_posint)
    bandwidth_gibps: float = attrs.field(default=25.0, validator=_pos)
    latency_ms: float = attrs.field(default=0.05, validator=_nonneg)
    links: int = attrs.field(default=1, validator=_posint)
    layerwise: bool = False
    coord_ms: float = attrs.field(default=2.0, validator=_nonneg)
    transfer_fail_rate: float = attrs.field(default=0.0, validator=_rate)
    transfer_timeout_ms: float | None = attrs.field(default=None, validator=_optpos)
    max_retries: int = attrs.field(default=3, validator=_nonneg)
    queue_timeout_s: float | None = attrs.field(default=None, validator=_optpos)
    max_queue: int | None = attrs.field(default=None)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        model_spec(self.model)
        device_spec(self.device)
        if self.kv_blocks is not None:
            _posint(self, attrs.fields(SimConfig).kv_blocks, self.kv_blocks)
        if self.max_queue is not None:
            _posint(self, attrs.fields(SimConfig).max_queue, self.max_queue)
        if self.memory_fraction > 1:
            raise UsageError("memory_fraction", self.memory_fraction, "a number in (0, 1]")
        if self.arm != "pd" and self.tp > self.devices:
            raise UsageError("tp", self.tp, f"at most the device budget {self.devices}")

    @property
    def used_devices(self) -> int:
        """Devices the configuration occupies."""
        if self.arm == "pd":
            return self.n_p * self.tp_p + self.n_d * self.tp_d
        return (self.devices // self.tp) * self.tp

    @property
    def weight_copies(self) -> int:
        """Model replicas (each instance holds the whole model, sharded over its tp)."""
        return self.n_p + self.n_d if self.arm == "pd" else self.devices // self.tp

    def label(self) -> str:
        if self.arm == "pd":
            return f"pd {self.n_p}P{self.n_d}D tp{self.tp_p}/{self.tp_d}"
        return f"{self.arm} {self.devices // self.tp}x tp{self.tp}"


def latency_for(config: SimConfig, tp: int, table: PiecewiseLinear | None = None) -> Any:
    """The latency model of an instance of ``tp`` devices: ``table`` when
    given (the same for every tp), else the roofline of the config's model and
    device."""
    if table is not None:
        return table
    return Roofline(MODELS[config.model.strip().lower()], DEVICES[config.device.strip().lower()], tp=tp)


@attrs.frozen
class SimResult:
    """What :func:`simulate` returns.  ``violation`` is None when the monitor
    found nothing (or did not run); otherwise a dict with the invariant, the
    request, the simulated time and the message, and the run stopped there."""

    config: SimConfig
    requests: int
    finished: int
    duration: float  # simulated seconds from the first arrival to the last event
    wall: float
    pools: dict
    transfers: dict
    faults: dict
    events: int
    violation: dict | None = None
    samples: tuple = ()
    rejections: dict = attrs.field(factory=dict)  # why -> requests refused at admission
    failures: dict = attrs.field(factory=dict)  # why -> requests the server gave up on
    mean_in_system: float = 0.0  # time-averaged requests in the system (Little's L)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def to_dict(self) -> dict:
        return {
            "config": attrs.asdict(self.config),
            "label": self.config.label(),
            "devices": self.config.used_devices,
            "weight_copies": self.config.weight_copies,
            "requests": self.requests,
            "finished": self.finished,
            "duration_s": self.duration,
            "wall_s": self.wall,
            "sim_requests_per_wall_s": self.requests / self.wall if self.wall > 0 else None,
            "pools": self.pools,
            "transfers": self.transfers,
            "faults": self.faults,
            "events": self.events,
            "violation": self.violation,
            "rejections": self.rejections,
            "failures": self.failures,
            "mean_in_system": self.mean_in_system,
        }


class SimulationCheckError(PdprotoError):
    """The simulator's own bookkeeping contradicts itself at the end of a run:
    a bug in pdproto, never in its input.  ``check`` names the identity that
    failed (``conservation``, ``kv-returned`` or ``littles-law``) and
    ``detail`` gives the numbers."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(
            f"simulator self-check {check!r} failed: {detail} (a bug in pdproto; please report it)"
        )


class _Abort(Exception):
    pass


class _Req:
    __slots__ = (
        "id",
        "arrival",
        "prompt0",
        "out",
        "cancel_at",
        "cancel_phase",
        "gen",
        "plen",
        "produced",
        "times",
        "first",
        "state",
        "p",
        "d",
        "pblocks",
        "dblocks",
        "xid",
        "ticket",
        "retries",
        "cancelled",
        "rejected",
        "failed",
        "done_pre",
        "will_fail",
        "xbytes",
        "xready",
        "pre_dur",
        "j",
        "ep",
        "di",
        "pstart",
        "xs",
        "xe",
    )
    # None until the request leaves the reservation queue (PD) or is queued on an instance
    # (colocated), then never reset: the P (colocated: the only) instance, and PD's D instance
    p: _Inst | None
    d: _Inst | None

    def __init__(self, r: Any) -> None:
        self.id = r.id
        self.arrival = r.arrival
        self.prompt0 = r.prompt_len
        self.out = r.output_len
        self.cancel_at = getattr(r, "cancel_at", None)
        self.cancel_phase = getattr(r, "cancel_phase", None)
        self.gen = 0
        self.plen = r.prompt_len  # prompt of this generation (recompute adds produced tokens)
        self.produced = 0
        self.times: list[float] = []
        self.first: float | None = None
        self.state = _RQ
        self.p = self.d = None
        self.pblocks: list[int] = []
        self.dblocks: list[int] = []
        self.xid = self.ticket = ""
        self.retries = 0
        self.cancelled = self.rejected = self.failed = False
        self.done_pre = 0  # prompt tokens prefilled so far (chunked)
        self.will_fail = False
        self.xbytes = 0.0
        self.xready = 0.0
        self.pre_dur = 0.0
        self.j = 0  # decode step of its instance it joined at
        self.ep = 0  # epoch: grows each time it leaves a running set
        self.di: Any = None  # the instance it decodes on
        # for the record: when the prefill that gave the first token started,
        # and when the transfer that handed it to D started and landed
        self.pstart: float | None = None
        self.xs: float | None = None
        self.xe: float | None = None


class _Inst:
    __slots__ = (
        "name",
        "role",
        "lat",
        "nblocks",
        "free",
        "waiting",
        "running",
        "prefilling",
        "busy",
        "batch",
        "busy_time",
        "kv_area",
        "q_area",
        "last",
        "preempted",
        "peak_kv",
        "steps",
        "egress",
        "qtok",
        "pending",
        "first",
        "k",
        "dtimes",
        "dbase",
        "ends",
        "grows",
        "ctx",
        "ndec",
        "cancels",
        "mends",
        "eheap",
        "version",
    )

    def __init__(self, name: str, role: str, lat: Any, nblocks: int) -> None:
        self.name = name
        self.role = role  # "colocated", "prefill" or "decode"
        self.lat = lat
        self.nblocks = nblocks
        self.free = list(range(nblocks - 1, -1, -1))  # pop() gives the lowest id first
        self.waiting: deque[_Req] = deque()
        self.running: dict[_Req, None] = {}  # decoding, in admission order
        self.prefilling: list[_Req] = []  # chunked: admitted, prompt not done
        self.busy = False
        self.batch: Any = None
        self.busy_time = 0.0
        self.kv_area = 0.0
        self.q_area = 0.0
        self.last = 0.0
        self.preempted = 0
        self.peak_kv = 0
        self.steps = 0
        self.qtok = 0  # prompt tokens waiting (router's load measure)
        self.pending: list[_Req] = []  # joined, decoding from the next decode step
        self.first: list[_Req] = []  # in their first decode step
        self.k = 0  # decode steps started
        self.dtimes: list[float] = []  # end times of decode steps dbase, dbase + 1, ...
        self.dbase = 0
        self.ends: dict[int, list] = {}
        self.grows: dict[int, list] = {}
        self.ctx = 0  # KV positions the running sequences read per step
        self.ndec = 0
        self.cancels: list[_Req] = []
        self.mends: list[float] | None = None  # end times of the steps of the macro-step in progress
        self.eheap: list[int] = []  # step indexes in ends, as a heap
        self.version = 0  # of the step event in flight
        self.egress: _Egress | None = None


class _Egress:
    """Fair-share (processor-sharing) egress of one P instance."""

    __slots__ = ("bw", "active", "last", "version", "peak")

    def __init__(self, bw: float) -> None:
        self.bw = bw  # bytes per second
        self.active: dict[_Req, float] = {}  # request -> bytes left
        self.last = 0.0
        self.version = 0
        self.peak = 0


#: the collector's young-generation threshold while a simulation runs (see _Sim.run)
_GC_YOUNG = 1_000_000


def _blocks_for(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def simulate(
    requests: Iterable[Any],
    config: SimConfig,
    *,
    metrics: Any = None,
    sink: Callable[[Any], None] | None = None,
    monitor: bool = True,
    history: IO[str] | None = None,
    decode_events: str = "first",
    table: PiecewiseLinear | None = None,
    sample_dt: float | None = None,
    record: Callable[..., Any] | None = None,
) -> SimResult:
    """Run ``requests`` (``SimRequest``-like, sorted by arrival) through the
    arm ``config`` describes.  Each finished request goes to ``sink`` as a
    ``RequestRecord`` (built by ``record``, default
    :class:`pdproto.sim._metrics.RequestRecord`, called with its fields as
    keyword arguments); with ``metrics`` (a
    :class:`~pdproto.sim._metrics.Metrics`) the records go to its ``add``
    (unless ``sink`` is given) and the pools report to it too: gauges
    ``<pool>.queue`` and ``<pool>.kv_blocks``, busy time per instance,
    every transfer, and the fault counters.  The PD arm's handoff events
    go to an inline :class:`~pdproto.spec.Monitor` (``monitor``) and to
    ``history`` (a text stream); ``decode_events`` is ``"first"`` (only each
    generation's first decode, the handoff boundary the monitor judges; the
    fast default) or ``"all"`` (one event per token).  ``sample_dt`` (default
    0.1 s with ``metrics``; halved in rate as samples pile up) records
    pool samples every that many simulated seconds (queue, KV, busy) for the
    diagnostics and plots.
    """
    if decode_events not in DECODE_EVENTS:
        raise UsageError("decode_events", decode_events, " or ".join(DECODE_EVENTS))
    if record is None:
        from ._metrics import RequestRecord as record  # noqa: N813
    if sink is None and metrics is not None:
        sink = metrics.add
    if sample_dt is None and metrics is not None:
        sample_dt = 0.1
    sim = _Sim(config, sink, monitor, history, decode_events, table, sample_dt, record)
    sim.metrics = metrics
    return sim.run(iter(requests))


class _Sim:
    def __init__(
        self,
        cfg: SimConfig,
        sink: Any,
        monitor: bool,
        history: IO[str] | None,
        decode_events: str,
        table: Any,
        sample_dt: float | None,
        record: Any,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self.record = record
        self.bs = cfg.block_size
        self.rng = random.Random(cfg.seed)
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.all_decodes = decode_events == "all"
        self.sample_dt = sample_dt
        self.samples: list = []
        self.next_sample = 0.0
        shape = MODELS[cfg.model.strip().lower()].shape
        self.kv_tok = shape.bytes_per_token
        self.layers = shape.layers
        self.n = 0
        self.finished = 0
        # the end-of-run self-check's counts: requests in the system and the
        # integral of that count over time, their summed sojourn, ends of a
        # request already ended, and requests ending in two outcomes at once
        self.in_sys = 0
        self.sys_area = 0.0
        self.sys_t = 0.0
        self.sojourn = 0.0
        self.ended_twice = 0
        self.two_outcomes = 0
        self.why_rejected: Counter[str] = Counter()
        self.why_failed: Counter[str] = Counter()
        self.events = 0
        self.violation: dict | None = None
        self.faults = {
            "transfer_failures": 0,
            "timeouts": 0,
            "retries": 0,
            "preempted": 0,
            "rejected": 0,
            "cancelled": 0,
            "failed": 0,
            "recomputed_tokens": 0,
        }
        self.xfer = {"count": 0, "bytes": 0, "time": 0.0, "ideal": 0.0}
        self.rq: deque[_Req] = deque()  # PD: waiting for a D reservation
        self.rq_area = 0.0  # its length integrated over time (rq_account)
        self.rq_t = 0.0
        self.first_arrival: float | None = None
        self.d_freed = False
        self.kicks: set[_Inst] = set()
        self.metrics: Any = None
        self.gauges: list | None = None  # (set queue, set KV blocks, capacity) per pool, once sampled

        def make(role: str, count: int, tp: int, prefix: str) -> list[_Inst]:
            lat = latency_for(cfg, tp, table)
            if cfg.kv_blocks is not None:
                nb = cfg.kv_blocks
            else:
                roof = lat if isinstance(lat, Roofline) else latency_for(cfg, tp)
                nb = roof.kv_capacity_tokens(cfg.memory_fraction) // cfg.block_size
            if nb < 1:
                raise UsageError(
                    "kv_blocks", 0, f"room for KV on a {role} instance of tp {tp} (weights fill it)"
                )
            return [_Inst(f"{prefix}{i}", role, lat, nb) for i in range(count)]

        if cfg.arm == "pd":
            self.P = make("prefill", cfg.n_p, cfg.tp_p, "P")
            self.D = make("decode", cfg.n_d, cfg.tp_d, "D")
            bw = cfg.bandwidth_gibps * GIB * cfg.links
            for p in self.P:
                p.egress = _Egress(bw)
            self.pools = {"prefill": self.P, "decode": self.D}
        else:
            n = cfg.devices // cfg.tp
            self.C = make("colocated", n, cfg.tp, "W")
            self.pools = {"colocated": self.C}
        self.insts = [i for pool in self.pools.values() for i in pool]
        self.order = {inst: n for n, inst in enumerate(self.insts)}
        self.ev_on = cfg.arm == "pd" and (monitor or history is not None)
        self.mon: Monitor | None = None
        self.feed: Callable[[Any], list] | None = None  # the monitor's feed
        self.writer: HistoryWriter | None = None
        if self.ev_on:
            workers = {i.name: WorkerSpec(i.role, i.nblocks) for i in self.insts}
            header = HistoryHeader(
                policy="push",
                complete=True,
                workers=workers,
                extra={"description": f"pdproto simulate: {cfg.label()}"},
            )
            if monitor:
                self.mon = Monitor.from_header(header)
                self.feed = self.mon.feed
            if history is not None:
                self.writer = HistoryWriter(history, header)

    # -- plumbing -------------------------------------------------------------

    def push(self, t: float, kind: int, obj: Any, extra: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, extra))

    def emit(self, ev: Any, r: _Req | None = None) -> None:
        self.events += 1
        if self.writer is not None:
            ev.extra["t"] = round(self.now * 1e3, 6)
            self.writer.write(ev)
        if self.feed is not None:
            found = self.feed(ev)
            if found:
                self.violated(found[0], ev, r)

    def violated(self, v: Any, ev: Any, r: _Req | None) -> None:
        self.violation = {
            "invariant": v.invariant,
            "request": getattr(ev, "request", None) or (r.id if r is not None else None),
            "time_s": self.now,
            "message": v.message,
            "event": ev.to_dict(),
        }
        raise _Abort

    def alloc(self, inst: _Inst, n: int) -> list[int] | None:
        free = inst.free
        if len(free) < n:
            return None
        if n <= 0:
            return []
        out = free[: -n - 1 : -1]  # the last n, last first: what n pops give, without n calls
        del free[-n:]
        return out

    def release(self, inst: _Inst, blocks: list[int], r: _Req) -> None:
        if blocks:
            if self.ev_on:
                self.emit(Free.unchecked(inst.name, tuple(blocks), r.id, r.gen), r)
            inst.free.extend(blocks)
            blocks.clear()
            if inst.role == "decode":
                self.d_freed = True
            elif not inst.busy:
                self.kicks.add(inst)

    def account(self, inst: _Inst) -> None:
        """Integrate queue length and KV use of ``inst`` up to now."""
        dt = self.now - inst.last
        if dt > 0:
            inst.q_area += len(inst.waiting) * dt
            inst.kv_area += (inst.nblocks - len(inst.free)) * dt
            inst.last = self.now

    # -- the loop ---------------------------------------------------------------

    def run(self, it: Iterator[Any]) -> SimResult:
        # the loop makes no reference cycles (what it drops, reference counting
        # frees), while the monitor's state grows with the requests: at
        # CPython's default threshold (700 net new containers) the collector
        # walks that state some 300 times in a 10,000-request PD run, ~6% of
        # the run, to find nothing.  While the loop runs it collects every
        # _GC_YOUNG net new containers instead (still bounded); the caller's
        # thresholds come back at the end.
        thresholds = gc.get_threshold()
        if 0 < thresholds[0] < _GC_YOUNG:
            gc.set_threshold(_GC_YOUNG, *thresholds[1:])
        try:
            return self._run(it)
        finally:
            if 0 < thresholds[0] < _GC_YOUNG:
                gc.set_threshold(*thresholds)

    def _run(self, it: Iterator[Any]) -> SimResult:
        wall0 = _time.perf_counter()
        self.it = it
        self.next_arrival()
        heap = self.heap
        pop = heapq.heappop
        try:
            while heap:
                t, _s, kind, obj, extra = pop(heap)
                self.now = t
                if self.sample_dt is not None and t >= self.next_sample:
                    self.sample(t)
                if kind == _STEP:
                    if extra == obj.version:
                        self.step_done(obj)
                elif kind == _ARRIVE:
                    self.arrive(obj)
                    self.next_arrival()
                elif kind == _XDONE:
                    if extra == obj.version:
                        self.egress_done(obj)
                elif kind == _XSTART:
                    self.xfer_start(obj, extra)
                elif kind == _XJOIN:
                    if obj.state == _XFER and obj.gen == extra:
                        self.xfer_join(obj)
                elif kind == _CANCEL:
                    if extra is None or _PHASE[obj.state] == extra:
                        self.cancel(obj)
                elif kind == _TIMEOUT:
                    r = obj
                    if r.state == _XFER and r.gen == extra:
                        self.faults["timeouts"] += 1
                        self.xfer_fail(r, timeout=True)
                elif kind == _QTIMEOUT:
                    if (
                        obj.state in (_RQ, _PQ)
                        and obj.gen == extra
                        and not obj.cancelled
                        and obj.first is None
                    ):
                        self.reject(obj, "queue timeout")
                if self.d_freed:
                    self.d_freed = False
                    self.drain_rq()
                # an idle instance starts its step once every event of this instant is in,
                # so requests arriving (or landing) together are batched together
                while self.kicks and (not heap or heap[0][0] > t):
                    idle = sorted(self.kicks, key=self.order.__getitem__)
                    self.kicks.clear()
                    for inst in idle:
                        if not inst.busy:
                            self.start_step(inst)
            if self.mon is not None and self.violation is None:
                ends = self.mon.finish()
                if ends:
                    v = ends[0]
                    self.violation = {
                        "invariant": v.invariant,
                        "request": v.request,
                        "time_s": self.now,
                        "message": v.message,
                        "event": None,
                    }
            if self.violation is None:
                self.self_check()
        except _Abort:
            pass
        wall = _time.perf_counter() - wall0
        for inst in self.insts:
            self.account(inst)
        if self.metrics is not None:
            for inst in self.insts:
                self.metrics.busy(inst.name, inst.busy_time)
            for k, count in self.faults.items():
                if count:
                    self.metrics.count(k, count)
        return self.result(wall)

    def next_arrival(self) -> None:
        r = next(self.it, None)
        if r is not None:
            self.n += 1
            if self.first_arrival is None:
                self.first_arrival = r.arrival
            self.push(r.arrival, _ARRIVE, r)

    # -- arrival, cancellation, rejection --------------------------------------

    def self_check(self) -> None:
        """Conservation and Little's law on the run that just ended (cheap:
        the counts are kept as it runs).  Every request that arrived ended
        exactly once in one outcome; every KV block is back in its pool; and
        the time integral of the number of requests in the system equals the
        summed sojourn of the requests (L = λW on the sample path, with both
        sides measured separately)."""
        if self.finished != self.n or self.ended_twice or self.two_outcomes:
            raise SimulationCheckError(
                "conservation",
                f"{self.n} request(s) arrived, {self.finished} end(s) recorded, "
                f"{self.ended_twice} ended twice, {self.two_outcomes} in two outcomes",
            )
        for inst in self.insts:
            free = inst.free
            if len(free) != inst.nblocks or len(set(free)) != inst.nblocks:
                raise SimulationCheckError(
                    "kv-returned",
                    f"{inst.name} has {len(set(free))} distinct free block(s) "
                    f"({len(free)} entries) of {inst.nblocks} after every request ended",
                )
        if abs(self.sys_area - self.sojourn) > 1e-9 * max(1.0, self.sojourn):
            raise SimulationCheckError(
                "littles-law",
                f"the number in the system integrates to {self.sys_area!r} request-seconds, "
                f"the requests' sojourns sum to {self.sojourn!r}",
            )

    def in_system(self, k: int) -> None:
        """The number of requests in the system changes by ``k`` now."""
        now = self.now
        self.sys_area += self.in_sys * (now - self.sys_t)
        self.sys_t = now
        self.in_sys += k

    def arrive(self, raw: Any) -> None:
        r = _Req(raw)
        self.in_system(1)
        cfg = self.cfg
        if r.cancel_at is not None and r.cancel_phase is None:
            self.push(max(r.cancel_at, self.now), _CANCEL, r)
        if cfg.arm == "pd":
            if self.ev_on:
                self.emit(Submit.unchecked(r.id, 0, r.plen, r.out), r)
            need_p = _blocks_for(r.plen, self.bs)
            if need_p > self.P[0].nblocks or need_p + 1 > self.D[0].nblocks:
                self.reject(r, "prompt larger than an instance's KV")
                return
            if cfg.max_queue is not None and len(self.rq) >= cfg.max_queue:
                self.reject(r, "queue full")
                return
            self.enqueue_rq(r)
        else:
            if _blocks_for(r.plen + 1, self.bs) > self.C[0].nblocks:
                self.reject(r, "prompt larger than an instance's KV")
                return
            inst = min(self.C, key=lambda i: len(i.waiting) + len(i.running) + len(i.prefilling))
            if cfg.max_queue is not None and len(inst.waiting) >= cfg.max_queue:
                self.reject(r, "queue full")
                return
            self.account(inst)
            inst.waiting.append(r)
            inst.qtok += r.plen
            if inst.mends is not None:
                self.interrupt(inst)
            r.state = _PQ
            r.p = inst
            if cfg.queue_timeout_s is not None:
                self.push(self.now + cfg.queue_timeout_s, _QTIMEOUT, r, r.gen)
            if r.cancel_phase == "queued":
                self.enter(r, "queued")
                if r.cancelled:
                    return
            if not inst.busy:
                self.kicks.add(inst)

    def rq_account(self) -> None:
        """Integrate the reservation queue's length up to now (called before it changes)."""
        now = self.now
        self.rq_area += len(self.rq) * (now - self.rq_t)
        self.rq_t = now

    def enqueue_rq(self, r: _Req, front: bool = False) -> None:
        r.state = _RQ
        self.rq_account()
        if front:
            self.rq.appendleft(r)
        else:
            self.rq.append(r)
        if self.cfg.queue_timeout_s is not None and r.first is None:
            self.push(self.now + self.cfg.queue_timeout_s, _QTIMEOUT, r, r.gen)
        if r.cancel_phase == "queued":
            self.enter(r, "queued")
            if r.cancelled:
                return
        self.drain_rq()

    def drain_rq(self) -> None:
        """Reserve D blocks for the head of the reservation queue while some D has room (FIFO)."""
        rq = self.rq
        if rq:
            self.rq_account()  # (what follows happens at this instant)
        while rq:
            r = rq[0]
            if r.state != _RQ or r.cancelled:
                rq.popleft()
                continue
            need = _blocks_for(r.plen, self.bs)
            if need + 1 > self.D[0].nblocks:  # a retry's recomputed prompt outgrew D
                rq.popleft()
                self.give_up(r, "recomputed prompt larger than a decode instance's KV")
                continue
            d = max(self.D, key=lambda i: len(i.free))
            if len(d.free) < need + 1:  # + 1: room for the first decode's block growth
                return
            rq.popleft()
            self.account(d)
            r.d = d
            r.dblocks = self.alloc(d, need)  # type: ignore[assignment]
            r.ticket = f"t-{r.id}-{r.gen}"
            if self.ev_on:
                self.emit(Reserve.unchecked(r.id, r.gen, r.ticket, d.name, tuple(r.dblocks)), r)
            p = min(self.P, key=lambda i: i.qtok)
            self.account(p)
            r.p = p
            r.state = _PQ
            p.waiting.append(r)
            p.qtok += r.plen
            if not p.busy:
                self.kicks.add(p)

    def reject(self, r: _Req, why: str) -> None:
        if r.state == _RQ and self.cfg.arm == "pd":
            self.rq_account()
            try:
                self.rq.remove(r)
            except ValueError:
                pass
        elif r.state == _PQ:
            inst = r.p
            assert inst is not None  # set when it was queued (a rejection: not a hot path)
            self.account(inst)
            try:
                inst.waiting.remove(r)
                inst.qtok -= r.plen
            except ValueError:
                pass
            if self.cfg.arm == "pd":
                assert r.d is not None  # PD: reserved before it was queued on a P
                self.release(r.d, r.dblocks, r)
        r.rejected = True
        self.faults["rejected"] += 1
        self.why_rejected[why] += 1
        if self.ev_on:
            self.emit(Fail.unchecked(r.id, r.gen, "rejected: " + why), r)
        self.done(r)

    def enter(self, r: _Req, phase: str) -> None:
        """``r``, whose cancel waits for ``phase``, entered it: the cancel fires
        at max(cancel_at, now) if ``r`` is still in that phase then."""
        if r.cancelled or r.state == _DONE:
            return
        if r.cancel_at is None or r.cancel_at <= self.now:
            self.cancel(r)
        else:
            self.push(r.cancel_at, _CANCEL, r, phase)

    def cancel(self, r: _Req) -> None:
        """A client cancel: the generation ends now; what it holds is released
        at once where nothing reads or writes it, else when that ends."""
        if r.state == _DONE or r.cancelled:
            return
        r.cancelled = True
        self.faults["cancelled"] += 1
        pd = self.cfg.arm == "pd"
        if pd and self.ev_on:
            self.emit(Cancel.unchecked(r.id, r.gen, "client"), r)
        st = r.state
        if st == _RQ:
            self.rq_account()
            try:
                self.rq.remove(r)  # (at once: the queue's length and --max-queue count live requests)
            except ValueError:
                pass
            self.done(r)
        elif st == _PQ:
            inst = r.p
            assert inst is not None  # set when it was queued (a cancel: not a hot path)
            self.account(inst)
            inst.waiting.remove(r)
            inst.qtok -= r.plen
            if pd:
                assert r.d is not None  # PD: reserved before it was queued on a P
                self.release(r.d, r.dblocks, r)
            else:
                self.release(inst, r.dblocks, r)
            self.done(r)
        elif st == _COORD:
            assert r.p is not None and r.d is not None  # prefilled on P, reserved on D
            self.release(r.p, r.pblocks, r)
            self.release(r.d, r.dblocks, r)
            self.done(r)
        elif st == _XFER:
            # abort, wait for the data plane to stop (here: at once), then free both ends
            if self.ev_on:
                self.emit(TransferAbort.unchecked(r.xid), r)
            self.stop_transfer(r)
            if self.ev_on:
                self.emit(TransferFailed.unchecked(r.xid), r)
            assert r.p is not None and r.d is not None  # transferring from P to D
            self.release(r.p, r.pblocks, r)
            self.release(r.d, r.dblocks, r)
            self.done(r)
        elif st == _DEC:
            inst = r.di
            if r in inst.pending:
                inst.pending.remove(r)
                self.release(inst, r.dblocks, r) if pd else self.drop(inst, r)
                self.done(r)
            else:
                inst.cancels.append(r)  # leaves at the end of the step in progress
                self.interrupt(inst)
        # _PRE: the step in progress ends first (step_done drops it)

    def give_up(self, r: _Req, why: str) -> None:
        """The request fails: it can never be served."""
        r.failed = True
        self.why_failed[why] += 1
        if self.ev_on:
            self.emit(Fail.unchecked(r.id, r.gen, why), r)
        self.done(r)

    def done(self, r: _Req) -> None:
        if r.state == _DONE:
            self.ended_twice += 1
        if r.rejected + r.cancelled + r.failed > 1:
            self.two_outcomes += 1
        r.state = _DONE
        self.finished += 1
        self.in_system(-1)
        self.sojourn += self.now - r.arrival
        if r.failed:
            self.faults["failed"] += 1
        if self.sink is not None:
            self.sink(
                self.record(
                    id=r.id,
                    arm=self.cfg.arm,
                    arrival=r.arrival,
                    prompt_len=r.prompt0,
                    output_len=r.out,
                    first_token=r.first,
                    finish=self.now if not (r.rejected or r.failed or r.cancelled) else None,
                    token_times=tuple(r.times),
                    rejected=r.rejected,
                    cancelled=r.cancelled,
                    failed=r.failed,
                    retries=r.retries,
                    prefill_start=r.pstart,
                    transfer_start=r.xs,
                    transfer_end=r.xe,
                )
            )

    # -- steps ------------------------------------------------------------------
    #
    # Decoding is kept per instance, not per token: ``k`` counts the decode
    # steps an instance started, ``dtimes`` holds their end times (from index
    # ``dbase``), and a sequence that joined at step ``j`` has its tokens at
    # ``dtimes[j:]``.  ``ends[s]`` and ``grows[s]`` list the sequences whose
    # last token comes at step ``s`` and that need a new KV block before step
    # ``s``; entries carry the sequence's epoch (``ep``), so a sequence that
    # left (preempted, cancelled) is skipped.  A step costs O(1) plus the
    # sequences that join, grow or leave at it.

    def start_step(self, inst: _Inst) -> None:
        """Start the next step of an idle instance, if it has work."""
        if inst.last < self.now:  # (a step that just ended has been accounted)
            self.account(inst)
        role = inst.role
        if role == "decode":
            dur = self.decode_batch(inst)
            batch = _DSTEP
        elif role == "prefill":
            dur, batch = self.prefill_batch(inst, self.cfg.max_batch_tokens)
        elif self.cfg.arm == "colocated":
            dur, batch = self.prefill_batch(inst, self.cfg.max_batch_tokens)
            if dur is None:
                dur = self.decode_batch(inst)
                batch = _DSTEP
        else:
            dur, batch = self.chunked_batch(inst)
        if dur is None:
            inst.busy = False
            inst.batch = None
            return
        inst.busy = True
        inst.batch = batch
        inst.busy_time += dur
        inst.steps += 1
        used = inst.nblocks - len(inst.free)
        if used > inst.peak_kv:
            inst.peak_kv = used
        inst.version += 1
        self.push(self.now + dur, _STEP, inst, inst.version)

    def prefill_batch(self, inst: _Inst, cap: int) -> tuple[float | None, Any]:
        """Admit waiting prompts while blocks and ``cap`` tokens allow."""
        waiting = inst.waiting
        if not waiting:
            return None, None
        pre: list[_Req] = []
        tokens = sq = 0
        bs = self.bs
        pd = inst.role == "prefill"
        room = self.cfg.max_batch_seqs - len(inst.running) - len(inst.pending)
        while waiting and room > 0:
            r = waiting[0]
            if pre and tokens + r.plen > cap:
                break
            need = _blocks_for(r.plen if pd else r.plen + 1, bs)
            if len(inst.free) < need:
                break
            waiting.popleft()
            inst.qtok -= r.plen
            blocks = self.alloc(inst, need)
            if pd:
                r.pblocks = blocks  # type: ignore[assignment]
                if self.ev_on:
                    self.emit(PrefillStart.unchecked(r.id, r.gen, inst.name, tuple(blocks)), r)  # type: ignore[arg-type]
            else:
                r.dblocks = blocks  # type: ignore[assignment]
            r.state = _PRE
            if r.first is None:
                r.pstart = self.now
            tokens += r.plen
            sq += r.plen * r.plen
            pre.append(r)
            room -= 1
        if not pre:
            return None, None
        for r in pre:
            if r.cancel_phase == "prefill":
                self.enter(r, "prefill")
        dur = inst.lat.step(tokens, sq, 0, 0)
        for r in pre:
            r.pre_dur = dur
        return dur, ("p", pre)

    def join(self, inst: _Inst, r: _Req) -> None:
        """``r`` (first token produced, KV of ``plen`` positions in
        ``dblocks``) decodes on ``inst`` from its next decode step."""
        r.state = _DEC
        r.di = inst
        inst.pending.append(r)
        if inst.mends is not None:
            self.interrupt(inst)
        if r.cancel_phase == "decode":
            self.enter(r, "decode")

    def admit_pending(self, inst: _Inst) -> None:
        s = inst.k
        bs = self.bs
        for r in inst.pending:
            r.j = s
            inst.running[r] = None
            inst.ctx += r.plen
            left = r.out - r.produced  # decodes still to run
            last = s + left - 1
            heapq.heappush(inst.eheap, last)
            ends = inst.ends.get(last)
            if ends is None:
                inst.ends[last] = [(r, r.ep)]
            else:
                ends.append((r, r.ep))
            d = len(r.dblocks) * bs - r.plen  # first decode index needing a new block
            if d < left:
                self.want_block(inst, r, s + d)
        inst.first.extend(inst.pending)
        inst.pending.clear()

    def want_block(self, inst: _Inst, r: _Req, step: int) -> None:
        g = inst.grows.get(step)
        if g is None:
            inst.grows[step] = [(r, r.ep)]
        else:
            g.append((r, r.ep))

    def grow(self, inst: _Inst) -> None:
        """Give the sequences whose next token starts a block a new block,
        preempting the most recently admitted sequences when none is free."""
        g = inst.grows.pop(inst.k, None)
        if not g:
            return
        running = inst.running
        pd = inst.role == "decode"
        bs = self.bs
        for r, ep in g:
            if r.ep != ep or r.state != _DEC:
                continue
            while not inst.free:
                victim = next(reversed(running))
                self.preempt(inst, victim)
                if victim is r:
                    break
            if r.ep != ep:
                continue
            b = inst.free.pop()
            r.dblocks.append(b)
            if pd and self.ev_on:
                self.emit(Alloc.unchecked(r.id, r.gen, inst.name, (b,)), r)
            nxt = inst.k + bs
            if nxt - r.j < r.out - r.produced:
                self.want_block(inst, r, nxt)

    def leave(self, inst: _Inst, r: _Req, steps: int) -> None:
        """``r`` leaves the running set after ``steps`` decode steps since it joined."""
        del inst.running[r]
        r.ep += 1
        base = inst.dbase
        r.times.extend(inst.dtimes[r.j - base : r.j + steps - base])
        r.produced += steps
        inst.ctx -= r.plen + steps

    def preempt(self, inst: _Inst, r: _Req) -> None:
        inst.preempted += 1
        self.faults["preempted"] += 1
        self.leave(inst, r, inst.k - r.j)
        if inst.role == "decode":
            if self.ev_on:
                self.emit(Fail.unchecked(r.id, r.gen, "preempted"), r)
            self.release(inst, r.dblocks, r)
            self.new_generation(r)
        else:
            inst.free.extend(r.dblocks)
            r.dblocks = []
            r.plen = r.prompt0 + r.produced
            if _blocks_for(r.plen + 1, self.bs) > inst.nblocks:
                self.give_up(r, "recomputed prompt larger than an instance's KV")
                return
            self.faults["recomputed_tokens"] += r.plen
            r.done_pre = 0
            r.state = _PQ
            inst.waiting.appendleft(r)
            inst.qtok += r.plen

    def new_generation(self, r: _Req) -> None:
        """Retry the request as a new generation: recompute its prompt and the
        tokens it produced, through the whole handoff."""
        r.gen += 1
        r.plen = r.prompt0 + r.produced
        self.faults["recomputed_tokens"] += r.plen
        r.will_fail = False
        if self.ev_on:
            self.emit(Submit.unchecked(r.id, r.gen, r.plen, r.out - r.produced), r)
        self.enqueue_rq(r, front=True)

    def decode_batch(self, inst: _Inst) -> float | None:
        if inst.pending:
            self.admit_pending(inst)
        if not inst.running:
            return None
        self.grow(inst)
        if not inst.running:
            inst.first.clear()
            return None
        n = inst.ndec = len(inst.running)
        s = inst.k
        ctx = inst.ctx
        step = inst.lat.step
        k = 1
        if not inst.first and not self.all_decodes and (inst.role == "decode" or not inst.waiting):
            k = self.macro_len(inst, s)
        if k == 1:
            inst.k += 1
            inst.mends = None
            return step(0, 0, n, ctx)
        # a macro-step: k steps with nobody joining, leaving or short of a block
        lat = inst.lat
        if hasattr(lat, "decode_ends"):
            ends = lat.decode_ends(n, ctx, k, self.now)
        else:  # a latency model with only step()
            ends = []
            t = self.now
            for i in range(k):
                t += step(0, 0, n, ctx + i * n)
                ends.append(t)
        inst.k += k
        inst.mends = ends
        return ends[-1] - self.now

    def macro_len(self, inst: _Inst, s: int) -> int:
        """How many decode steps from step ``s`` on can run as one event: up
        to the step at which the next sequence ends, and before the next step
        at which one needs a new block (its allocation, or a preemption,
        happens exactly there)."""
        heap = inst.eheap
        ends = inst.ends
        while heap and (heap[0] < s or heap[0] not in ends):
            heapq.heappop(heap)
        k = min(_MACRO, heap[0] - s + 1) if heap else _MACRO
        grows = inst.grows
        if grows:
            for i in range(s + 1, s + k):
                if i in grows:
                    return i - s
        return k

    def interrupt(self, inst: _Inst) -> None:
        """Something changed for ``inst`` (a sequence joins or is cancelled, a
        prompt arrives): end its macro-step at the end of the step in progress."""
        m = inst.mends
        if m is None or not inst.busy:
            return
        i = bisect.bisect_left(m, self.now)
        if i >= len(m) - 1:
            return
        drop = len(m) - 1 - i
        inst.k -= drop
        inst.busy_time -= m[-1] - m[i]
        del m[i + 1 :]
        inst.version += 1
        self.push(m[i], _STEP, inst, inst.version)

    def chunked_batch(self, inst: _Inst) -> tuple[float | None, Any]:
        if inst.pending:
            self.admit_pending(inst)
        if inst.running:
            self.grow(inst)
        running = inst.running
        budget = self.cfg.chunk_tokens - len(running)
        chunks: list[tuple[_Req, int]] = []
        tokens = sq = 0
        pref = inst.prefilling
        waiting = inst.waiting
        room = self.cfg.max_batch_seqs - len(running) - len(pref)
        # admit new prompts (their whole prompt's blocks) while the budget lasts
        while waiting and room > 0 and budget > sum(r.plen - r.done_pre for r in pref):
            r = waiting[0]
            need = _blocks_for(r.plen + 1, self.bs)
            if len(inst.free) < need:
                break
            waiting.popleft()
            inst.qtok -= r.plen
            r.dblocks = self.alloc(inst, need)  # type: ignore[assignment]
            r.state = _PRE
            r.done_pre = 0
            if r.first is None:
                r.pstart = self.now
            pref.append(r)
            room -= 1
            if r.cancel_phase == "prefill":
                self.enter(r, "prefill")
        for r in pref:
            if budget <= 0:
                break
            c = min(budget, r.plen - r.done_pre)
            k = r.done_pre
            chunks.append((r, c))
            tokens += c
            sq += (k + c) * (k + c) - k * k
            budget -= c
        if not running and not chunks:
            return None, None
        n = len(running)
        if n:
            inst.k += 1
        else:
            inst.first.clear()
        inst.ndec = n
        return inst.lat.step(tokens, sq, n, inst.ctx), ("c", chunks)

    def step_done(self, inst: _Inst) -> None:
        batch = inst.batch
        self.account(inst)
        if batch is _DSTEP or (batch[0] == "c" and inst.ndec):
            self.decoded(inst)
        if batch is not _DSTEP:
            if batch[0] == "p":
                for r in batch[1]:
                    self.prefilled(inst, r)
            else:
                pref = inst.prefilling
                for r, c in batch[1]:
                    if r.cancelled:
                        continue
                    r.done_pre += c
                    if r.done_pre >= r.plen:
                        pref.remove(r)
                        self.prefilled(inst, r)
                for r in [r for r in pref if r.cancelled]:
                    pref.remove(r)
                    inst.free.extend(r.dblocks)
                    r.dblocks = []
                    self.done(r)
        if inst.cancels:
            for r in inst.cancels:
                if r.state == _DEC and r.di is inst:
                    self.leave(inst, r, inst.k - r.j)
                    self.release(inst, r.dblocks, r) if inst.role == "decode" else self.drop(inst, r)
                    self.done(r)
            inst.cancels.clear()
        inst.busy = False
        self.start_step(inst)

    def drop(self, inst: _Inst, r: _Req) -> None:
        inst.free.extend(r.dblocks)
        r.dblocks = []

    def first_token(self, r: _Req, now: float) -> None:
        r.produced += 1
        r.times.append(now)
        if r.first is None:
            r.first = now

    def decoded(self, inst: _Inst) -> None:
        """A decode step ended: every running sequence has one more token."""
        now = self.now
        s = inst.k - 1
        m = inst.mends
        if m is None:
            inst.dtimes.append(now)
            inst.ctx += inst.ndec
        else:
            inst.dtimes.extend(m)
            inst.ctx += inst.ndec * len(m)
            inst.mends = None
        pd = inst.role == "decode"
        ev = self.ev_on
        if ev:
            if self.all_decodes:
                for r in inst.running:
                    if r.cancelled:
                        continue
                    d = s - r.j
                    tok = r.produced + d
                    self.emit(
                        Decode.unchecked(r.id, r.gen, inst.name, r.plen + d, tok, tok + 1, tuple(r.dblocks)),
                        r,
                    )
            else:
                for r in inst.first:
                    if r.state == _DEC and not r.cancelled:
                        tok = r.produced
                        self.emit(
                            Decode.unchecked(r.id, r.gen, inst.name, r.plen, tok, tok + 1, tuple(r.dblocks)),
                            r,
                        )
        inst.first.clear()
        ends = inst.ends.pop(s, None)
        if ends:
            for r, ep in ends:
                if r.ep != ep or r.state != _DEC or r.cancelled:
                    continue
                self.leave(inst, r, s + 1 - r.j)
                if pd:
                    if ev:
                        self.emit(Finish.unchecked(r.id, r.gen, "length"), r)
                    self.release(inst, r.dblocks, r)
                else:
                    self.drop(inst, r)
                self.done(r)
        if len(inst.dtimes) > 8192:
            self.trim(inst)

    def trim(self, inst: _Inst) -> None:
        """Drop the step times no live sequence needs any more."""
        keep = min((r.j for r in inst.running), default=inst.k) - inst.dbase
        if keep > 0:
            del inst.dtimes[:keep]
            inst.dbase += keep

    def prefilled(self, inst: _Inst, r: _Req) -> None:
        """A prompt's prefill ended on ``inst``."""
        pd = inst.role == "prefill"
        if r.cancelled:
            if pd:
                assert r.d is not None  # PD: reserved before its prefill (a cancel: not a hot path)
                self.release(inst, r.pblocks, r)
                self.release(r.d, r.dblocks, r)
            else:
                self.drop(inst, r)
            self.done(r)
            return
        self.first_token(r, self.now)
        if pd and self.ev_on:
            self.emit(PrefillDone.unchecked(r.id, r.gen, inst.name, r.produced, r.plen), r)
        if r.produced >= r.out:
            if pd:
                if self.ev_on:
                    self.emit(Finish.unchecked(r.id, r.gen, "length"), r)
                assert r.d is not None  # PD: reserved before its prefill (one-token output: rare)
                self.release(inst, r.pblocks, r)
                self.release(r.d, r.dblocks, r)
            else:
                self.drop(inst, r)
            self.done(r)
            return
        if not pd:
            self.join(inst, r)
            return
        r.state = _COORD
        self.push(self.now + self.cfg.coord_ms / 1e3, _XSTART, r, r.gen)

    # -- transfers ----------------------------------------------------------------

    def xfer_start(self, r: _Req, gen: int) -> None:
        if r.state != _COORD or r.gen != gen:
            return
        cfg = self.cfg
        r.state = _XFER
        r.xid = f"x-{r.id}-{r.gen}"
        r.xready = self.now
        if r.xe is None:
            r.xs = self.now
        if self.ev_on:
            self.emit(
                TransferStart.unchecked(
                    r.xid,
                    r.ticket,
                    r.id,
                    r.gen,
                    r.p.name,  # type: ignore[union-attr]  # _COORD: prefilled on r.p
                    tuple(r.pblocks),
                    r.d.name,  # type: ignore[union-attr]  # _COORD: reserved on r.d
                    tuple(r.dblocks),
                ),
                r,
            )
        nbytes = float(self.kv_tok * r.plen)
        eg: _Egress = r.p.egress  # type: ignore[union-attr, assignment]  # r.p: a P instance, egress set
        if cfg.layerwise:
            share = eg.bw / (len(eg.active) + 1)
            nbytes = max(nbytes / self.layers, nbytes - r.pre_dur * share)
        r.xbytes = nbytes
        r.will_fail = cfg.transfer_fail_rate > 0 and self.rng.random() < cfg.transfer_fail_rate
        if cfg.transfer_timeout_ms is not None:
            self.push(self.now + cfg.transfer_timeout_ms / 1e3, _TIMEOUT, r, r.gen)
        self.push(self.now + cfg.latency_ms / 1e3, _XJOIN, r, r.gen)
        if r.cancel_phase == "transfer":
            self.enter(r, "transfer")

    def advance(self, eg: _Egress) -> None:
        """Charge the active transfers of ``eg`` for the time since its last change."""
        if eg.active:
            dt = self.now - eg.last
            if dt > 0:
                done = dt * eg.bw / len(eg.active)
                act = eg.active
                for k in act:
                    act[k] -= done
        eg.last = self.now

    def reschedule(self, eg: _Egress) -> None:
        eg.version += 1
        if eg.active:
            left = min(eg.active.values())
            n = len(eg.active)
            self.push(self.now + max(left, 0.0) * n / eg.bw, _XDONE, eg, eg.version)

    def xfer_join(self, r: _Req) -> None:
        eg: _Egress = r.p.egress  # type: ignore[union-attr, assignment]  # r.p: a P instance, egress set
        self.advance(eg)
        eg.active[r] = r.xbytes
        if len(eg.active) > eg.peak:
            eg.peak = len(eg.active)
        self.reschedule(eg)

    def stop_transfer(self, r: _Req) -> None:
        assert r.p is not None  # transferring from r.p (a cancel or a timeout: not a hot path)
        eg = r.p.egress
        assert eg is not None  # a P instance
        if r in eg.active:
            self.advance(eg)
            del eg.active[r]
            self.reschedule(eg)

    def egress_done(self, eg: _Egress) -> None:
        self.advance(eg)
        # done: what is left is under a byte, or would take under a nanosecond (a time step
        # the clock may not resolve: without this a very fast link could loop on one instant)
        tol = max(1.0, eg.bw * 1e-9 / max(1, len(eg.active)))
        for r in [r for r, left in eg.active.items() if left <= tol]:
            del eg.active[r]
            self.landed(r)
        self.reschedule(eg)

    def landed(self, r: _Req) -> None:
        # the transfer ran to its end: counted here, once, with the time an
        # uncontended link would have taken (queueing = the difference)
        took = self.now - r.xready
        ideal = self.cfg.latency_ms / 1e3 + r.xbytes / r.p.egress.bw  # type: ignore[union-attr]  # P, egress set
        nbytes = int(self.kv_tok * r.plen)
        x = self.xfer
        x["count"] += 1
        x["bytes"] += nbytes
        x["time"] += took
        x["ideal"] += ideal
        if self.metrics is not None:
            self.metrics.transfer(nbytes, max(0.0, took - ideal), took)
        if r.will_fail:
            self.faults["transfer_failures"] += 1
            self.xfer_fail(r, timeout=False)
            return
        if r.xe is None:
            r.xe = self.now
        ev = self.ev_on
        p: _Inst
        d: _Inst
        p, d = r.p, r.d  # type: ignore[assignment]  # _XFER: both ends are set
        if ev:
            self.emit(TransferReadDone.unchecked(r.xid), r)
        self.release(p, r.pblocks, r)
        if ev:
            self.emit(TransferWriteDone.unchecked(r.xid), r)
            self.emit(Commit.unchecked(r.id, r.gen, r.ticket, d.name), r)
        self.account(d)
        self.join(d, r)
        if not d.busy:
            self.kicks.add(d)

    def xfer_fail(self, r: _Req, timeout: bool) -> None:
        """The transfer failed (or timed out and was aborted): end the
        generation, free both ends, retry with a new generation."""
        ev = self.ev_on
        if timeout:
            if ev:
                self.emit(TransferAbort.unchecked(r.xid), r)
            self.stop_transfer(r)
        if ev:
            self.emit(TransferFailed.unchecked(r.xid), r)
            self.emit(Fail.unchecked(r.id, r.gen, "transfer timeout" if timeout else "transfer failed"), r)
        assert r.p is not None and r.d is not None  # transferring from P to D (a fault: not a hot path)
        self.release(r.p, r.pblocks, r)
        self.release(r.d, r.dblocks, r)
        # the first token of this generation was delivered; the retry recomputes it with the prompt
        if r.retries >= self.cfg.max_retries:
            r.failed = True
            why = ("transfer timeout" if timeout else "transfer failed") + ", retries exhausted"
            self.why_failed[why] += 1
            self.done(r)
        else:
            r.retries += 1
            self.faults["retries"] += 1
            self.new_generation(r)

    # -- results ------------------------------------------------------------------

    def sample(self, until: float) -> None:
        """Record the pools at every sample time before ``until`` (the state
        has not changed since the last event, so it holds for all of them)."""
        dt = self.sample_dt
        ts = self.next_sample
        if (until - ts) / dt > 10_000:  # type: ignore[operator]
            ts = until  # a long quiet stretch: one sample, not thousands
        if ts > until:
            return
        # the pools have not changed since the last event: one reading serves every sample time
        rows = []
        for name, pool in self.pools.items():
            q = sum(len(i.waiting) for i in pool) + (len(self.rq) if name == "prefill" else 0)
            kv = sum(i.nblocks - len(i.free) for i in pool) / sum(i.nblocks for i in pool)
            busy = sum(1 for i in pool if i.busy) / len(pool)
            rows.append((name, q, kv, busy))
        metrics = self.metrics
        if metrics is not None:
            gauges = self.gauges
            if gauges is None:  # made once, in the order the summary lists them
                gauges = self.gauges = []
                for name, pool in self.pools.items():
                    cap = pool[0].nblocks * len(pool)
                    gauges.append(
                        (metrics.gauge(name + ".queue").set, metrics.gauge(name + ".kv_blocks", cap).set, cap)
                    )
        samples = self.samples
        while ts <= until:
            for name, q, kv, busy in rows:
                samples.append((ts, name, q, kv, busy))
            if metrics is not None:
                for (set_q, set_kv, cap), (_, q, kv, _) in zip(gauges, rows):  # type: ignore[arg-type]  # set above when metrics is not None
                    set_q(ts, q)
                    set_kv(ts, kv * cap)
            if len(self.samples) > 8000:  # bounded: keep every other sample time, sample half as often
                per = len(self.pools)  # one row per pool at each sample time, the pools in a fixed order
                self.samples = samples = [
                    row for i in range(0, len(samples), 2 * per) for row in samples[i : i + per]
                ]
                self.sample_dt = dt = dt * 2  # type: ignore[operator]
            ts += dt  # type: ignore[operator]
        self.next_sample = ts

    def result(self, wall: float) -> SimResult:
        start = self.first_arrival or 0.0
        dur = max(self.now - start, 1e-12)
        pools = {}
        for name, pool in self.pools.items():
            tp = self.cfg.tp_p if name == "prefill" else self.cfg.tp_d if name == "decode" else self.cfg.tp
            if name == "prefill":
                self.rq_account()
            pools[name] = {
                "instances": len(pool),
                "devices": len(pool) * tp,
                "tp": tp,
                "kv_blocks": pool[0].nblocks,
                "utilisation": sum(i.busy_time for i in pool) / (len(pool) * dur),
                "utilisation_per_instance": [i.busy_time / dur for i in pool],
                # requests waiting to be scheduled, summed over the pool (a prefill
                # pool: plus those waiting for a D reservation), as its samples count
                "mean_queue": (sum(i.q_area for i in pool) + (self.rq_area if name == "prefill" else 0.0))
                / dur,
                "mean_kv_occupancy": sum(i.kv_area for i in pool) / dur / sum(i.nblocks for i in pool),
                "peak_kv_occupancy": max(i.peak_kv / i.nblocks for i in pool),
                "preempted": sum(i.preempted for i in pool),
                "steps": sum(i.steps for i in pool),
            }
            if name == "prefill":
                pools[name]["mean_reservation_queue"] = self.rq_area / dur  # (its part of mean_queue)
        x = self.xfer
        transfers = {
            "count": x["count"],
            "bytes": x["bytes"],
            "mean_ms": x["time"] / x["count"] * 1e3 if x["count"] else 0.0,
            "mean_queueing_ms": max(0.0, x["time"] - x["ideal"]) / x["count"] * 1e3 if x["count"] else 0.0,
            "peak_concurrent": max((p.egress.peak for p in self.P), default=0)  # type: ignore[union-attr]  # P instances have an egress
            if self.cfg.arm == "pd"
            else 0,
            "bandwidth_gibps": self.cfg.bandwidth_gibps * self.cfg.links,
            "layerwise": self.cfg.layerwise,
        }
        if self.in_sys:
            self.in_system(0)  # (a run that stopped early: integrate to its end)
        return SimResult(
            self.cfg,
            self.n,
            self.finished,
            dur,
            wall,
            pools,
            transfers,
            dict(self.faults),
            self.events,
            self.violation,
            tuple(self.samples),
            dict(self.why_rejected),
            dict(self.why_failed),
            self.sys_area / dur,
        )
