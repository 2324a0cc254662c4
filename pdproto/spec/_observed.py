"""Partial observation (format 1.1, feature ``observed``): which event kinds,
and of those which fields, the source of a history could see.

A real engine's log records a few of the seventeen event kinds, and of those
often not every field (vLLM names a request whose blocks it releases, not the
block ids).  A history that says so in its header's ``observed`` object is
*partial*: events of other kinds never appear in it, and their absence proves
nothing.  The monitor then judges only the invariants whose evidence the
observed kinds carry (docs/invariants.md, ``INVARIANT_NEEDS``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .._errors import HistoryFormatError, UsageError
from ._events import EVENT_TYPES, FEATURE_FIELDS, FEATURE_KINDS, OMITTABLE, ONE_OF_RECORDED

__all__ = ["Observation"]


def _fields(value: Mapping[str, Iterable[str]] | None) -> dict[str, frozenset[str]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"fields must be a mapping of event kind -> field names, got {value!r:.80}")
    return {kind: frozenset(names) for kind, names in value.items()}


def _kinds(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise ValueError(f"kinds must be a collection of event kinds, not the string {value!r}")
    return frozenset(value)


@attrs.frozen
class Observation:
    """What a partial history's source could see.

    ``kinds``: the event kinds it observed (the history holds no other kind).
    ``fields``: for some of those kinds, the fields each of its events records;
    an event of such a kind may leave out the others, within
    :data:`~pdproto.spec.OMITTABLE` (a field not listed there is always
    recorded).  A kind not in ``fields`` records every field.

    >>> obs = Observation({"free", "transfer_read_done"},
    ...                   {"free": {"worker", "request"}, "transfer_read_done": {"request", "src"}})
    >>> obs.observes("free"), obs.observes("alloc"), obs.records("free", "blocks")
    (True, False, False)
    """

    kinds: frozenset[str] = attrs.field(converter=_kinds)
    fields: Mapping[str, frozenset[str]] = attrs.field(factory=dict, converter=_fields, hash=False)

    def __attrs_post_init__(self) -> None:
        unknown = sorted(k for k in self.kinds if k not in EVENT_TYPES)
        if unknown:
            raise ValueError(
                f"unknown event kind(s) {unknown} in kinds; expected some of {', '.join(EVENT_TYPES)}"
            )
        for kind, names in self.fields.items():
            if kind not in self.kinds:
                raise ValueError(
                    f"fields names kind {kind!r}, which kinds does not list; observed kinds: "
                    f"{', '.join(sorted(self.kinds)) or '(none)'}"
                )
            known = EVENT_TYPES[kind].FIELDS
            bad = sorted(n for n in names if n not in known)
            if bad:
                raise ValueError(
                    f"fields.{kind} names {bad}, not field(s) of {kind!r}; its fields: {', '.join(known)}"
                )
            missing = [n for n in known if n not in names and n not in OMITTABLE[kind]]
            if missing:
                raise ValueError(
                    f"fields.{kind} leaves out {missing}, which every {kind!r} records; it may "
                    "leave out only "
                    f"{', '.join(sorted(OMITTABLE[kind])) or 'nothing'}"
                )
            need = ONE_OF_RECORDED.get(kind)
            if need and not any(n in names for n in need):
                raise ValueError(
                    f"fields.{kind} must list at least one of {', '.join(need)}: an event "
                    "without them names nothing to judge"
                )

    def observes(self, kind: str) -> bool:
        """Whether the source could see events of ``kind``."""
        return kind in self.kinds

    def records(self, kind: str, field: str) -> bool:
        """Whether every observed event of ``kind`` records ``field``."""
        if kind not in self.kinds:
            return False
        names = self.fields.get(kind)
        if names is None:  # every field it always has; an optional one may be missing
            return not EVENT_TYPES[kind].FIELDS.get(field, "?").endswith("?")
        return field in names

    def omits(self, kind: str) -> frozenset[str]:
        """The fields an event of ``kind`` may leave out."""
        names = self.fields.get(kind)
        if names is None:
            return frozenset()
        return frozenset(n for n in EVENT_TYPES[kind].FIELDS if n not in names)

    def terms(self, features: Iterable[str] = ()) -> frozenset[str]:
        """What this observation provides, in the terms of
        :data:`~pdproto.spec.INVARIANT_NEEDS`: each observed kind, each
        ``kind.field`` every event of that kind records, and the kinds of
        format 1.1 features not in ``features`` (a history without feature
        ``share`` has no share to miss)."""
        out = set(self.kinds)
        out |= {k for k, f in FEATURE_KINDS.items() if f not in features}
        for kind in self.kinds:
            out |= {f"{kind}.{n}" for n in EVENT_TYPES[kind].FIELDS if self.records(kind, n)}
        return frozenset(out)

    def features_used(self) -> frozenset[str]:
        """The format 1.1 features (besides ``observed``) its kinds and fields need."""
        used = {FEATURE_KINDS[k] for k in self.kinds if k in FEATURE_KINDS}
        for kind, names in self.fields.items():
            used |= {FEATURE_FIELDS[(kind, n)] for n in names if (kind, n) in FEATURE_FIELDS}
        return frozenset(used) - {"observed"}

    def to_dict(self) -> dict[str, Any]:
        """The header's ``observed`` object (kinds in the order of
        :data:`~pdproto.spec.EVENT_TYPES`, fields in each kind's order)."""
        out: dict[str, Any] = {"kinds": [k for k in EVENT_TYPES if k in self.kinds]}
        if self.fields:
            out["fields"] = {
                k: [n for n in EVENT_TYPES[k].FIELDS if n in self.fields[k]]
                for k in EVENT_TYPES
                if k in self.fields
            }
        return out

    @classmethod
    def from_dict(cls, obj: object) -> Observation:
        """Parse a header's ``observed`` object; raises
        :class:`~pdproto.HistoryFormatError` (without a line) naming the key."""
        if not isinstance(obj, dict):
            raise HistoryFormatError(
                f'observed must be an object {{"kinds": [...], "fields": {{kind: [...]}}}}, got {obj!r:.80}',
                field="observed",
                value=obj,
            )
        for key in obj:
            if key not in ("kinds", "fields"):
                raise HistoryFormatError(
                    f"observed.{key} is not an observed key; expected kinds, fields",
                    field=f"observed.{key}",
                    value=obj[key],
                )
        kinds = obj.get("kinds")
        if type(kinds) is not list or not all(type(k) is str for k in kinds):
            raise HistoryFormatError(
                f"observed.kinds must be a list of event kinds (some of {', '.join(EVENT_TYPES)}), "
                f"got {kinds!r:.80}",
                field="observed.kinds",
                value=kinds,
            )
        fields = obj.get("fields", {})
        if type(fields) is not dict or not all(
            type(v) is list and all(type(n) is str for n in v) for v in fields.values()
        ):
            raise HistoryFormatError(
                f"observed.fields must be an object of event kind -> list of field names, got {fields!r:.80}",
                field="observed.fields",
                value=fields,
            )
        for name, listed in (("kinds", kinds), *((f"fields.{k}", v) for k, v in fields.items())):
            twice = sorted({n for n in listed if listed.count(n) > 1})
            if twice:
                raise HistoryFormatError(
                    f"observed.{name} lists {twice} more than once", field=f"observed.{name}", value=listed
                )
        try:
            return cls(kinds, fields)
        except ValueError as exc:
            where = "observed.fields" if str(exc).startswith("fields") else "observed.kinds"
            raise HistoryFormatError(f"observed: {exc}", field=where, value=obj) from None

    @classmethod
    def parse_kinds(cls, text: str | Iterable[str]) -> Observation:
        """The observation of ``pdproto audit --observed``: event kinds,
        comma- or space-separated (every field recorded); raises
        :class:`~pdproto.UsageError` on an unknown kind."""
        parts = (
            text.replace(",", " ").split()
            if isinstance(text, str)
            else [p for item in text for p in item.replace(",", " ").split()]
        )
        for kind in parts:
            if kind not in EVENT_TYPES:
                raise UsageError("--observed", kind, "event kinds, some of " + ", ".join(EVENT_TYPES))
        return cls(frozenset(parts))
