"""The ``nixl`` transport: KV moves through NIXL agents (UCX) on host memory.

Each worker gets its own agent (``nixl_agent``, UCX backend, progress
thread), made on first use and reused for the whole replay (and by every
copy of the backend).  Every pool (and staging buffer) a transfer touches is
registered with its worker's agent; a peer reloads a worker's metadata when
its registrations changed.

- pull (``policy: pull``, vLLM's default): a READ initiated by the decode
  worker's agent; the prefill worker is told by the library's notification.
- push: a WRITE initiated by the prefill worker's agent; the decode worker
  is told by the notification.

A transfer with no bytes to move is done at once (nothing is posted, no
notification is expected).  A transfer is done when the initiator's
``check_xfer_state`` says DONE (a :class:`~pdproto.TransportError` when it
is still in progress after ``timeout`` seconds);
then the peer's ``get_new_notifs`` must deliver its notification (waited for
up to ``notify_timeout`` seconds; one that never comes is counted).

Faults: an aborted transfer's handle is released at once, while active
(``release_xfer_handle``); a failed one is posted after the initiator
removed the peer's agent (``remove_remote_agent``), which the library
reports as an error, and the peer is then added again; a restart removes
the worker's agent from every peer and adds it again.  See docs/replay.md
for what the library does in each case (findings).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from .._errors import MissingExtraError, TransportError, UsageError
from ._transport import DEFAULT_TIMEOUT, DONE, ERR, PROC, Registered, Transfer

__all__ = ["NixlTransport", "load_nixl"]

_IDS = itertools.count()

#: the UCX modules NIXL's UCX loads unless ``UCX_MODULES`` says otherwise: all but EFA
_UCX_MODULES = "^efa"


def load_nixl() -> Any:
    """NIXL's Python API module: ``nixl_cu12._api`` (the ``nixl-cu12``
    wheel), else ``nixl._api`` (the ``nixl`` meta-package)."""
    # the library's own log (C++) says nothing the transport does not report;
    # UCX's (read when its context is made) would print "UCX ERROR connect(...)
    # failed" for a peer already closed
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    # UCX's EFA module (libuct_ib_efa) is the one module of the wheel that links a
    # library it does not bundle (libefa.so.1): where the system has it (Debian's
    # ibverbs-providers, which libibverbs1 brings for Mooncake), loading the module
    # puts the system's libibverbs and libnl beside the wheel's copies, and the
    # process dies with SIGSEGV at exit (libnl-route's destructor).  Host-memory
    # replay does not use EFA; a UCX_MODULES of the user's own is kept.
    os.environ.setdefault("UCX_MODULES", _UCX_MODULES)
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        logging.getLogger(name.split(".")[0]).setLevel(logging.WARNING)
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise MissingExtraError("the nixl transport (--transport nixl)", "nixl-cu12", "nixl")


def _library_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _nixl_errors(api: Any) -> tuple[type[BaseException], ...]:
    """The exception classes of NIXL's bindings (``nixlBackendError``,
    ``nixlNotFoundError``, ...): the errors the library raises."""
    try:
        bindings = importlib.import_module(api.__name__.rsplit(".", 1)[0] + "._bindings")
    except ImportError:
        return ()
    return tuple(
        v
        for k, v in sorted(vars(bindings).items())
        if k.startswith("nixl") and isinstance(v, type) and issubclass(v, Exception)
    )


#: notifications kept per worker that no transfer waited for (late ones): the oldest are dropped
_MAX_NOTES = 1024


class NixlTransport(Registered):
    """The ``nixl`` transport (see the module docstring).  ``notify_timeout``:
    seconds to wait for a peer's notification; ``timeout`` and
    ``abort_timeout``: those of :class:`~pdproto.backends._transport.Transport`."""

    name = "nixl"

    def __init__(
        self,
        *,
        notify_timeout: float = 2.0,
        backends: tuple[str, ...] = ("UCX",),
        timeout: float = DEFAULT_TIMEOUT,
        abort_timeout: float = 2.0,
    ) -> None:
        super().__init__(timeout=timeout, abort_timeout=abort_timeout)
        self.api = load_nixl()
        self._lib_errors = _nixl_errors(self.api)
        self.notify_timeout = notify_timeout
        self._backends = list(backends)
        self._prefix = f"pdproto{next(_IDS)}-"
        self._agents: dict[str, Any] = {}
        self._version: dict[str, int] = {}  # worker -> registrations changed so often
        self._loaded: dict[tuple[str, str], int] = {}  # (initiator, peer) -> version it loaded
        self._notes: dict[str, list[bytes]] = {}  # worker -> notifications received, not yet matched
        self._seq = itertools.count()

    # agents ----------------------------------------------------------------

    def agent(self, worker: str) -> Any:
        a = self._agents.get(worker)
        if a is None:
            conf = self.api.nixl_agent_config(backends=self._backends)
            try:
                a = self.api.nixl_agent(self._prefix + worker, conf)
            except Exception as exc:  # noqa: BLE001 - the library's own error, one line
                raise TransportError("nixl", f"an agent for worker {worker!r}", _library_error(exc)) from None
            self._agents[worker] = a
            self._version[worker] = 0
        return a

    def _register(self, worker: str, base: torch.Tensor) -> Any:
        if base.device.type != "cpu":
            raise UsageError("--transport nixl with --device", str(base.device), "cpu (host memory)")
        a = self.agent(worker)
        descs = a.get_reg_descs([(base.data_ptr(), base.numel() * base.element_size(), 0, "")], "DRAM")
        return a.register_memory(descs)

    def _deregister(self, worker: str, token: Any) -> None:
        a = self._agents.get(worker)
        if a is not None:
            a.deregister_memory(token)
            self._registered(worker)

    def _registered(self, worker: str) -> None:
        self._version[worker] = self._version.get(worker, 0) + 1

    def _peer(self, initiator: str, peer: str) -> str:
        """The peer's agent name, its current metadata loaded by the initiator."""
        v = self._version.get(peer, 0)
        if self._loaded.get((initiator, peer)) != v:
            self.agent(initiator).add_remote_agent(self.agent(peer).get_agent_metadata())
            self._loaded[(initiator, peer)] = v
        return self._prefix + peer

    def _sides(self, x: Transfer) -> tuple[str, str, str]:
        """(initiator worker, peer worker, operation)."""
        return (x.dst, x.src, "READ") if x.pull else (x.src, x.dst, "WRITE")

    def _handle(self, x: Transfer, tag: bytes) -> tuple[Any, Any, str, str]:
        """(initiator's agent, prepared handle, initiator, peer); the handle
        is None when ``x`` has no bytes to move (nothing to post)."""
        self.agent(x.src)
        self.agent(x.dst)
        self.ensure_all(x)
        init, peer, op = self._sides(x)
        a = self.agent(init)
        dst, src, lens = self.descriptors(x)
        if not len(lens):
            return a, None, init, peer
        name = self._peer(init, peer)
        local, remote = (dst, src) if x.pull else (src, dst)
        zeros = np.zeros(len(lens), dtype=np.int64)
        ld = a.get_xfer_descs(np.stack([local, lens, zeros], axis=1), "DRAM")
        rd = a.get_xfer_descs(np.stack([remote, lens, zeros], axis=1), "DRAM")
        h = a.initialize_xfer(op, ld, rd, name, tag)
        return a, h, init, peer

    # the steps ---------------------------------------------------------------

    def start(self, x: Transfer) -> Any:
        tag = f"{x.tid}#{next(self._seq)}".encode()
        try:
            a, h, init, peer = self._handle(x, tag)
            state = DONE if h is None else a.transfer(h, tag)
        except self._lib_errors as exc:  # a NIXL error: the transfer failed
            self._error(_library_error(exc))
            raise TransportError(
                "nixl", f"transfer {x.tid!r} from {x.src!r} to {x.dst!r}", _library_error(exc)
            ) from None
        # no handle (no bytes): done at once, nothing to release, no notification
        return {
            "agent": a,
            "handle": h,
            "init": init,
            "peer": peer,
            "tag": tag,
            "state": state,
            "released": h is None,
        }

    def poll(self, handle: Any) -> str:
        if handle["state"] == PROC:
            try:
                handle["state"] = handle["agent"].check_xfer_state(handle["handle"])
            except self._lib_errors as exc:  # the binding raises on an error status
                self._error(_library_error(exc))
                handle["state"] = ERR
        return handle["state"]

    def abort(self, handle: Any) -> bool:
        active = self.poll(handle) == PROC
        if handle["released"]:
            return active
        try:
            handle["agent"].release_xfer_handle(handle["handle"])
            handle["released"] = True
        except self._lib_errors as exc:  # "it cannot be canceled": the handle stays
            self._error("release of an active handle refused: " + _library_error(exc))
            self.wait(handle)
            self.finish(handle)
        return active

    def notify(self, handle: Any) -> None:
        if handle["handle"] is None:
            return  # nothing was posted: no notification comes
        t0 = time.perf_counter()
        if self.notified(handle, self.notify_timeout):
            self._count("notifications")
            self._count("notify_seconds", time.perf_counter() - t0)
        else:
            self._count("notifications_missing")

    def notified(self, handle: Any, timeout: float) -> bool:
        if handle["handle"] is None:
            return False
        peer, tag = handle["peer"], handle["tag"]
        end = time.perf_counter() + timeout
        box = self._notes.setdefault(peer, [])
        while True:
            if tag in box:
                box.remove(tag)
                return True
            for msgs in self.agent(peer).get_new_notifs().values():
                box.extend(msgs)
            if len(box) > _MAX_NOTES:  # late notifications of transfers no one waits for any more
                del box[: len(box) - _MAX_NOTES]
            if tag in box:
                continue
            if time.perf_counter() > end:
                return False
            time.sleep(0)

    def finish(self, handle: Any) -> None:
        if not handle["released"]:
            handle["agent"].release_xfer_handle(handle["handle"])
            handle["released"] = True

    # faults ------------------------------------------------------------------

    def fail(self, x: Transfer) -> str:
        """Post ``x`` after its initiator removed the peer's agent: the
        library refuses it (an error status, raised by the binding, or ERR);
        then the peer is added again."""
        self._count("failures")
        tag = f"{x.tid}#{next(self._seq)}".encode()
        a, h, init, peer = self._handle(x, tag)
        if h is None:
            text = "nothing to move: no transfer was posted to fail"
            self._error(text)
            return text
        a.remove_remote_agent(self._prefix + peer)
        self._loaded.pop((init, peer), None)
        try:
            state = a.transfer(h, tag)
            end = time.perf_counter() + self.timeout
            while state == PROC and time.perf_counter() <= end:
                time.sleep(0)  # the progress thread needs the CPU
                state = a.check_xfer_state(h)
            text = (
                f"the library reported {state} for a transfer to a removed agent"
                if state != PROC
                else f"still in progress after {self.timeout:g} s (timeout) for a transfer to a removed agent"
            )
        except self._lib_errors as exc:  # the binding raises on an error status
            text = _library_error(exc)
        try:
            a.release_xfer_handle(h)
        except self._lib_errors:  # a handle to a removed agent may not release
            pass
        self._peer(init, peer)  # the peer is back for the transfers to come
        self._error(text)
        return text

    def lose(self, worker: str) -> None:
        """Every peer removes ``worker``'s agent, and it removes theirs."""
        if worker not in self._agents:
            return
        name = self._prefix + worker
        for other, a in self._agents.items():
            if other == worker:
                continue
            if self._loaded.pop((other, worker), None) is not None:
                a.remove_remote_agent(name)
            if self._loaded.pop((worker, other), None) is not None:
                self._agents[worker].remove_remote_agent(self._prefix + other)

    def restart(self, worker: str) -> None:
        """Remove ``worker``'s agent from its peers and add it again."""
        self._count("restarts")
        if worker not in self._agents:
            return
        pairs = [k for k in self._loaded if worker in k]
        self.lose(worker)
        for init, peer in pairs:
            self._peer(init, peer)

    def close(self) -> None:
        for key in list(self._regs):
            self._drop(key)
        self._agents.clear()
        self._loaded.clear()
