"""The state of the reference handoff model: named phases, ends and transfer
states, and the records (:class:`Req`, :class:`Xfer`, :class:`Msg`,
:class:`HState`) with fast one-field setters for the hot path.

The enums are ``IntEnum`` so that states stay plain tuples of small ints that
hash and compare fast.  Their values keep the order of the one-letter codes
they replaced ("-" < "C" < "F" < "P" < "Q" < "R" < "W" < "X" for phases,
"" < "c" < "f" < "x" for ends): symmetry reduction picks the least renamed
state, so this order fixes which state of an orbit is explored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Phase", "End", "XferState", "MsgKind", "Req", "Xfer", "Msg", "HState"]


class _Named(enum.IntEnum):
    def __repr__(self) -> str:  # valid Python: Phase.QUEUED
        return f"{type(self).__name__}.{self.name}"

    __str__ = __repr__


class Phase(_Named):
    """Phase of a generation (the router's view); kept when the generation ends."""

    NEW = 0  # not submitted
    COMMITTED = 1  # committed on D; decoding
    PREFILLED = 2  # (pull) prefilled; P told D
    PREFILLING = 3  # prefilling on P
    QUEUED = 4  # queued at the router
    RESERVED = 5  # (push) D blocks reserved under a ticket
    WAITING = 6  # (pull) queued at D, waiting for free blocks
    TRANSFERRING = 7  # transfer started

    @property
    def letter(self) -> str:
        """The one-letter code of the phase (``phase-Q`` and the docs use it)."""
        return "-CFPQRWX"[self]


class End(_Named):
    """How a generation ended (``LIVE`` while it runs)."""

    LIVE = 0
    CANCELLED = 1
    FINISHED = 2
    FAILED = 3


class XferState(_Named):
    """The transfer of the current generation, as its request record sees it."""

    NONE = 0
    IN_FLIGHT = 1
    DONE = 2
    FAILED = 3


class MsgKind(_Named):
    """Kinds of control message (in the order of their names)."""

    NOTIFY = 0  # push, P->D: the KV has landed
    READY = 1  # pull, P->D: prefill is over, come and read
    RELEASE = 2  # pull, D->P: your source blocks were read

    @property
    def word(self) -> str:
        return self.name.lower()


#: ``Req.pfx``: the generation holds no cached prefix; it took a reference on
#: the prefix P had cached (its source starts with those blocks); it computed
#: the prefix and published it (its source starts with the cached blocks).
NO_PREFIX, SHARED_PREFIX, OWN_PREFIX = 0, 1, 2

NEW, COMMITTED, PREFILLED, PREFILLING, QUEUED, RESERVED, WAITING, TRANSFERRING = Phase
LIVE, CANCELLED, FINISHED, FAILED = End
NOTIFY, READY, RELEASE = MsgKind


class Req(NamedTuple):
    """One request's current generation, as every component sees it."""

    gen: int = -1  # -1: not submitted yet
    ph: Phase = NEW
    end: End = LIVE
    p: int = -1  # P worker index
    d: int = -1  # D worker index (global worker index)
    src: tuple = ()  # source blocks held on P
    pinc: int = 0  # P's incarnation when it took them
    dst: tuple = ()  # target blocks held on D
    dinc: int = 0  # D's incarnation when it took them
    xs: XferState = XferState.NONE  # the generation's transfer (every chunk of it)
    ndec: int = 0  # decode steps done
    pfx: int = 0  # prefix cache: NO_PREFIX, SHARED_PREFIX (src starts with it) or OWN_PREFIX (published it)


class Xfer(NamedTuple):
    """A transfer in flight (reading and writing until it ends)."""

    r: int
    gen: int
    p: int
    src: tuple
    d: int
    dst: tuple
    aborted: bool = False
    doomed: bool = False  # an endpoint restarted: it can only fail now
    dst_lost: bool = False  # the target restarted: its blocks are quarantined
    chunk: int = 0  # which chunk of the handoff (config.chunks of them, one after the other)


class Msg(NamedTuple):
    """A control message in flight."""

    kind: MsgKind
    r: int
    gen: int
    frm: int  # sender worker index
    inc: int  # sender incarnation
    to: int  # receiver worker index


class HState(NamedTuple):
    reqs: tuple  # of Req, one per request
    xfers: tuple  # of Xfer, in start order
    msgs: tuple  # of Msg, in send order (index 0 is the oldest)
    inc: tuple  # incarnation per worker (P workers first, then D workers)
    budget: tuple  # remaining budget per fault kind, in FAULT_KINDS order


new = tuple.__new__


def _setter(cls: Any, field: str) -> Callable[[Any, Any], Any]:
    """A fast ``t._replace(field=v)`` of one field of the NamedTuple ``cls``."""
    i = cls._fields.index(field)
    j = i + 1

    def set_field(t: Any, v: Any) -> Any:
        return new(cls, t[:i] + (v,) + t[j:])

    set_field.__name__ = f"with_{field}"
    set_field.__qualname__ = f"with_{field}"
    return set_field


with_ph = _setter(Req, "ph")
with_end = _setter(Req, "end")
with_src = _setter(Req, "src")
with_dst = _setter(Req, "dst")
with_xs = _setter(Req, "xs")
with_ndec = _setter(Req, "ndec")
with_pfx = _setter(Req, "pfx")
with_reqs = _setter(HState, "reqs")
with_xfers = _setter(HState, "xfers")
with_msgs = _setter(HState, "msgs")
with_aborted = _setter(Xfer, "aborted")
