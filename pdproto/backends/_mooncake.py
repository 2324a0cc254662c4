"""The ``mooncake`` transport: KV moves through Mooncake transfer engines
(``mooncake-transfer-engine-non-cuda``) over TCP on loopback.

Each worker gets its own engine, initialised with
``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`` (no metadata server:
peers are named ``host:rpc_port``), made on first use and reused for the
whole replay.  Every pool (and staging buffer) a transfer touches is
registered with its worker's engine (``register_memory``).

- pull (``policy: pull``): ``batch_transfer_sync_read`` initiated by the
  decode worker's engine; push: ``batch_transfer_sync_write`` initiated by
  the prefill worker's.  Done when the call returns 0 (the engine's status).
  Mooncake's engine sends the peer no completion notification (SGLang tells
  the peer over its own ZMQ channel): none is waited for.
- ``transfer_abort``: the engine has no cancel; the transfer runs to its end
  (counted as an abort whose bytes landed).
- ``transfer_failed``: the transfer is posted while the peer has
  deregistered the source or target memory (invalidated descriptors); the
  engine returns an error status (-1); the memory is registered again.
- ``restart``: the worker's memory is deregistered and registered again.

The engine's own log (glog) ignores ``GLOG_minloglevel`` and prints
"Logging before InitGoogleLogging()" and "Local segment descriptor not
found" while an engine starts and registers memory: file descriptor 2 is
sent to /dev/null around those calls (their outcome is the status the
transport checks).

Needs the system library ``libibverbs.so.1`` even for TCP (Debian/Ubuntu:
``apt-get install libibverbs1``); without it the import fails and the
transport says so in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any

import torch

from .._errors import MissingExtraError, TransportError, UsageError
from ._transport import DEFAULT_TIMEOUT, DONE, ERR, Registered, Transfer

__all__ = ["MooncakeTransport", "load_mooncake"]


def load_mooncake() -> Any:
    """``mooncake.engine``; a :class:`~pdproto.MissingExtraError` naming the
    ``mooncake`` extra when it is not installed, a
    :class:`~pdproto.TransportError` with the loader's
    text when it is installed but cannot load (a missing system library)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        return importlib.import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("mooncake"):
            raise MissingExtraError(
                "the mooncake transport (--transport mooncake)",
                "mooncake-transfer-engine-non-cuda",
                "mooncake",
            ) from None
        raise
    except ImportError as exc:
        hint = " (install the system package libibverbs1)" if "libibverbs" in str(exc) else ""
        raise TransportError("mooncake", "the engine cannot load", f"{exc}{hint}") from None


@contextlib.contextmanager
def _quiet() -> Any:
    """File descriptor 2 to /dev/null for the block (the engine's C++ log)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (or a closed stderr): nothing to hide
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class MooncakeTransport(Registered):
    """The ``mooncake`` transport (see the module docstring)."""

    name = "mooncake"

    def __init__(
        self, *, host: str = "127.0.0.1", timeout: float = DEFAULT_TIMEOUT, abort_timeout: float = 2.0
    ) -> None:
        super().__init__(timeout=timeout, abort_timeout=abort_timeout)
        self.engine_module = load_mooncake()
        self.host = host
        self._engines: dict[str, Any] = {}

    def engine(self, worker: str) -> Any:
        e = self._engines.get(worker)
        if e is None:
            with _quiet():
                e = self.engine_module.TransferEngine()
                rc = e.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise TransportError(
                    "mooncake", f"an engine for worker {worker!r}", f"initialize returned {rc}"
                )
            self._engines[worker] = e
        return e

    def address(self, worker: str) -> str:
        return f"{self.host}:{self.engine(worker).get_rpc_port()}"

    def _register(self, worker: str, base: torch.Tensor) -> Any:
        if base.device.type != "cpu":
            raise UsageError("--transport mooncake with --device", str(base.device), "cpu (host memory)")
        ptr, n = base.data_ptr(), base.numel() * base.element_size()
        e = self.engine(worker)
        with _quiet():
            rc = e.register_memory(ptr, n)
        if rc != 0:
            raise TransportError("mooncake", f"registering {n} bytes of {worker!r}", f"status {rc}")
        return (ptr, n)

    def _deregister(self, worker: str, token: Any) -> None:
        e = self._engines.get(worker)
        if e is not None:
            e.unregister_memory(token[0])

    def _call(self, x: Transfer) -> int:
        self.ensure_all(x)
        dst, src, lens = self.descriptors(x)
        if not len(lens):
            return 0
        if x.pull:
            return self.engine(x.dst).batch_transfer_sync_read(
                self.address(x.src), dst.tolist(), src.tolist(), lens.tolist()
            )
        return self.engine(x.src).batch_transfer_sync_write(
            self.address(x.dst), src.tolist(), dst.tolist(), lens.tolist()
        )

    def start(self, x: Transfer) -> Any:
        rc = self._call(x)
        if rc != 0:
            self._error(f"transfer {x.tid!r}: status {rc}")
        return {"state": DONE if rc == 0 else ERR}

    def poll(self, handle: Any) -> str:
        return handle["state"]

    def fail(self, x: Transfer) -> str:
        """Post ``x`` while the peer has deregistered its side's memory."""
        self._count("failures")
        self.ensure_all(x)
        peer = x.src if x.pull else x.dst
        gone = [(k, v) for k, v in self._regs.items() if k[0] == peer]
        for _k, v in gone:
            self._deregister(peer, v[2])
        try:
            with _quiet():  # the engine logs the refusal it reports as a status
                rc = self._call(x)
        finally:
            with _quiet():
                for _k, v in gone:
                    self._engines[peer].register_memory(*v[2])
        text = (
            f"status {rc} (the peer's memory was deregistered)"
            if rc != 0
            else "status 0: the engine moved bytes the peer had deregistered"
        )
        self._error(text)
        return text

    def restart(self, worker: str) -> None:
        """Deregister ``worker``'s memory and register it again."""
        self._count("restarts")
        e = self._engines.get(worker)
        if e is None:
            return
        with _quiet():
            for _k, v in [(k, v) for k, v in self._regs.items() if k[0] == worker]:
                e.unregister_memory(v[2][0])
                e.register_memory(*v[2])

    def close(self) -> None:
        for key in list(self._regs):
            self._drop(key)
        self._engines.clear()
