"""The vLLM adapter: pdproto's actions on vLLM's real scheduler and NIXL
connector, and the history events observed from their real state.

See docs/adapters/vllm.md for the mapping table (vLLM hook or state change
-> pdproto event), the actions, and the triage of what fuzzing finds.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ...protocol import Action, ActionNotEnabled
from ...spec import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Event,
    Fail,
    Finish,
    Free,
    HistoryHeader,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
    WorkerSpec,
)
from ._harness import VllmHarness

__all__ = ["VllmAdapter", "KNOWN"]

_LEASE = (
    "P's KV lease (kv_lease_duration) runs out while D still reads: P's worker reports the request "
    "as finished_sending and the scheduler frees the source blocks (compare vllm-project/vllm#21570); "
    "only under the fault 'expire' (D stalled past the lease, its heartbeats lost)"
)
_STUCK = (
    "D has no deadline of its own for a remote KV load: when the completion never comes (the "
    "report or notification lost, P's WRITE failed, P restarted) the request waits in "
    "WAITING_FOR_REMOTE_KVS until the client aborts it"
)

#: family -> invariant id -> a real vLLM behaviour that breaks it, one line
#: (docs/adapters/vllm.md has the reproducing histories)
KNOWN: Mapping[str, Mapping[str, str]] = {
    "pull": {
        "early-source-free": _LEASE,
        "foreign-block-access": (
            "P's lease ran out (fault 'expire') before D's READ started: P freed the blocks, and D's "
            "scheduler still READs remote_block_ids from them (P only logs 'Potentially invalid KV "
            "blocks for unrecognized request')"
        ),
        "leak": (
            "a request aborted at D while WAITING_FOR_REMOTE_KVS keeps its blocks until the READ's "
            "late finished_recving (compare vllm-project/vllm#32255); when that report is lost the "
            "blocks are held forever"
        ),
        "stuck": _STUCK,
    },
    "push": {
        "early-source-free": _LEASE,
        "leak": (
            "a request aborted at D while WAITING_FOR_REMOTE_KVS keeps its blocks until P's WRITE "
            "completes; when no WRITE comes (P aborted before prefill, P restarted, the WRITE failed "
            "or its notification was lost) the blocks are held forever"
        ),
        "resurrection": (
            "an abort after P finished prefill does not reach P's worker: it still matches D's "
            "registration and WRITEs the cancelled generation's KV into D's (still held) blocks"
        ),
        "stuck": _STUCK,
    },
}


class _Gen:
    """One generation of one request, as the router (the proxy in front of P
    and D) sees it."""

    __slots__ = (
        "request",
        "gen",
        "prompt",
        "max_tokens",
        "p_id",
        "d_id",
        "ticket",
        "transfer",
        "terminal",
        "p_added",
        "d_added",
        "p_inc",
        "d_inc",
        "reserved",
        "committed",
    )

    def __init__(self, request: str, gen: int, prompt: list[int], max_tokens: int) -> None:
        self.request = request
        self.gen = gen
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.p_id = f"{request}.{gen}-p"
        self.d_id = f"{request}.{gen}-d"
        self.ticket = f"t-{request}-{gen}"
        self.transfer = f"x-{request}-{gen}"
        self.terminal: str | None = None
        self.p_added = False
        self.d_added = False
        self.p_inc = 0  # P's incarnation that computed the KV
        self.d_inc = 0  # D's incarnation that holds the target blocks
        self.reserved = False
        self.committed = False


class VllmAdapter:
    """vLLM's real P and D schedulers with the NIXL connector (``family``
    ``"pull"``, the default, or ``"push"``), driven by pdproto actions.

    Options: ``requests`` (2), ``prompt_len`` (6 tokens), ``max_tokens`` (3
    decode tokens at D), ``block_size`` (4), ``blocks`` (per instance,
    including vLLM's null block 0; 9), ``lease`` (seconds, 30),
    ``max_gen`` (retries per request, 1), ``max_restarts`` (per worker and
    example, 1), ``connector`` (``(class_name, module_path)`` of another
    connector class, e.g. a recording wrapper of NIXL's), ``extra_config``
    (merged into ``kv_connector_extra_config``), ``harness`` (an already
    built :class:`VllmHarness` of the same family to reuse)."""

    #: how far the injected clock moves in one engine step
    STEP_SECONDS = 0.01

    def __init__(
        self,
        family: str = "pull",
        *,
        requests: int = 2,
        prompt_len: int = 6,
        max_tokens: int = 3,
        block_size: int = 4,
        blocks: int = 9,
        lease: int = 30,
        max_gen: int = 1,
        max_restarts: int = 1,
        connector: tuple[str, str | None] | None = None,
        extra_config: dict | None = None,
        harness: VllmHarness | None = None,
    ) -> None:
        self.family = family
        self.name = f"vllm:{family}"
        self.requests = tuple(f"r{i + 1}" for i in range(requests))
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_gen = max_gen
        self.max_restarts = max_restarts
        self.h = harness or VllmHarness(
            family,
            block_size=block_size,
            num_blocks=blocks,
            lease=lease,
            connector=connector,
            extra_config=extra_config,
        )
        self.header = HistoryHeader(
            policy=family,
            complete=True,
            workers={
                "P0": WorkerSpec("prefill", self.h.num_blocks),
                "D0": WorkerSpec("decode", self.h.num_blocks),
            },
            boundary="recompute",
            features={"boundary"},
        )
        self.known: Mapping[str, str] = KNOWN[family]
        self.reset()

    # -- the adapter interface ---------------------------------------------------------

    def reset(self) -> None:
        self.h.reset()
        self.gens: dict[str, _Gen] = {}
        self.by_id: dict[str, _Gen] = {}
        self.incarnation = {"P0": 0, "D0": 0}
        self.restarts = {"P0": 0, "D0": 0}
        self.duplicated: set[tuple[str, str, str]] = set()
        self.idle: dict[str, Hashable] = {}

    def close(self) -> None:
        self.h.close()

    def actions(self) -> Sequence[Action]:
        acts: list[Action] = []
        for r in self.requests:
            if r not in self.gens:
                acts.append(Action("submit", "client", (r,)))
        sig = None
        for side, worker in (("P", "P0"), ("D", "D0")):
            if self._has_work(side):
                sig = sig if sig is not None else self.signature()
                if self.idle.get(side) != sig:
                    acts.append(Action("step", worker, (worker,)))
        for t in self._running():
            g = self.by_id[t.d_id]
            acts.append(Action("complete", "net", (g.request, g.gen)))
        expire = self._expire_target(heartbeats=True)
        if expire is not None and not expire[1]:
            acts.append(Action("expire", "clock", ()))
        # faults
        for r, g in self.gens.items():
            if g.terminal is None:
                acts.append(Action("abort", "client", (r,), fault=True))
        for t in self._running():
            g = self.by_id[t.d_id]
            acts.append(Action("fail_transfer", "net", (g.request, g.gen), fault=True))
        for worker, side in (("P0", "P"), ("D0", "D")):
            for kind, rid in self._notifs(side):
                g = self.by_id.get(rid)
                if g is not None:
                    acts.append(Action("lose", "net", (worker, kind, g.request, g.gen), fault=True))
            for kind, rid in self.h.workers[side].read_notifs:
                g = self.by_id.get(rid)
                if (
                    g is not None
                    and kind in ("done", "read")
                    and (worker, kind, rid) not in self.duplicated
                    and (kind, rid) not in self.h.workers[side].inbox
                ):
                    acts.append(Action("duplicate", "net", (worker, kind, g.request, g.gen), fault=True))
        if expire is not None and expire[1]:
            acts.append(Action("expire", "clock", (), fault=True))
        lost = self._expire_target(heartbeats=False)
        if lost is not None and lost != expire:
            acts.append(Action("expire", "clock", ("heartbeats-lost",), fault=True))
        for worker in ("P0", "D0"):
            if self.restarts[worker] < self.max_restarts:
                acts.append(Action("restart", worker, (worker,), fault=True))
        for r, g in self.gens.items():
            if g.terminal == "fail" and g.gen < self.max_gen:
                acts.append(Action("retry", "client", (r,), fault=True))
        return tuple(acts)

    def apply(self, action: Action) -> tuple[Event, ...]:
        enabled = self.actions()
        if action not in enabled:
            raise ActionNotEnabled(action, enabled)
        out: list[Event] = []
        kind = action.kind
        if kind == "submit":
            self._submit(action.args[0], 0, out)
        elif kind == "retry":
            self._submit(action.args[0], self.gens[action.args[0]].gen + 1, out)
        elif kind == "step":
            side = action.actor[0]
            self.h.clock.advance(self.STEP_SECONDS)
            before = self.signature()
            self._step(side, out)
            if not out and self.signature() == before:
                self.idle[side] = before
        elif kind == "complete":
            g = self.by_id[f"{action.args[0]}.{action.args[1]}-d"]
            self.h.complete(g.d_id)
            out += [TransferReadDone(g.transfer), TransferWriteDone(g.transfer)]
        elif kind == "fail_transfer":
            g = self.by_id[f"{action.args[0]}.{action.args[1]}-d"]
            self.h.fail(g.d_id)
            out.append(TransferFailed(g.transfer))
        elif kind == "expire":
            heartbeats = not action.args
            target = self._expire_target(heartbeats)
            assert target is not None
            if heartbeats:  # D's heartbeats renewed the leases of what it still waits for
                leases = self.h.workers["P"].reqs_to_send
                for rid in self._heartbeated():
                    if rid in leases:
                        leases[rid] = max(leases[rid], target[0] + self.h.lease)
            self.h.clock.now = max(self.h.clock.now, target[0])
        elif kind == "abort":
            self._abort(self.gens[action.args[0]], out)
        elif kind == "lose":
            worker, nkind, r, gen = action.args
            rid = self._rid(r, gen, worker, nkind)
            self.h.workers[worker[0]].inbox.remove((nkind, rid))
        elif kind == "duplicate":
            worker, nkind, r, gen = action.args
            rid = self._rid(r, gen, worker, nkind)
            self.duplicated.add((worker, nkind, rid))
            self.h.workers[worker[0]].inbox.append((nkind, rid))
        elif kind == "restart":
            self._restart(action.actor, out)
        else:  # pragma: no cover - actions() offers no other kind
            raise ActionNotEnabled(action, enabled)
        if kind != "step":
            self.idle.clear()
        elif out:
            self.idle.clear()
        return tuple(out)

    def signature(self) -> Hashable:
        now = self.h.clock.now
        leases = tuple(sorted((rid, d <= now) for rid, d in self.h.workers["P"].reqs_to_send.items()))
        parts: list[Any] = [leases, tuple(sorted(self.incarnation.items()))]
        for side in ("P", "D"):
            s = self.h.sched[side]
            parts.append(
                (
                    tuple(
                        sorted((rid, r.status.name, r.num_computed_tokens) for rid, r in s.requests.items())
                    ),
                    self.h.free_blocks(side),
                    len(s.waiting),
                    len(s.running),
                    tuple(sorted(s.finished_recving_kv_req_ids)),
                    self.h.connector_pending(side),
                    self.h.workers[side].signature(),
                )
            )
        parts.append(tuple(sorted((d, t.state) for d, t in self.h.transfers.items())))
        parts.append(tuple(sorted((r, g.gen, g.terminal) for r, g in self.gens.items())))
        return tuple(parts)

    def decision(self, event: Event) -> Action | tuple[Action, ...] | None:
        """The action (or the actions, the silent ones first) that make the
        engine do what ``event`` records, or None when the event only
        follows from an earlier decision (it comes out of the same action)."""
        ev = event.EV
        if ev == "submit":
            return (
                Action("submit", "client", (event.request,))
                if event.gen == 0
                else Action("retry", "client", (event.request,), fault=True)
            )
        if ev in ("prefill_start",):
            return Action("step", "P0", ("P0",))
        if ev == "reserve":
            return Action("step", "D0", ("D0",))
        if ev == "transfer_start":
            return Action("step", "P0", ("P0",)) if self.family == "push" else None
        if ev == "transfer_read_done":
            return Action("complete", "net", self._of_transfer(event.transfer))
        if ev == "transfer_failed":
            r, gen = self._of_transfer(event.transfer)
            t = self.h.transfers.get(f"{r}.{gen}-d")
            if t is not None and t.state == "running":
                return Action("fail_transfer", "net", (r, gen), fault=True)
            return None
        if ev == "commit":
            step = Action("step", "D0", ("D0",))
            g = self.gens.get(event.request)
            if g is not None and g.d_id not in self.h.sched["D"].finished_recving_kv_req_ids:
                return (step, step)  # the first step only delivers finished_recving
            return step
        if ev == "decode":
            g = self.gens.get(event.request)
            if g is not None and g.committed and event.position == len(g.prompt) - 1:
                return None  # the first decode comes with the commit
            return Action("step", "D0", ("D0",))
        if ev == "cancel":
            return Action("abort", "client", (event.request,), fault=True)
        if ev == "restart":
            return Action("restart", event.worker, (event.worker,), fault=True)
        if ev == "free":
            g = self.gens.get(event.request) if event.request else None
            if event.worker == "P0":
                return self._decide_p_free()
            if g is not None and g.terminal in ("cancel",) and g.d_id in self.h.sched["D"].requests:
                return Action("step", "D0", ("D0",))
            return None
        if ev == "fail":
            g = self.gens.get(event.request)
            if g is not None and g.terminal is None and self.h.worker_has_output("D"):
                return Action("step", "D0", ("D0",))  # D reads the failed load's report
            return None
        return None  # prefill_done, alloc, transfer_write_done, finish: consequences

    def _decide_p_free(self) -> Action | tuple[Action, ...] | None:
        """What frees blocks at P next: a step that reads a notification or
        reaps a due lease, else time passing to a lease deadline and the
        step after (first a step that ships P's new leases, if any)."""
        step = Action("step", "P0", ("P0",))
        if self.h.worker_has_output("P"):
            return step
        ship = (step,) if self.h.connector_pending("P") else ()
        leases = set(self.h.workers["P"].reqs_to_send) | set(self.h.nixl("P")._reqs_need_send)
        if not leases:
            return ship[0] if ship else None
        if leases - self._heartbeated():
            return ship + (Action("expire", "clock", (), fault=bool(self._running())), step)
        return ship + (Action("expire", "clock", ("heartbeats-lost",), fault=True), step)

    # -- the pieces ---------------------------------------------------------------------

    def _prompt(self, request: str, gen: int) -> list[int]:
        base = 10 * (self.requests.index(request) + 1) + 100 * gen
        return [base + i for i in range(self.prompt_len)]

    def _submit(self, r: str, gen: int, out: list[Event]) -> None:
        g = _Gen(r, gen, self._prompt(r, gen), self.max_tokens)
        self.gens[r] = g
        self.by_id[g.p_id] = g
        self.by_id[g.d_id] = g
        self.h.pair(g.p_id, g.d_id)
        out.append(Submit(r, gen, len(g.prompt), g.max_tokens))
        if self.family == "pull":
            self._add_p(g)
        else:
            # push: the router sends D first; P gets the request once D registered
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": VllmHarness.P_ENGINE,
                "remote_request_id": g.p_id,
                "remote_host": "localhost",
                "remote_port": 5600,
                "tp_size": 1,
            }
            self.h.add_request("D", g.d_id, g.prompt, g.max_tokens, params)
            g.d_added = True
            g.d_inc = self.incarnation["D0"]

    def _add_p(self, g: _Gen) -> None:
        self.h.add_request("P", g.p_id, g.prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False})
        g.p_added = True
        g.p_inc = self.incarnation["P0"]

    def _has_work(self, side: str) -> bool:
        from vllm.v1.request import RequestStatus

        s = self.h.sched[side]
        if s.running:
            return True
        for req in list(s.waiting) + list(s.kv_holding_waiting):
            if (
                req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                or req.request_id in s.finished_recving_kv_req_ids
            ):
                return True
        return self.h.connector_pending(side) or self.h.worker_has_output(side)

    def _running(self) -> list:
        return [t for _d, t in sorted(self.h.transfers.items()) if t.state == "running"]

    def _notifs(self, side: str) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        for item in self.h.workers[side].inbox:
            if item not in seen:
                seen.append(item)
        return seen

    def _rid(self, r: str, gen: int, worker: str, kind: str) -> str:
        g = self.by_id.get(f"{r}.{gen}-p")
        assert g is not None
        if worker == "P0":
            return g.d_id if kind == "reg" else g.p_id
        return g.d_id

    @staticmethod
    def _of_transfer(transfer: str) -> tuple[str, int]:
        _x, r, gen = transfer.rsplit("-", 2)
        return r, int(gen)

    def _heartbeated(self) -> set[str]:
        """The P request ids D's connector sends lease-renewing heartbeats
        for (its real ``_heartbeat_by_engine``)."""
        info = self.h.nixl("D")._heartbeat_by_engine.get(VllmHarness.P_ENGINE)
        return set(info.req_ids) if info is not None else set()

    def _expire_target(self, heartbeats: bool) -> tuple[float, bool] | None:
        """Time passes to P's next lease deadline: when, and whether that is
        a fault.  With ``heartbeats`` the leases D still sends heartbeats
        for are renewed and only the others can run out; the time passing is
        a fault when any transfer is in flight (it stalled that long).
        Without them (D stalled, heartbeats lost) it is always a fault."""
        w = self.h.workers["P"]
        if heartbeats and self.h.connector_pending("P"):
            return None  # P's engine ships its new leases at its next step, long before they run out
        skip = self._heartbeated() if heartbeats else set()
        pending = {rid: d for rid, d in w.reqs_to_send.items() if d > self.h.clock.now and rid not in skip}
        if not pending:
            return None
        when = min(pending.values())
        if not heartbeats:
            return when, True
        # 30 seconds passing while a transfer is in flight means it stalled: a fault
        fault = bool(self._running())
        return when, fault

    # -- observing one engine step ------------------------------------------------------------

    def _step(self, side: str, out: list[Event]) -> None:
        from vllm.v1.request import RequestStatus

        worker = f"{side}0"
        h = self.h
        sched = h.sched[side]
        blocks0 = h.block_ids(side)
        status0 = {rid: r.status for rid, r in sched.requests.items()}
        refs0 = h.ref_counts(side)

        so = h.schedule(side)
        blocks1 = h.block_ids(side)
        # allocations, in the scheduler's order
        for rid in sorted(blocks1, key=lambda x: (x not in blocks0, x)):
            new = [b for b in blocks1[rid] if b not in blocks0.get(rid, [])]
            if not new:
                continue
            g = self.by_id.get(rid)
            if g is None:
                continue
            if side == "P":
                if rid not in blocks0:
                    out.append(PrefillStart(g.request, g.gen, worker, new))
                else:
                    out.append(Alloc(g.request, g.gen, worker, new))
            else:
                if not g.reserved:
                    g.reserved = True
                    out.append(Reserve(g.request, g.gen, g.ticket, worker, new))
                    if self.family == "push" and not g.p_added and g.terminal is None:
                        self._add_p(g)  # D registered: the router sends P the request
                else:
                    if (
                        not g.committed
                        and status0.get(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
                        and rid in so.num_scheduled_tokens
                    ):
                        g.committed = True
                        out.append(Commit(g.request, g.gen, g.ticket, worker))
                    out.append(Alloc(g.request, g.gen, worker, new))
        if side == "D":
            for rid in so.num_scheduled_tokens:
                g = self.by_id.get(rid)
                if (
                    g is not None
                    and not g.committed
                    and status0.get(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
                ):
                    g.committed = True
                    out.append(Commit(g.request, g.gen, g.ticket, worker))
        positions: dict[str, tuple[int, int]] = {}
        for rid, _n in so.num_scheduled_tokens.items():
            req = sched.requests.get(rid)
            if req is not None:
                position = req.num_computed_tokens - 1  # the token this step samples after
                positions[rid] = (position, req.all_token_ids[position])

        started = h.start_load(side, so)
        output, started2 = h.execute(side, so)
        for t in started + started2:
            self._transfer_started(t, out)

        outs = h.update(side, so, output)
        engine_outputs = [o for eo in outs.values() for o in eo.outputs]
        for o in engine_outputs:
            g = self.by_id.get(o.request_id)
            if g is None or not o.new_token_ids:
                continue
            token = o.new_token_ids[-1]
            if side == "P":
                out.append(PrefillDone(g.request, g.gen, worker, token, len(g.prompt)))
                if self.family == "pull" and o.kv_transfer_params and g.terminal is None and not g.d_added:
                    # the router forwards P's answer to D (deep copy: the connector edits it)
                    params = copy.deepcopy(o.kv_transfer_params)
                    h.add_request("D", g.d_id, g.prompt, g.max_tokens, params)
                    g.d_added = True
                    g.d_inc = self.incarnation["D0"]
            else:
                if o.request_id not in positions:
                    continue
                position, input_token = positions[o.request_id]
                out.append(
                    Decode(
                        g.request,
                        g.gen,
                        worker,
                        position,
                        input_token,
                        token,
                        blocks1.get(o.request_id, blocks0.get(o.request_id, [])),
                    )
                )
        # endings the engine reached (D finishes, D fails a load)
        for o in engine_outputs:
            g = self.by_id.get(o.request_id)
            if g is None or o.finish_reason is None or g.terminal is not None:
                continue
            if side == "D" or o.finish_reason.name not in ("LENGTH", "STOP"):
                reason = o.finish_reason.name.lower()
                if reason in ("length", "stop"):
                    g.terminal = "finish"
                    out.append(Finish(g.request, g.gen, reason))
                else:
                    g.terminal = "fail"
                    out.append(Fail(g.request, g.gen, reason))
                    self._fail_peer(g, side, out)
        self._frees(side, {**blocks0, **blocks1}, refs0, out)

    def _transfer_started(self, t: Any, out: list[Event]) -> None:
        g = self.by_id.get(t.d_id)
        if g is None:
            return
        if self.family == "pull" and g.p_inc != self.incarnation["P0"]:
            # the remote P that computed these blocks is gone: the handshake with its
            # successor fails before any READ, and D reports the load as failed
            t.state = "failed"
            self.h.workers["D"].inbox.append(("failed", t.d_id))
            return
        if self.family == "push" and g.d_inc != self.incarnation["D0"]:
            # the registration came from a D that is gone: the WRITE to its agent fails
            # before it starts, and P keeps the blocks until the lease runs out
            t.state = "failed"
            return
        out.append(
            TransferStart(g.transfer, g.ticket, g.request, g.gen, "P0", t.src_blocks, "D0", t.dst_blocks)
        )

    def _frees(self, side: str, owners: dict[str, list[int]], refs0: list[int], out: list[Event]) -> None:
        refs1 = self.h.ref_counts(side)
        freed = {b for b, (a, c) in enumerate(zip(refs0, refs1)) if a > 0 and c == 0}
        if not freed:
            return
        for rid in sorted(owners):
            mine = [b for b in owners[rid] if b in freed]
            if not mine:
                continue
            g = self.by_id.get(rid)
            if g is None:
                out.append(Free(f"{side}0", mine))
            else:
                out.append(Free(f"{side}0", mine, g.request, g.gen))
            freed.difference_update(mine)

    def _abort_on(self, side: str, rid: str, out: list[Event]) -> None:
        """The router aborts request ``rid`` on instance ``side`` if it is
        still live there; the blocks the abort really returned are freed."""
        from vllm.v1.request import RequestStatus

        req = self.h.sched[side].requests.get(rid)
        if req is not None and not req.is_finished():
            owners, refs = self.h.block_ids(side), self.h.ref_counts(side)
            self.h.sched[side].finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            self._frees(side, owners, refs, out)

    def _fail_peer(self, g: _Gen, side: str, out: list[Event]) -> None:
        """The router ends the generation on the other instance too."""
        other = "D" if side == "P" else "P"
        self._abort_on(other, g.d_id if other == "D" else g.p_id, out)

    def _abort(self, g: _Gen, out: list[Event]) -> None:
        g.terminal = "cancel"
        out.append(Cancel(g.request, g.gen, "abort"))
        for side, rid in (("P", g.p_id), ("D", g.d_id)):
            self._abort_on(side, rid, out)

    def _restart(self, worker: str, out: list[Event]) -> None:
        side = worker[0]
        self.restarts[worker] += 1
        self.incarnation[worker] += 1
        out.append(Restart(worker, self.incarnation[worker]))
        # transfers that touch the dead instance can no longer read or write
        for t in self._running():
            t.state = "failed"
            g = self.by_id.get(t.d_id)
            if g is not None:
                out.append(TransferFailed(g.transfer))
            if side == "P" and self.family == "pull":
                self.h.workers["D"].inbox.append(("failed", t.d_id))
        live = []
        for g in self.gens.values():
            rid = g.p_id if side == "P" else g.d_id
            req = self.h.sched[side].requests.get(rid)
            if g.terminal is None and req is not None and not req.is_finished():
                live.append(g)
        self.h.rebuild(side)
        for g in live:
            g.terminal = "fail"
            out.append(Fail(g.request, g.gen, "restart"))
            self._fail_peer(g, side, out)
