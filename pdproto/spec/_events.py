"""History events, format version 1: one frozen class per event kind.

An event is a small immutable value.  ``Event.to_dict()`` gives its JSON
object (``"ev"`` first) and :func:`event_from_dict` parses and strictly
validates one; unknown extra keys (a timestamp ``"t"``, a ``"rank"``) are kept
in ``extra`` and written back unchanged.

The field specification in each class's ``FIELDS`` is the single source of
truth for validation, serialisation and the documentation table.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

import attrs

from .._errors import HistoryFormatError

__all__ = [
    "Event",
    "Submit",
    "Reserve",
    "PrefillStart",
    "PrefillDone",
    "Alloc",
    "TransferStart",
    "TransferReadDone",
    "TransferWriteDone",
    "TransferFailed",
    "TransferAbort",
    "Commit",
    "Decode",
    "Finish",
    "Cancel",
    "Fail",
    "Free",
    "Restart",
    "EVENT_TYPES",
    "event_from_dict",
]

# Field kinds.  Each kind has a checker returning the normalised value or
# raising ValueError with what was expected.
_STR = "str"  # a non-empty string
_NAT = "nat"  # an int >= 0 (bool is not an int here)
_BLOCKS = "blocks"  # a list of ints >= 0, stored as a tuple
_OPT_STR = "str?"
_OPT_NAT = "nat?"

_EXPECT = {
    _STR: "a non-empty string",
    _NAT: "an integer >= 0",
    _BLOCKS: "a list of integers >= 0 (block ids)",
    _OPT_STR: "a non-empty string",
    _OPT_NAT: "an integer >= 0",
}


def _is_nat(value: object) -> bool:
    return type(value) is int and value >= 0


def _check(kind: str, value: object) -> object:
    if kind in (_STR, _OPT_STR):
        if type(value) is str and value:
            return value
    elif kind in (_NAT, _OPT_NAT):
        if _is_nat(value):
            return value
    elif kind == _BLOCKS:
        if type(value) in (list, tuple) and all(_is_nat(b) for b in value):
            return tuple(value)
    raise ValueError(_EXPECT[kind])


def _blocks(value: Any) -> tuple[int, ...]:
    return value if type(value) is tuple else tuple(value)


def _event(cls: type) -> type:
    """Make ``cls`` a frozen, slotted attrs event class."""
    return attrs.frozen(cls, cache_hash=False)


class Event:
    """Base of every history event.

    ``EV`` is the ``"ev"`` name of the kind and ``FIELDS`` maps each field to
    its kind (``str``, ``nat``, ``blocks``, or optional ``str?`` / ``nat?``).
    ``extra`` holds unknown keys read from a history; it takes no part in
    hashing and is written back by :meth:`to_dict`.
    """

    __slots__ = ()
    EV: ClassVar[str] = ""
    FIELDS: ClassVar[Mapping[str, str]] = {}

    def to_dict(self) -> dict[str, Any]:
        """The event's JSON object: ``"ev"`` first, optional fields left out
        when unset, block tuples as lists, extra keys last."""
        out: dict[str, Any] = {"ev": self.EV}
        for name, kind in self.FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = list(value) if kind == _BLOCKS else value
        extra = self.extra  # type: ignore[attr-defined]
        if extra:
            for key, value in extra.items():
                out.setdefault(key, value)
        return out


_EXTRA = attrs.field(factory=dict, kw_only=True, hash=False, repr=False)


# Field sets shared by several kinds.  They are mixins, not Event subclasses:
# every Event subclass here is a registered kind (EVENT_TYPES), and each kind
# is still its own class (own repr, equality and dispatch-table key).


@_event
class _TransferOnly:
    """The fields of an event that names only its transfer."""

    FIELDS: ClassVar[Mapping[str, str]] = {"transfer": _STR}
    transfer: str
    extra: dict = _EXTRA


@_event
class _OnBlocks:
    """The fields of an event that takes blocks on a worker for a generation."""

    FIELDS: ClassVar[Mapping[str, str]] = {"request": _STR, "gen": _NAT, "worker": _STR, "blocks": _BLOCKS}
    request: str
    gen: int
    worker: str
    blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    extra: dict = _EXTRA


@_event
class _Ending:
    """The fields of an event that ends a generation, with an optional reason."""

    FIELDS: ClassVar[Mapping[str, str]] = {"request": _STR, "gen": _NAT, "reason": _OPT_STR}
    request: str
    gen: int
    reason: str | None = None
    extra: dict = _EXTRA


@_event
class Submit(Event):
    EV = "submit"
    FIELDS = {"request": _STR, "gen": _NAT, "prompt_len": _NAT, "max_new_tokens": _OPT_NAT}
    request: str
    gen: int
    prompt_len: int
    max_new_tokens: int | None = None
    extra: dict = _EXTRA


@_event
class Reserve(Event):
    EV = "reserve"
    FIELDS = {"request": _STR, "gen": _NAT, "ticket": _STR, "worker": _STR, "blocks": _BLOCKS}
    request: str
    gen: int
    ticket: str
    worker: str
    blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    extra: dict = _EXTRA


@_event
class PrefillStart(_OnBlocks, Event):
    EV = "prefill_start"


@_event
class PrefillDone(Event):
    EV = "prefill_done"
    FIELDS = {
        "request": _STR,
        "gen": _NAT,
        "worker": _STR,
        "first_token": _NAT,
        "processed_len": _NAT,
    }
    request: str
    gen: int
    worker: str
    first_token: int
    processed_len: int
    extra: dict = _EXTRA


@_event
class Alloc(_OnBlocks, Event):
    EV = "alloc"


@_event
class TransferStart(Event):
    EV = "transfer_start"
    FIELDS = {
        "transfer": _STR,
        "ticket": _STR,
        "request": _STR,
        "gen": _NAT,
        "src": _STR,
        "src_blocks": _BLOCKS,
        "dst": _STR,
        "dst_blocks": _BLOCKS,
    }
    transfer: str
    ticket: str
    request: str
    gen: int
    src: str
    src_blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    dst: str
    dst_blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    extra: dict = _EXTRA


@_event
class TransferReadDone(_TransferOnly, Event):
    EV = "transfer_read_done"


@_event
class TransferWriteDone(_TransferOnly, Event):
    EV = "transfer_write_done"


@_event
class TransferFailed(_TransferOnly, Event):
    EV = "transfer_failed"


@_event
class TransferAbort(_TransferOnly, Event):
    EV = "transfer_abort"


@_event
class Commit(Event):
    EV = "commit"
    FIELDS = {"request": _STR, "gen": _NAT, "ticket": _STR, "worker": _STR}
    request: str
    gen: int
    ticket: str
    worker: str
    extra: dict = _EXTRA


@_event
class Decode(Event):
    EV = "decode"
    FIELDS = {
        "request": _STR,
        "gen": _NAT,
        "worker": _STR,
        "position": _NAT,
        "input_token": _NAT,
        "output_token": _NAT,
        "blocks": _BLOCKS,
    }
    request: str
    gen: int
    worker: str
    position: int
    input_token: int
    output_token: int
    blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    extra: dict = _EXTRA


@_event
class Finish(_Ending, Event):
    EV = "finish"


@_event
class Cancel(_Ending, Event):
    EV = "cancel"


@_event
class Fail(_Ending, Event):
    EV = "fail"


@_event
class Free(Event):
    EV = "free"
    FIELDS = {"worker": _STR, "blocks": _BLOCKS, "request": _OPT_STR, "gen": _OPT_NAT}
    worker: str
    blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    request: str | None = None
    gen: int | None = None
    extra: dict = _EXTRA


@_event
class Restart(Event):
    EV = "restart"
    FIELDS = {"worker": _STR, "incarnation": _NAT}
    worker: str
    incarnation: int
    extra: dict = _EXTRA


EVENT_TYPES: Mapping[str, type[Event]] = {
    cls.EV: cls
    for cls in (
        Submit,
        Reserve,
        PrefillStart,
        PrefillDone,
        Alloc,
        TransferStart,
        TransferReadDone,
        TransferWriteDone,
        TransferFailed,
        TransferAbort,
        Commit,
        Decode,
        Finish,
        Cancel,
        Fail,
        Free,
        Restart,
    )
}


def event_from_dict(obj: object) -> Event:
    """Parse one event object, strictly.

    Raises :class:`HistoryFormatError` (without a line; the reader adds it)
    naming the field and the offending value.
    """
    if not isinstance(obj, dict):
        raise HistoryFormatError(
            f"expected a JSON object, got {type(obj).__name__} {obj!r:.80}", value=obj
        )
    if "ev" not in obj:
        raise HistoryFormatError("missing required field", field="ev")
    ev = obj["ev"]
    cls = EVENT_TYPES.get(ev) if isinstance(ev, str) else None
    if cls is None:
        raise HistoryFormatError(
            f"unknown event kind {ev!r}; expected one of {', '.join(EVENT_TYPES)}",
            field="ev",
            value=ev,
        )
    kwargs: dict[str, Any] = {}
    for name, kind in cls.FIELDS.items():
        if name not in obj or (obj[name] is None and kind.endswith("?")):
            if kind.endswith("?"):
                continue
            raise HistoryFormatError(f"missing required field of {ev!r}", field=name)
        value = obj[name]
        try:
            kwargs[name] = _check(kind, value)
        except ValueError as exc:
            raise HistoryFormatError(
                f"{ev}.{name} must be {exc}, got {value!r:.80}", field=name, value=value
            ) from None
    extra = {k: v for k, v in obj.items() if k != "ev" and k not in cls.FIELDS}
    return cls(**kwargs, extra=extra)


# -- the fast path ----------------------------------------------------------
#
# Reading a long history spends most of its time here, so each kind gets a
# straight-line parser generated from its FIELDS.  It returns None whenever
# anything is off; event_from_dict then takes the slow path above, which
# finds and names the problem.  Both accept exactly the same objects.

_INT_ONLY = frozenset((int,))
_SCALARS = frozenset((str, int, float, bool, type(None)))

_FAST_CHECK = {
    _STR: "(type({v}) is str and {v} != '')",
    _NAT: "(type({v}) is int and {v} >= 0)",
    _BLOCKS: "(type({v}) is list and (not {v} or (set(map(type, {v})) <= _INT_ONLY and min({v}) >= 0)))",
    _OPT_STR: "({v} is None or (type({v}) is str and {v} != ''))",
    _OPT_NAT: "({v} is None or (type({v}) is int and {v} >= 0))",
}


def _make_fast_parser(cls: type[Event]) -> Callable[[dict], Event | None]:
    names = [a.name for a in attrs.fields(cls) if a.name != "extra"]
    assert names == list(cls.FIELDS), (cls, names)
    required = [(i, n, k) for i, (n, k) in enumerate(cls.FIELDS.items()) if not k.endswith("?")]
    optional = [(i, n, k) for i, (n, k) in enumerate(cls.FIELDS.items()) if k.endswith("?")]
    lines = ["def parse(obj):", "    try:"]
    lines += [f"        v{i} = obj[{n!r}]" for i, n, _ in required]
    lines += ["    except KeyError:", "        return None"]
    lines += [f"    v{i} = obj.get({n!r})" for i, n, _ in optional]
    checks = [_FAST_CHECK[k].format(v=f"v{i}") for i, _, k in required + optional]
    lines.append(f"    if not ({' and '.join(checks)}):")
    lines.append("        return None")
    args = ", ".join(
        f"tuple(v{i})" if k == _BLOCKS else f"v{i}" for i, k in enumerate(cls.FIELDS.values())
    )
    count = " + ".join([str(1 + len(required))] + [f"({n!r} in obj)" for _, n, _ in optional])
    lines.append(f"    if len(obj) == {count}:")
    lines.append(f"        return cls({args}, extra={{}})")
    lines.append("    extra = {k: x for k, x in obj.items() if k not in fields}")
    # JSON parsers disagree on huge integers (some give floats) and on nested
    # values; leave anything but plain scalars to the standard parser.
    lines.append("    for x in extra.values():")
    lines.append("        if type(x) not in _SCALARS or (type(x) is float and not -_BIG < x < _BIG):")
    lines.append("            return None")
    lines.append(f"    return cls({args}, extra=extra)")
    namespace: dict[str, Any] = {
        "cls": cls,
        "_INT_ONLY": _INT_ONLY,
        "_SCALARS": _SCALARS,
        "_BIG": float(2**53),
        "fields": frozenset(cls.FIELDS) | {"ev"},
    }
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from FIELDS only
    return namespace["parse"]


_FAST = {ev: _make_fast_parser(cls) for ev, cls in EVENT_TYPES.items()}

#: The fields of each event kind that name a worker.
WORKER_FIELDS: Mapping[type[Event], tuple[str, ...]] = {
    cls: tuple(f for f in ("worker", "src", "dst") if f in cls.FIELDS) for cls in EVENT_TYPES.values()
}


def parse_event(obj: object) -> Event:
    """Like :func:`event_from_dict`, fast for well-formed input."""
    if type(obj) is dict:
        ev = obj.get("ev")
        fast = _FAST.get(ev) if type(ev) is str else None
        if fast is not None:
            event = fast(obj)
            if event is not None:
                return event
    return event_from_dict(obj)
