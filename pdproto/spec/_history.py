"""Reading and writing histories: JSON Lines, format versions 1 and 1.1.

The reader streams: it reads the file in chunks and holds at most one chunk
and one line, so memory stays constant in the length of the file.  A line
longer than ``max_line_bytes`` (:data:`MAX_LINE_BYTES` unless raised) is an
error, as is an integer of more than 4300 digits (Python's limit), a key given
twice with different values in one object, and a file that cannot be read.
Every problem is a :class:`HistoryFormatError` naming the file, the 1-based
line (blank lines and the header count), the field and the offending value.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

import attrs

from .._errors import HistoryFormatError, UsageError
from ._events import (
    EVENT_TYPES,
    FEATURE_FIELDS,
    FEATURE_KINDS,
    FEATURES,
    WORKER_FIELDS,
    Event,
    TransferStart,
    fast_parsers,
    features_used,
    field_kinds,
    parse_event,
    undeclared_feature,
)
from ._observed import Observation

#: the event classes that can use a format 1.1 feature
_FEATURED = frozenset(EVENT_TYPES[ev] for ev in FEATURE_KINDS) | frozenset(
    EVENT_TYPES[ev] for ev, _ in FEATURE_FIELDS
)

try:  # an optional accelerator: pip install 'pdproto[fast]'
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = None

__all__ = [
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "KV_DTYPES",
    "FP8_DTYPES",
    "KV_SCALES",
    "KV_LAYOUTS",
    "KVSpec",
    "MAX_LINE_BYTES",
    "POLICIES",
    "ROLES",
    "BOUNDARIES",
    "WorkerSpec",
    "HistoryHeader",
    "HistoryReader",
    "HistoryWriter",
    "open_history",
    "read_events",
    "write_history",
]

#: The version a history without format 1.1 features is written as.
FORMAT_VERSION = 1
#: Every version this pdproto reads: 1, and "1.1" (features declared in the
#: header, see :data:`pdproto.spec.FEATURES`).
FORMAT_VERSIONS = (1, "1.1")
#: The longest line the reader accepts by default, in bytes (``pdproto audit
#: --max-line-bytes`` raises it).  An event line is well under a kilobyte.
MAX_LINE_BYTES = 4 << 20
#: Bytes read from a file at a time.
_CHUNK = 1 << 20
POLICIES = ("push", "pull")
ROLES = ("prefill", "decode")
#: The first-token conventions (the header's ``boundary``, format 1.1 feature
#: ``boundary``): ``sampled``, the seed's (P samples the first token; D feeds
#: it at position prompt_len), and ``recompute``, vLLM's (P's sampled token is
#: discarded; D recomputes the last prompt token at position prompt_len - 1).
BOUNDARIES = ("sampled", "recompute")


def _role(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {value!r}")


def _nat(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def _opt_pos(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class WorkerSpec:
    """A declared worker: its role, the size of its block pool and (format
    1.1, feature ``parallel``) its tensor-parallel ranks ``tp`` and pipeline
    stages ``pp`` (None: not declared)."""

    role: str = attrs.field(validator=_role)
    blocks: int = attrs.field(validator=_nat)
    tp: int | None = attrs.field(default=None, validator=_opt_pos)
    pp: int | None = attrs.field(default=None, validator=_opt_pos)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "blocks": self.blocks}
        if self.tp is not None:
            out["tp"] = self.tp
        if self.pp is not None:
            out["pp"] = self.pp
        return out


#: KV dtypes a history's ``kv.dtype`` may name (canonical names, as torch
#: spells them), and the aliases the reader turns into them.
KV_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
#: How fp8 KV is scaled: one scale per layer (and K/V), per block, or per head.
KV_SCALES = ("per-tensor", "per-block", "per-head")
#: KV layouts: ``mha`` (K and V per KV head) and ``mla`` (one latent vector of
#: width ``head_dim`` per token and layer, no heads, replicated on TP ranks).
KV_LAYOUTS = ("mha", "mla")


def _canonical_dtype(value: str | None) -> str | None:
    if value is None:
        return None
    name = _DTYPE_ALIASES.get(value, value) if type(value) is str else value
    if name not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)} (or an alias), got {value!r}")
    return name


@attrs.frozen
class KVSpec:
    """The KV layout a history declares (format 1.1, feature ``kv``).

    Every field is optional (None: not declared; replay then uses its flags
    or defaults).  ``dtype`` is canonical (see :data:`KV_DTYPES`); ``scale``
    is required with an fp8 dtype and refused otherwise; ``layout`` ``mla``
    has no KV heads (``kv_heads`` None or 1).
    """

    layers: int | None = attrs.field(default=None, validator=_opt_pos)
    kv_heads: int | None = attrs.field(default=None, validator=_opt_pos)
    head_dim: int | None = attrs.field(default=None, validator=_opt_pos)
    block_size: int | None = attrs.field(default=None, validator=_opt_pos)
    dtype: str | None = attrs.field(default=None, converter=_canonical_dtype)
    scale: str | None = None
    layout: str = "mha"

    def __attrs_post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(KV_LAYOUTS)}, got {self.layout!r}")
        if self.scale is not None and self.scale not in KV_SCALES:
            raise ValueError(f"scale must be one of {', '.join(KV_SCALES)}, got {self.scale!r}")
        if self.dtype in FP8_DTYPES and self.scale is None:
            raise ValueError(f"scale is required with dtype {self.dtype!r}: one of {', '.join(KV_SCALES)}")
        if self.dtype not in FP8_DTYPES and self.scale is not None:
            raise ValueError(
                f"scale {self.scale!r} is only for an fp8 dtype ({', '.join(FP8_DTYPES)}), "
                f"got dtype {self.dtype!r}"
            )
        if self.layout == "mla" and self.kv_heads not in (None, 1):
            raise ValueError(
                f"kv_heads must be absent or 1 with layout 'mla' (one latent per token), "
                f"got {self.kv_heads!r}"
            )
        if self.layout == "mla" and self.scale == "per-head":
            raise ValueError("scale 'per-head' needs heads; layout 'mla' has none")

    def to_dict(self) -> dict[str, Any]:
        out = {a.name: getattr(self, a.name) for a in attrs.fields(KVSpec)}
        return {k: v for k, v in out.items() if v is not None and not (k == "layout" and v == "mha")}

    @classmethod
    def from_dict(cls, obj: object) -> KVSpec:
        """Parse a header's ``kv`` object; raises HistoryFormatError without a line."""
        if not isinstance(obj, dict):
            raise HistoryFormatError(
                f"kv must be an object {{layers, kv_heads, head_dim, block_size, dtype, scale, layout}}, "
                f"got {obj!r:.80}",
                field="kv",
                value=obj,
            )
        names = [a.name for a in attrs.fields(cls)]
        for key in obj:
            if key not in names:
                raise HistoryFormatError(
                    f"kv.{key} is not a kv key; expected some of {', '.join(names)}",
                    field=f"kv.{key}",
                    value=obj[key],
                )
        for key, value in obj.items():
            if key in ("dtype", "scale", "layout"):
                allowed = {"dtype": KV_DTYPES, "scale": KV_SCALES, "layout": KV_LAYOUTS}[key]
                ok = type(value) is str and (value in allowed or (key == "dtype" and value in _DTYPE_ALIASES))
                expected = (
                    "one of "
                    + ", ".join(allowed)
                    + (" (or an alias: bf16, fp16, fp8, ...)" if key == "dtype" else "")
                )
            else:
                ok = type(value) is int and value >= 1
                expected = "an integer >= 1"
            if not ok:
                raise HistoryFormatError(
                    f"kv.{key} must be {expected}, got {value!r:.80}", field=f"kv.{key}", value=value
                )
        try:
            return cls(**obj)
        except ValueError as exc:  # a combination: fp8 without scale, mla with heads, ...
            raise HistoryFormatError(f"kv: {exc}", field="kv", value=obj) from None


def _policy(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {value!r}")


def _workers(value: Mapping[str, WorkerSpec] | None) -> Mapping[str, WorkerSpec] | None:
    return None if value is None else dict(value)


@attrs.frozen
class HistoryHeader:
    """The optional first line of a history.

    ``policy`` is ``"push"`` (D capacity reserved before prefill) or ``"pull"``;
    ``complete`` says the history runs until the system went quiet, so the
    end-of-history checks apply; ``workers``, when given, declares every
    worker's pool.  ``extra`` keeps unknown header keys.  ``boundary`` is
    the first-token convention (:data:`BOUNDARIES`; anything but the default
    ``"sampled"`` needs feature ``boundary``, format 1.1).  ``observed``
    (feature ``observed``) makes the history partial: the event kinds and
    fields its source could see (:class:`Observation`); None: every kind, a
    complete record.
    """

    policy: str = attrs.field(default="push", validator=_policy)
    complete: bool = False
    workers: Mapping[str, WorkerSpec] | None = attrs.field(default=None, converter=_workers, hash=False)
    version: int | str | None = None
    extra: dict = attrs.field(factory=dict, hash=False, repr=False)
    features: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    kv: KVSpec | None = None
    boundary: str = "sampled"
    observed: Observation | None = None

    def __attrs_post_init__(self) -> None:
        unknown = sorted(f for f in self.features if f not in FEATURES)
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; expected some of {', '.join(FEATURES)}")
        if self.version is None:  # the lowest version that can say it
            object.__setattr__(self, "version", "1.1" if self.features else FORMAT_VERSION)
        elif self.version not in FORMAT_VERSIONS or type(self.version) not in (int, str):
            raise ValueError(f"version must be one of {FORMAT_VERSIONS}, got {self.version!r}")
        elif self.version == 1 and self.features:
            raise ValueError(f"features {sorted(self.features)} need version '1.1', not 1")
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARIES)}, got {self.boundary!r}")
        used = set()
        if self.kv is not None:
            used.add("kv")
        if self.boundary != "sampled":
            used.add("boundary")
        if self.workers and any(w.tp is not None or w.pp is not None for w in self.workers.values()):
            used.add("parallel")
        if self.observed is not None:
            used |= {"observed"} | self.observed.features_used()
        missing = sorted(used - self.features)
        if missing:
            raise ValueError(f"the header uses feature(s) {missing} without declaring them in features")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pdproto": "history", "version": self.version}
        if self.version != 1:
            out["features"] = [f for f in FEATURES if f in self.features]
        out["policy"] = self.policy
        out["complete"] = self.complete
        if self.kv is not None:
            out["kv"] = self.kv.to_dict()
        if "boundary" in self.features:
            out["boundary"] = self.boundary
        if self.observed is not None:
            out["observed"] = self.observed.to_dict()
        if self.workers is not None:
            out["workers"] = {name: spec.to_dict() for name, spec in self.workers.items()}
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @property
    def block_size(self) -> int | None:
        """The declared tokens per block: ``kv.block_size``, else the
        ``block_size`` extra key that version 1 histories may carry."""
        if self.kv is not None and self.kv.block_size is not None:
            return self.kv.block_size
        value = self.extra.get("block_size")
        return value if type(value) is int and value >= 1 else None

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> HistoryHeader:
        """Parse a header object; raises HistoryFormatError without a line."""
        version = obj.get("version")
        if version not in FORMAT_VERSIONS or type(version) not in (int, str):
            raise HistoryFormatError(
                f"unsupported history version {version!r}; this pdproto reads version "
                + " and ".join(json.dumps(v) for v in FORMAT_VERSIONS),
                field="version",
                value=version,
            )
        features: frozenset[str] = frozenset()
        if version != 1:
            listed = obj.get("features")
            if type(listed) is not list or not all(type(f) is str for f in listed):
                raise HistoryFormatError(
                    f'a version "{version}" header needs "features": a list of some of '
                    f"{', '.join(FEATURES)} (may be empty), got {listed!r:.80}",
                    field="features",
                    value=listed,
                )
            for f in listed:
                if f not in FEATURES:
                    raise HistoryFormatError(
                        f"unknown feature {f!r}; expected some of {', '.join(FEATURES)}",
                        field="features",
                        value=f,
                    )
            features = frozenset(listed)
        policy = obj.get("policy", "push")
        if policy not in POLICIES:
            raise HistoryFormatError(
                f"policy must be one of {', '.join(POLICIES)}, got {policy!r}",
                field="policy",
                value=policy,
            )
        complete = obj.get("complete", False)
        if type(complete) is not bool:
            raise HistoryFormatError(
                f"complete must be true or false, got {complete!r}",
                field="complete",
                value=complete,
            )
        workers = obj.get("workers")
        specs: dict[str, WorkerSpec] | None = None
        if workers is not None:
            if not isinstance(workers, dict):
                raise HistoryFormatError(
                    f"workers must be an object of name -> {{role, blocks}}, got {workers!r:.80}",
                    field="workers",
                    value=workers,
                )
            specs = {}
            for name, spec in workers.items():
                where = f"workers.{name}"
                if not isinstance(spec, dict):
                    raise HistoryFormatError(
                        f"{where} must be an object {{role, blocks}}, got {spec!r:.80}",
                        field=where,
                        value=spec,
                    )
                role, size = spec.get("role"), spec.get("blocks")
                if role not in ROLES:
                    raise HistoryFormatError(
                        f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                        field=f"{where}.role",
                        value=role,
                    )
                if type(size) is not int or size < 0:
                    raise HistoryFormatError(
                        f"{where}.blocks must be an integer >= 0, got {size!r}",
                        field=f"{where}.blocks",
                        value=size,
                    )
                specs[name] = WorkerSpec(role, size, *_parallel(spec, where, version, features))
        kv = None
        if version != 1 and "kv" in obj:
            if "kv" not in features:
                raise undeclared_feature("kv", "kv", features, "kv")
            kv = KVSpec.from_dict(obj["kv"])
        if kv is not None and kv.layers is not None and specs:
            for name, spec in specs.items():
                if spec.pp is not None and kv.layers % spec.pp:
                    raise HistoryFormatError(
                        f"workers.{name}.pp {spec.pp} does not divide kv.layers {kv.layers}: "
                        "pipeline stages hold equal numbers of layers",
                        field=f"workers.{name}.pp",
                        value=spec.pp,
                    )
        boundary = "sampled"
        if version != 1 and "boundary" in obj:
            if "boundary" not in features:
                raise undeclared_feature("boundary", "boundary", features, "boundary")
            boundary = obj["boundary"]
            if boundary not in BOUNDARIES:
                raise HistoryFormatError(
                    f"boundary must be one of {', '.join(BOUNDARIES)}, got {boundary!r:.80}",
                    field="boundary",
                    value=boundary,
                )
        observed = None
        if version != 1 and "observed" in obj:
            if "observed" not in features:
                raise undeclared_feature("observed", "observed", features, "observed")
            observed = Observation.from_dict(obj["observed"])
            for feature in sorted(observed.features_used() - features):
                raise undeclared_feature("observed (its kinds and fields)", feature, features, "observed")
        known = {"pdproto", "version", "policy", "complete", "workers"}
        if version != 1:
            known |= {"features", "kv", "boundary", "observed"}
        extra = {k: v for k, v in obj.items() if k not in known}
        return cls(
            policy=policy,
            complete=complete,
            workers=specs,
            extra=extra,
            version=version,
            features=features,
            kv=kv,
            boundary=boundary,
            observed=observed,
        )


def _parallel(
    spec: Mapping[str, Any], where: str, version: object, features: frozenset[str]
) -> tuple[int | None, int | None]:
    """A declared worker's ``tp`` and ``pp`` (format 1.1, feature ``parallel``;
    a version 1 header's extra worker keys are ignored, as they always were)."""
    if version == 1:
        return None, None
    out: list[int | None] = []
    for key in ("tp", "pp"):
        value = spec.get(key)
        if value is None:
            out.append(None)
            continue
        if "parallel" not in features:
            raise undeclared_feature(f"{where}.{key}", "parallel", features, f"{where}.{key}")
        if type(value) is not int or value < 1:
            raise HistoryFormatError(
                f"{where}.{key} must be an integer >= 1, got {value!r:.80}",
                field=f"{where}.{key}",
                value=value,
            )
        out.append(value)
    return out[0], out[1]


def _is_header(obj: object) -> bool:
    return isinstance(obj, dict) and "pdproto" in obj and "ev" not in obj


class HistoryReader:
    """Iterate over ``(line, event)`` pairs of a history, streaming.

    ``header`` is available as soon as the reader is made (a default header
    when the file has none).  With declared workers an event naming an
    undeclared worker is a format error.  Block ids outside a declared pool
    are *not* format errors: the monitor reports them as ``capacity``.
    """

    def __init__(
        self,
        stream: IO[str] | IO[bytes] | Iterable[str] | Iterable[bytes],
        name: str = "<history>",
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if type(max_line_bytes) is not int or max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be an integer >= 1, got {max_line_bytes!r}")
        self.name = name
        self.max_line_bytes = max_line_bytes
        self._lines = itertools.chain.from_iterable(_chunks(stream, max_line_bytes))
        self.line = 0  # number of the last line read
        self.events = 0
        self._pending: tuple[int, Event] | None = None
        self.header = HistoryHeader()
        self.has_header = False
        self._read_first()

    def _decode(self, raw: str | bytes) -> object:
        """The JSON value of one line (``_BLANK`` for a blank line), by the
        standard library, which decides and words every error."""
        if type(raw) is bytes:
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise HistoryFormatError(
                    f"not UTF-8 text ({exc.reason} at byte {exc.start} of the line)",
                    source=self.name,
                    line=self.line,
                ) from None
        text = raw.strip()  # type: ignore[union-attr]
        if not text:
            return _BLANK
        try:
            obj = json.loads(text)
            if type(obj) is dict and text.count(":") != len(obj):
                # maybe a key given twice (the count is exact without nested
                # objects and colons in strings); the exact check is slower
                obj = json.loads(text, object_pairs_hook=_no_conflicts)
            return obj
        except json.JSONDecodeError as exc:
            raise HistoryFormatError(
                f"not valid JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}",
                source=self.name,
                line=self.line,
                value=text[:200],
            ) from None
        except _Conflict as exc:
            key, first, second = exc.args
            raise HistoryFormatError(
                f"key {key!r} given twice with different values, {first!r:.40} and {second!r:.40}: "
                "the line is ambiguous",
                source=self.name,
                line=self.line,
                field=key,
                value=second,
            ) from None
        except RecursionError:
            raise HistoryFormatError("JSON nested too deeply", source=self.name, line=self.line) from None
        except ValueError as exc:  # an integer over Python's int-string limit
            if "digits" not in str(exc):
                raise
            raise HistoryFormatError(
                f"an integer with more than {sys.get_int_max_str_digits() or 'the allowed'} digits: "
                f"{text[:60]!r}...",
                source=self.name,
                line=self.line,
            ) from None

    def _next_object(self) -> tuple[int, object] | None:
        try:
            for raw in self._lines:
                self.line += 1
                obj = self._decode(raw)
                if obj is not _BLANK:
                    return self.line, obj
        except (_TooLong, OSError) as exc:
            raise self._read_error(exc, self.line + 1) from None
        return None

    def _read_error(self, exc: BaseException, line: int) -> HistoryFormatError:
        """The format error for a line over the cap or a failed read."""
        if isinstance(exc, _TooLong):
            return HistoryFormatError(
                f"line longer than {self.max_line_bytes:,} bytes (the limit; raise it with --max-line-bytes)",
                source=self.name,
                line=line,
                value=exc.args[0],
            )
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return HistoryFormatError(f"cannot read: {reason}", source=self.name, line=line)

    def _read_first(self) -> None:
        first = self._next_object()
        if first is None:
            return
        line, obj = first
        if _is_header(obj):
            if obj.get("pdproto") != "history":
                raise HistoryFormatError(
                    f'header must say "pdproto": "history", got {obj["pdproto"]!r}',
                    source=self.name,
                    line=line,
                    field="pdproto",
                    value=obj["pdproto"],
                )
            try:
                self.header = HistoryHeader.from_dict(obj)  # type: ignore[arg-type]
            except HistoryFormatError as exc:
                raise exc.located(self.name, line) from None
            self.has_header = True
        else:
            self._pending = (line, self._parse(line, obj))

    def _parse(self, line: int, obj: object) -> Event:
        try:
            event = parse_event(obj, self.header.features, self.header.version == 1, self.header.observed)
        except HistoryFormatError as exc:
            error = exc
            if _is_header(obj):
                error = HistoryFormatError("a header is allowed only as the first line", value=obj)
            raise error.located(self.name, line) from None
        if self.header.workers is not None:
            self._check_workers(event, line)
        if type(event) in self._ranged:
            self._check_ranges(event, line)  # type: ignore[arg-type]
        return event

    @property
    def _ranged(self) -> tuple[type, ...]:
        """The event kinds whose ranges the reader checks against the header."""
        return (TransferStart,) if "ranges" in self.header.features else ()

    def _check_ranges(self, event: TransferStart, line: int) -> None:
        """A transfer's ``layers`` within the declared layers, and its block
        lists as long as its ``tokens`` span (with a declared block size)."""
        kv = self.header.kv
        if event.layers is not None:
            layers = kv.layers if kv is not None else None
            if layers is None:
                raise HistoryFormatError(
                    f"transfer_start.layers {list(event.layers)} needs the header's kv.layers (how many "
                    "layers there are, so that readiness can cover them all)",
                    source=self.name,
                    line=line,
                    field="layers",
                    value=list(event.layers),
                )
            if event.layers[1] > layers:
                raise HistoryFormatError(
                    f"transfer_start.layers {list(event.layers)} goes past the {layers} layers the header "
                    f"declares (kv.layers); allowed: [lo, hi] with hi <= {layers}",
                    source=self.name,
                    line=line,
                    field="layers",
                    value=list(event.layers),
                )
        bs = self.header.block_size
        if event.tokens is not None and bs is not None:
            lo, hi = event.tokens
            span = (hi - 1) // bs - lo // bs + 1
            for field in ("src_blocks", "dst_blocks"):
                got = len(getattr(event, field))
                if got != span:
                    raise HistoryFormatError(
                        f"transfer_start.{field} lists {got} block(s), but tokens {list(event.tokens)} span "
                        f"{span} block(s) of {bs} tokens (blocks {lo // bs}..{(hi - 1) // bs} of the table)",
                        source=self.name,
                        line=line,
                        field=field,
                        value=list(getattr(event, field)),
                    )

    def _check_workers(self, event: Event, line: int) -> None:
        workers = self.header.workers
        assert workers is not None
        for field in WORKER_FIELDS[type(event)]:
            worker = getattr(event, field)
            if worker is not None and worker not in workers:
                raise HistoryFormatError(
                    f"{event.EV}.{field} names undeclared worker {worker!r}; "
                    f"declared: {', '.join(workers) or '(none)'}",
                    source=self.name,
                    line=line,
                    field=field,
                    value=worker,
                )

    def __iter__(self) -> Iterator[tuple[int, Event]]:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.events += 1
            yield pending
        # The hot loop: well-formed lines go straight through orjson (when
        # installed) and the generated per-kind parsers; anything else falls
        # to the careful path, which accepts the same lines and names errors.
        fast_loads = _fast_loads
        parsers = fast_parsers(self.header.features, self.header.observed)
        ranged = self._ranged
        workers = self.header.workers
        worker_fields = WORKER_FIELDS
        line = self.line
        events = self.events
        try:
            for raw in self._lines:
                line += 1
                event = None
                if fast_loads is not None:
                    # Anything unusual (not JSON, not an object, no or an
                    # unknown "ev", a field off) raises or gives None here and
                    # takes the careful path, which accepts the same lines and
                    # names errors.  A colon per key, else perhaps a key given
                    # twice (or only a colon in a string): parsed once more,
                    # exactly; a conflict raises and takes the careful path.
                    try:
                        obj = fast_loads(raw)
                        if raw.count(b":") != len(obj):
                            obj = json.loads(raw, object_pairs_hook=_no_conflicts)
                        event = parsers[obj["ev"]](obj)
                    except Exception:
                        pass
                if event is None:
                    self.line = line
                    obj = self._decode(raw)
                    if obj is _BLANK:
                        continue
                    event = self._parse(line, obj)  # which checks workers and ranges
                else:
                    if workers is not None:
                        for field in worker_fields[type(event)]:
                            w = getattr(event, field)
                            if w is not None and w not in workers:
                                self._check_workers(event, line)
                    if ranged and type(event) in ranged:
                        self._check_ranges(event, line)  # type: ignore[arg-type]
                events += 1
                yield line, event
        except (_TooLong, OSError) as exc:
            raise self._read_error(exc, line + 1) from None
        finally:
            # kept in locals while reading; ``line`` and ``events`` are
            # exact again once the loop stops (the end, an error, a break)
            self.line = line
            self.events = events


_BLANK = object()


class _TooLong(Exception):
    """A line over the cap (args: its length so far)."""


class _Conflict(ValueError):
    """A key given twice with different values (args: key, first, second)."""


def _no_conflicts(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj and (obj[key] != value or type(obj[key]) is not type(value)):
            raise _Conflict(key, obj[key], value)
        obj[key] = value
    return obj


def _chunks(stream: Any, limit: int) -> Iterator[list[bytes]]:
    """The lines of ``stream`` (bytes, without the newline), a chunk at a time.

    A file is read in :data:`_CHUNK` pieces, so no line of any length is ever
    held beyond ``limit`` bytes: the lines before a longer one are yielded,
    then :class:`_TooLong` is raised.  Text is encoded to UTF-8.  Any other
    iterable is taken line by line.
    """
    read = getattr(stream, "read1", None) or getattr(stream, "read", None)
    if read is None:
        for raw in stream:
            if type(raw) is str:
                raw = raw.encode("utf-8", "surrogatepass")
            if len(raw) > limit and len(raw.rstrip(b"\r\n")) > limit:
                raise _TooLong(len(raw))
            yield [raw]
        return
    carry: list[bytes] = []
    carried = 0
    while True:
        data = read(_CHUNK)
        if not data:
            break
        if type(data) is str:
            data = data.encode("utf-8", "surrogatepass")
        if b"\n" not in data:
            carry.append(data)
            carried += len(data)
            if carried > limit:
                raise _TooLong(carried)
            continue
        parts = data.split(b"\n")
        if carry:
            parts[0] = b"".join(carry) + parts[0]
            carry = []
        last = parts.pop()
        if last:
            carry.append(last)
        carried = len(last)
        if max(map(len, parts)) > limit:
            n = next(i for i, p in enumerate(parts) if len(p) > limit)
            yield parts[:n]
            raise _TooLong(len(parts[n]))
        yield parts
        if carried > limit:
            raise _TooLong(carried)
    if carry:
        yield [b"".join(carry)]


class open_history:
    """Open a history file (``"-"`` is standard input) for reading.

    Use as a context manager::

        with open_history("trace.jsonl") as reader:
            for line, event in reader:
                ...
    """

    def __init__(self, path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_line_bytes = max_line_bytes
        self._file: IO[bytes] | None = None

    def __enter__(self) -> HistoryReader:
        stream: IO[bytes] | IO[str]
        if self.path == "-":
            stream = getattr(sys.stdin, "buffer", sys.stdin)
            name = "<stdin>"
        else:
            name = self.path
            try:
                stream = open(self.path, "rb")
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
                reason = getattr(exc, "strerror", None) or str(exc)
                raise HistoryFormatError(
                    f"cannot open: {reason}", source=self.path, value=self.path
                ) from None
            self._file = stream
        try:
            return HistoryReader(stream, name, max_line_bytes=self.max_line_bytes)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(
    path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, Event]]:
    """Yield ``(line, event)`` from the history at ``path``, streaming."""
    with open_history(path, max_line_bytes=max_line_bytes) as reader:
        yield from reader


class HistoryWriter:
    """Write a history: the header first, then one event per line.

    A partial history (the header's ``observed``) takes only events of the
    observed kinds, each with at least the fields the header says it records
    (:class:`UsageError` otherwise, writing nothing).

    An event that uses a format 1.1 feature the header does not declare (a
    ``share`` under a version 1 header, a ranged transfer without
    ``"ranges"``) raises :class:`UsageError` and writes nothing: the file would
    not read back as written.  No header is version 1."""

    def __init__(self, stream: IO[str], header: HistoryHeader | None = None) -> None:
        self._stream = stream
        self.line = 0
        self.features = header.features if header is not None else frozenset()
        self.observed = header.observed if header is not None else None
        if header is not None:
            self._write(header.to_dict())

    def _write(self, obj: dict[str, Any]) -> None:
        self._stream.write(json.dumps(obj, separators=(", ", ": ")))
        self._stream.write("\n")
        self.line += 1

    def write(self, event: Event) -> int:
        """Write one event; returns its line number."""
        if type(event) in _FEATURED:
            missing = features_used(event) - self.features
            if missing:
                raise UsageError(
                    "event",
                    event,
                    f"an event the header can say: it uses feature(s) {sorted(missing)}, which the header "
                    f"does not declare (HistoryHeader(features=...))",
                )
        if self.observed is not None:
            self._check_observed(event)
        self._write(event.to_dict())
        return self.line

    def _check_observed(self, event: Event) -> None:
        """A partial history holds only observed kinds, each with the fields
        its header says it records."""
        observed = self.observed
        assert observed is not None
        if event.EV not in observed.kinds:
            raise UsageError(
                "event",
                event,
                f"an event of a kind the header's observed.kinds lists ({', '.join(sorted(observed.kinds))})",
            )
        spec = field_kinds(event.EV, observed.fields.get(event.EV))
        for name, kind in spec.items():
            if getattr(event, name) is None and not kind.endswith("?"):
                raise UsageError(
                    "event",
                    event,
                    f"an event with field {name!r}, which the header's observed.fields says every "
                    f"{event.EV!r} records",
                )


def write_history(
    path: str | os.PathLike[str],
    events: Iterable[Event],
    header: HistoryHeader | None = None,
) -> int:
    """Write ``events`` to ``path`` (atomically: a temporary file is renamed
    over the target only when everything is written).  Returns the number of
    lines written."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            writer = HistoryWriter(fh, header if header is not None else HistoryHeader())
            for event in events:
                writer.write(event)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return writer.line
