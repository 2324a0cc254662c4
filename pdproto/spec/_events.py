"""History events, format versions 1 and 1.1: one frozen class per event kind.

An event is a small immutable value.  ``Event.to_dict()`` gives its JSON
object (``"ev"`` first) and :func:`event_from_dict` parses and strictly
validates one; unknown extra keys (a timestamp ``"t"``, a ``"rank"``) are kept
in ``extra`` and written back unchanged.

The field specification in each class's ``FIELDS`` is the single source of
truth for validation, serialisation and the documentation table.

Format 1.1 adds *features* a history declares in its header
(:data:`FEATURES`): an event kind or field that belongs to a feature
(:data:`FEATURE_KINDS`, :data:`FEATURE_FIELDS`) is parsed only when the
feature is declared.  A version 1 history declares none, so it reads exactly
as before: ``share`` is an unknown kind there, and ``layers`` / ``tokens`` on
``transfer_start`` are unknown extra keys, kept and ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

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
    "Share",
    "EVENT_TYPES",
    "FEATURES",
    "FEATURE_KINDS",
    "FEATURE_FIELDS",
    "OMITTABLE",
    "event_from_dict",
]

# Field kinds.  Each kind has a checker returning the normalised value or
# raising ValueError with what was expected.
_STR = "str"  # a non-empty string
_NAT = "nat"  # an int >= 0 (bool is not an int here)
_BLOCKS = "blocks"  # a list of ints >= 0, stored as a tuple
_OPT_STR = "str?"
_OPT_NAT = "nat?"
_OPT_RANGE = "range?"  # a half-open range [lo, hi) of ints, 0 <= lo < hi, stored as a tuple
_OPT_BLOCKS = "blocks?"  # blocks a partial history may leave out (feature ``observed``)

_EXPECT = {
    _STR: "a non-empty string",
    _NAT: "an integer >= 0",
    _BLOCKS: "a list of integers >= 0 (block ids)",
    _OPT_STR: "a non-empty string",
    _OPT_NAT: "an integer >= 0",
    _OPT_RANGE: "a half-open range [lo, hi] of two integers with 0 <= lo < hi",
    _OPT_BLOCKS: "a list of integers >= 0 (block ids)",
}
#: a field kind made optional (left out by a partial history), and back
_OPTIONAL_OF = {_STR: _OPT_STR, _NAT: _OPT_NAT, _BLOCKS: _OPT_BLOCKS}
_REQUIRED_OF = {v: k for k, v in _OPTIONAL_OF.items()}

#: The features a version 1.1 history may declare in its header, each with
#: what it adds (docs/history-format.md).
FEATURES: Mapping[str, str] = {
    "share": "the share event: prefix-cache hits on blocks shared by several generations",
    "ranges": "the layers and tokens fields of transfer_start: chunked, layer-wise and "
    "partial-block transfers",
    "kv": "the header's kv object: the KV layout (dtype, fp8 scales, MLA)",
    "parallel": "tp and pp on a declared worker: tensor- and pipeline-parallel ranks per worker",
    "boundary": "the header's boundary: the first-token convention (the seed's sampled token, or "
    "vLLM's recompute of the last prompt token)",
    "observed": "the header's observed object: a partial history that records only some event kinds "
    "(and of some kinds only some fields), as a real engine's log does; transfer completions may "
    "name their request, gen, src and dst",
}
#: Event kinds that exist only with a feature declared.
FEATURE_KINDS: Mapping[str, str] = {"share": "share"}
#: Fields (of an event kind) that exist only with a feature declared; in a
#: history without the feature they are unknown extra keys, as in version 1.
FEATURE_FIELDS: Mapping[tuple[str, str], str] = {
    ("transfer_start", "layers"): "ranges",
    ("transfer_start", "tokens"): "ranges",
    **{
        (ev, name): "observed"
        for ev in ("transfer_read_done", "transfer_write_done", "transfer_failed", "transfer_abort")
        for name in ("request", "gen", "src", "dst")
    },
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
    elif kind in (_BLOCKS, _OPT_BLOCKS):
        if type(value) in (list, tuple) and all(_is_nat(b) for b in value):
            return tuple(value)
    elif kind == _OPT_RANGE:
        if (
            type(value) in (list, tuple)
            and len(value) == 2
            and _is_nat(value[0])
            and _is_nat(value[1])
            and value[0] < value[1]
        ):
            return tuple(value)
    raise ValueError(_EXPECT[kind])


def _range(value: Any) -> tuple[int, int] | None:
    return value if value is None or type(value) is tuple else tuple(value)


def _blocks(value: Any) -> tuple[int, ...]:
    # None: left out by a partial history (feature ``observed``)
    return value if type(value) is tuple or value is None else tuple(value)


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
    #: ``Kind.unchecked(*fields)``: the event built without checking its fields, for
    #: trusted producers (set on each kind below, see :func:`_unchecked_maker`)
    unchecked: ClassVar[Callable[..., Event]]

    def to_dict(self) -> dict[str, Any]:
        """The event's JSON object: ``"ev"`` first, optional fields left out
        when unset, block tuples as lists, extra keys last."""
        out: dict[str, Any] = {"ev": self.EV}
        for name, kind in self.FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = list(value) if kind in (_BLOCKS, _OPT_RANGE, _OPT_BLOCKS) else value
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
    """The fields of a transfer's completion (or abort): its transfer, and
    (format 1.1, feature ``observed``) optionally its request, gen and
    workers, which a partial history whose source names requests rather
    than transfers records (then ``transfer`` may be None: not observed).
    The repr leaves out the optional fields that are unset."""

    FIELDS: ClassVar[Mapping[str, str]] = {
        "transfer": _STR,
        "request": _OPT_STR,
        "gen": _OPT_NAT,
        "src": _OPT_STR,
        "dst": _OPT_STR,
    }
    transfer: str
    request: str | None = None
    gen: int | None = None
    src: str | None = None
    dst: str | None = None
    extra: dict = _EXTRA

    def __repr__(self) -> str:
        parts = [f"transfer={self.transfer!r}"] + [
            f"{name}={getattr(self, name)!r}"
            for name in ("request", "gen", "src", "dst")
            if getattr(self, name) is not None
        ]
        return f"{type(self).__name__}({', '.join(parts)})"


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
    """``layers`` and ``tokens`` (format 1.1, feature ``ranges``) narrow the
    transfer to a half-open range of layers and of prompt positions; None
    (the default, and version 1) means all of them, whole blocks."""

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
        "layers": _OPT_RANGE,
        "tokens": _OPT_RANGE,
    }
    transfer: str
    ticket: str
    request: str
    gen: int
    src: str
    src_blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    dst: str
    dst_blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    layers: tuple[int, int] | None = attrs.field(default=None, converter=_range)
    tokens: tuple[int, int] | None = attrs.field(default=None, converter=_range)
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


for _cls in (TransferReadDone, TransferWriteDone, TransferFailed, TransferAbort):
    _cls.__repr__ = _TransferOnly.__repr__  # type: ignore[method-assign]


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


@_event
class Share(Event):
    """A prefix-cache hit (format 1.1, feature ``share``): the generation takes
    a reference on ``blocks`` of ``worker``, which already hold the KV of its
    prompt positions ``[0, tokens)``; ``tokens`` is the total its shared blocks
    on that worker hold."""

    EV = "share"
    FIELDS = {"request": _STR, "gen": _NAT, "worker": _STR, "blocks": _BLOCKS, "tokens": _NAT}
    request: str
    gen: int
    worker: str
    blocks: tuple[int, ...] = attrs.field(converter=_blocks)
    tokens: int
    extra: dict = _EXTRA


def _unchecked_maker(cls: type) -> Callable[..., Event]:
    """A constructor of ``cls`` for trusted producers (the simulator): the
    fields positionally, as the class takes them, with no conversion, so
    block ids must already be a tuple (and ranges tuples or None).  About
    twice as fast as the attrs ``__init__`` (which converts), and the event
    it makes is equal to the one that makes.  Readers of histories never use
    it: they validate (:func:`event_from_dict`).  Generated straight-line code
    (one slot store per field), since a loop over the fields costs more than
    it saves."""
    fields = [a for a in attrs.fields(cls) if a.name != "extra"]
    params = ", ".join(a.name if a.default is attrs.NOTHING else f"{a.name}={a.default!r}" for a in fields)
    stores = "".join(f"    _set_{a.name}(obj, {a.name})\n" for a in fields)
    source = (
        f"def {cls.__name__}_unchecked({params}):\n"
        f"    obj = _new(_cls)\n{stores}    _set_extra(obj, {{}})\n    return obj\n"
    )
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_set_extra": cls.extra.__set__}
    for a in fields:
        namespace[f"_set_{a.name}"] = getattr(cls, a.name).__set__  # the slot's own store
    exec(compile(source, f"<unchecked {cls.__name__}>", "exec"), namespace)
    return namespace[f"{cls.__name__}_unchecked"]


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
        Share,
    )
}

#: ``cls.unchecked(...)``: see :func:`_unchecked_maker` (trusted producers only)
for _cls in EVENT_TYPES.values():
    _cls.unchecked = staticmethod(_unchecked_maker(_cls))  # type: ignore[attr-defined]


_GEN = frozenset({"gen"})
_COMPLETION = frozenset({"transfer", "request", "gen", "src", "dst"})

#: For each event kind, the fields a partial history (feature ``observed``)
#: may leave out when its header's ``observed.fields`` does not list them
#: (docs/history-format.md says what each omission means): the generation
#: everywhere (then: the request's latest), the blocks of a ``free`` (then:
#: every block the request holds on that worker), the transfer of a
#: completion (then: the request's transfer(s) between ``src`` and ``dst``),
#: a submit's prompt length.  Every other field is always recorded.
OMITTABLE: Mapping[str, frozenset[str]] = {
    "submit": frozenset({"gen", "prompt_len", "max_new_tokens"}),
    "reserve": _GEN,
    "prefill_start": _GEN,
    "prefill_done": _GEN,
    "alloc": _GEN,
    "transfer_start": _GEN | {"layers", "tokens"},
    "transfer_read_done": _COMPLETION,
    "transfer_write_done": _COMPLETION,
    "transfer_failed": _COMPLETION,
    "transfer_abort": _COMPLETION,
    "commit": _GEN,
    "decode": _GEN,
    "finish": _GEN | {"reason"},
    "cancel": _GEN | {"reason"},
    "fail": _GEN | {"reason"},
    "free": frozenset({"blocks", "request", "gen"}),
    "restart": frozenset(),
    "share": _GEN,
}
#: Kinds whose recorded fields must include at least one of these (else an
#: event of the kind says nothing the monitor can use).
ONE_OF_RECORDED: Mapping[str, tuple[str, ...]] = {
    ev: ("blocks", "request")
    if ev == "free"
    else ("transfer", "request")
    if ev.startswith("transfer_") and ev != "transfer_start"
    else ()
    for ev in EVENT_TYPES
}


def field_kinds(ev: str, recorded: frozenset[str] | None = None) -> Mapping[str, str]:
    """The field specification the reader applies to events of kind ``ev``:
    its ``FIELDS``, or, when a partial history lists the fields it records
    (``recorded``), those fields required and every other one optional."""
    fields = EVENT_TYPES[ev].FIELDS
    if recorded is None:
        return fields
    return {n: _REQUIRED_OF.get(k, k) if n in recorded else _OPTIONAL_OF.get(k, k) for n, k in fields.items()}


def undeclared_feature(
    what: str, feature: str, features: frozenset[str], field: str, value: object = None
) -> HistoryFormatError:
    """The format error for ``what`` (an event kind, field or header key)
    that belongs to ``feature``, which the header's ``features`` lack."""
    return HistoryFormatError(
        f"{what} belongs to feature {feature!r}, not declared in this history, whose header "
        f'declares features {sorted(features)}; add "{feature}" to them',
        field=field,
        value=value,
    )


def event_from_dict(
    obj: object,
    features: Iterable[str] | None = None,
    *,
    legacy: bool = False,
    observed: Any = None,
) -> Event:
    """Parse one event object, strictly.

    ``features`` are the format 1.1 features the history declares (see
    :data:`FEATURES`; None, the default, allows them all).  Using one that is
    not declared is an error, except in a version 1 history (``legacy``),
    which reads as it always did: a feature's event kind is unknown there and
    a feature's field is an unknown extra key.  Raises
    :class:`HistoryFormatError` (without a line; the reader adds it) naming the
    field and the offending value.

    ``observed`` (a :class:`~pdproto.spec.Observation`, or None for a complete
    history) refuses the kinds it does not observe and lets an event leave
    out the fields it does not record.
    """
    allowed = None if features is None else frozenset(features)
    if legacy:
        allowed = frozenset()
    if not isinstance(obj, dict):
        raise HistoryFormatError(f"expected a JSON object, got {type(obj).__name__} {obj!r:.80}", value=obj)
    if "ev" not in obj:
        raise HistoryFormatError("missing required field", field="ev")
    ev = obj["ev"]
    cls = EVENT_TYPES.get(ev) if isinstance(ev, str) else None
    if cls is not None and allowed is not None and ev in FEATURE_KINDS:
        feature = FEATURE_KINDS[ev]
        if feature not in allowed:
            if legacy:  # version 1: as unknown as it always was
                cls = None
            else:
                raise undeclared_feature(f"event kind {ev!r}", feature, allowed, "ev", ev)
    if cls is None:
        known = [k for k in EVENT_TYPES if allowed is None or FEATURE_KINDS.get(k, "") in allowed | {""}]
        hint = ""
        if isinstance(ev, str) and ev in FEATURE_KINDS:
            hint = f' (it needs a header with "version": "1.1" and "features": ["{FEATURE_KINDS[ev]}"])'
        raise HistoryFormatError(
            f"unknown event kind {ev!r}{hint}; expected one of {', '.join(known)}",
            field="ev",
            value=ev,
        )
    spec = cls.FIELDS
    if observed is not None:
        if ev not in observed.kinds:
            raise HistoryFormatError(
                f"event kind {ev!r} is not one the header's observed.kinds lists "
                f"({', '.join(sorted(observed.kinds)) or 'none'}): a partial history holds only "
                "the kinds it observed",
                field="ev",
                value=ev,
            )
        spec = field_kinds(ev, observed.fields.get(ev))
    kwargs: dict[str, Any] = {}
    extra_fields: set[str] = set()
    for name, kind in spec.items():
        feature = FEATURE_FIELDS.get((ev, name))
        if feature is not None and allowed is not None and feature not in allowed:
            if not legacy and name in obj:
                raise undeclared_feature(f"{ev}.{name}", feature, allowed, name)
            extra_fields.add(name)  # version 1: an unknown extra key
            continue
        if name not in obj or (obj[name] is None and kind.endswith("?")):
            if kind.endswith("?"):
                kwargs[name] = None
                continue
            if observed is not None and name in observed.fields.get(ev, ()):
                raise HistoryFormatError(
                    f"missing field of {ev!r}, which the header's observed.fields says every {ev!r} records",
                    field=name,
                )
            raise HistoryFormatError(f"missing required field of {ev!r}", field=name)
        value = obj[name]
        try:
            kwargs[name] = _check(kind, value)
        except ValueError as exc:
            raise HistoryFormatError(
                f"{ev}.{name} must be {exc}, got {value!r:.80}", field=name, value=value
            ) from None
    extra = {k: v for k, v in obj.items() if k != "ev" and (k not in cls.FIELDS or k in extra_fields)}
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
    _OPT_BLOCKS: (
        "({v} is None or (type({v}) is list and (not {v} or "
        "(set(map(type, {v})) <= _INT_ONLY and min({v}) >= 0))))"
    ),
    _STR: "(type({v}) is str and {v} != '')",
    _NAT: "(type({v}) is int and {v} >= 0)",
    _BLOCKS: "(type({v}) is list and (not {v} or (set(map(type, {v})) <= _INT_ONLY and min({v}) >= 0)))",
    _OPT_STR: "({v} is None or (type({v}) is str and {v} != ''))",
    _OPT_NAT: "({v} is None or (type({v}) is int and {v} >= 0))",
    _OPT_RANGE: "({v} is None or (type({v}) is list and len({v}) == 2 and type({v}[0]) is int "
    "and type({v}[1]) is int and 0 <= {v}[0] < {v}[1]))",
}


def _make_fast_parser(
    cls: type[Event], features: frozenset[str] | None = None, recorded: frozenset[str] | None = None
) -> Callable[[dict], Event | None]:
    names = [a.name for a in attrs.fields(cls) if a.name != "extra"]
    assert names == list(cls.FIELDS), (cls, names)
    spec = field_kinds(cls.EV, recorded)
    # fields of an undeclared feature: left to the careful path whenever present
    absent = [
        n
        for n in cls.FIELDS
        if features is not None and FEATURE_FIELDS.get((cls.EV, n), "") not in features | {""}
    ]
    items = [(i, n, k) for i, (n, k) in enumerate(spec.items()) if n not in absent]
    required = [(i, n, k) for i, n, k in items if not k.endswith("?")]
    optional = [(i, n, k) for i, n, k in items if k.endswith("?")]
    lines = ["def parse(obj):"]
    lines += [f"    if {n!r} in obj:\n        return None" for n in absent]
    lines += ["    try:"]
    lines += [f"        v{i} = obj[{n!r}]" for i, n, _ in required]
    lines += ["    except KeyError:", "        return None"]
    lines += [f"    v{i} = obj.get({n!r})" for i, n, _ in optional]
    checks = [_FAST_CHECK[k].format(v=f"v{i}") for i, _, k in required + optional]
    lines.append(f"    if not ({' and '.join(checks)}):")
    lines.append("        return None")

    def arg(i: int, n: str, k: str) -> str:
        if n in absent:
            return "None"
        if k == _BLOCKS:
            return f"tuple(v{i})"
        if k == _OPT_BLOCKS:
            return f"(None if v{i} is None else tuple(v{i}))"
        if k == _OPT_RANGE:
            return f"(None if v{i} is None else tuple(v{i}))"
        return f"v{i}"

    args = ", ".join(arg(i, n, k) for i, (n, k) in enumerate(spec.items()))
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


@functools.cache
def fast_parsers(
    features: frozenset[str] | None = None, observed: Any = None
) -> Mapping[str, Callable[[dict], Event | None]]:
    """The generated parser of each event kind a history with these
    ``features`` may contain (None: every feature).  A field of an undeclared
    feature is left to :func:`event_from_dict`, which knows the version.
    With ``observed`` (an :class:`~pdproto.spec.Observation`), only the kinds
    it observes, each with the fields it records."""
    return {
        ev: _make_fast_parser(cls, features, None if observed is None else observed.fields.get(ev))
        for ev, cls in EVENT_TYPES.items()
        if (features is None or FEATURE_KINDS.get(ev, "") in features | {""})
        and (observed is None or ev in observed.kinds)
    }


_FAST = fast_parsers()


def features_used(event: Event) -> frozenset[str]:
    """The format 1.1 features ``event`` uses (its kind's, and those of the
    feature fields it sets)."""
    used = set()
    kind = FEATURE_KINDS.get(event.EV)
    if kind is not None:
        used.add(kind)
    for name, feature in _FEATURE_FIELDS_OF.get(type(event), ()):
        if getattr(event, name) is not None:
            used.add(feature)
    return frozenset(used)


_FEATURE_FIELDS_OF = {
    cls: tuple((name, f) for (ev, name), f in FEATURE_FIELDS.items() if ev == cls.EV)
    for cls in EVENT_TYPES.values()
    if any(ev == cls.EV for ev, _ in FEATURE_FIELDS)
}

#: The fields of each event kind that name a worker.
WORKER_FIELDS: Mapping[type[Event], tuple[str, ...]] = {
    cls: tuple(f for f in ("worker", "src", "dst") if f in cls.FIELDS) for cls in EVENT_TYPES.values()
}


def parse_event(
    obj: object, features: frozenset[str] | None = None, legacy: bool = False, observed: Any = None
) -> Event:
    """Like :func:`event_from_dict`, fast for well-formed input."""
    if type(obj) is dict:
        ev = obj.get("ev")
        fast = fast_parsers(features, observed).get(ev) if type(ev) is str else None
        if fast is not None:
            event = fast(obj)
            if event is not None:
                return event
    return event_from_dict(obj, features, legacy=legacy, observed=observed)
