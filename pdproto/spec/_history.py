"""Reading and writing histories: JSON Lines, format version 1.

The reader streams: it holds one line at a time, so memory stays constant in
the length of the file.  Every problem is a :class:`HistoryFormatError`
naming the file, the 1-based line (blank lines and the header count), the
field and the offending value.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any, Iterable, Iterator, Mapping

import attrs

from .._errors import HistoryFormatError
from ._events import _FAST as FAST_PARSERS
from ._events import WORKER_FIELDS, Event, parse_event

try:  # an optional accelerator: pip install 'pdproto[fast]'
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = None

__all__ = [
    "FORMAT_VERSION",
    "POLICIES",
    "ROLES",
    "WorkerSpec",
    "HistoryHeader",
    "HistoryReader",
    "HistoryWriter",
    "open_history",
    "read_events",
    "write_history",
]

FORMAT_VERSION = 1
POLICIES = ("push", "pull")
ROLES = ("prefill", "decode")


def _role(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {value!r}")


def _nat(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class WorkerSpec:
    """A declared worker: its role and the size of its block pool."""

    role: str = attrs.field(validator=_role)
    blocks: int = attrs.field(validator=_nat)


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
    worker's pool.  ``extra`` keeps unknown header keys.
    """

    policy: str = attrs.field(default="push", validator=_policy)
    complete: bool = False
    workers: Mapping[str, WorkerSpec] | None = attrs.field(
        default=None, converter=_workers, hash=False
    )
    version: int = FORMAT_VERSION
    extra: dict = attrs.field(factory=dict, hash=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pdproto": "history", "version": self.version}
        out["policy"] = self.policy
        out["complete"] = self.complete
        if self.workers is not None:
            out["workers"] = {
                name: {"role": spec.role, "blocks": spec.blocks}
                for name, spec in self.workers.items()
            }
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> "HistoryHeader":
        """Parse a header object; raises HistoryFormatError without a line."""
        version = obj.get("version")
        if version != FORMAT_VERSION or type(version) is not int:
            raise HistoryFormatError(
                f"unsupported history version {version!r}; this pdproto reads version "
                f"{FORMAT_VERSION}",
                field="version",
                value=version,
            )
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
                specs[name] = WorkerSpec(role, size)
        known = {"pdproto", "version", "policy", "complete", "workers"}
        extra = {k: v for k, v in obj.items() if k not in known}
        return cls(policy=policy, complete=complete, workers=specs, extra=extra)


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
        self, stream: IO[str] | IO[bytes] | Iterable[str] | Iterable[bytes], name: str = "<history>"
    ) -> None:
        self.name = name
        self._lines = iter(stream)
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
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise HistoryFormatError(
                f"not valid JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}",
                source=self.name,
                line=self.line,
                value=text[:200],
            ) from None
        except RecursionError:
            raise HistoryFormatError(
                "JSON nested too deeply", source=self.name, line=self.line
            ) from None

    def _next_object(self) -> tuple[int, object] | None:
        for raw in self._lines:
            self.line += 1
            obj = self._decode(raw)
            if obj is not _BLANK:
                return self.line, obj
        return None

    def _read_first(self) -> None:
        first = self._next_object()
        if first is None:
            return
        line, obj = first
        if _is_header(obj):
            if obj.get("pdproto") != "history":
                raise HistoryFormatError(
                    f"header must say \"pdproto\": \"history\", got {obj['pdproto']!r}",
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
            event = parse_event(obj)
        except HistoryFormatError as exc:
            error = exc
            if _is_header(obj):
                error = HistoryFormatError("a header is allowed only as the first line", value=obj)
            raise error.located(self.name, line) from None
        if self.header.workers is not None:
            self._check_workers(event, line)
        return event

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
        parsers = FAST_PARSERS
        workers = self.header.workers
        worker_fields = WORKER_FIELDS
        line = self.line
        try:
            for raw in self._lines:
                line += 1
                event = None
                if fast_loads is not None:
                    try:
                        obj = fast_loads(raw)
                    except Exception:
                        obj = None
                    if type(obj) is dict:
                        ev = obj.get("ev")
                        parser = parsers.get(ev) if type(ev) is str else None
                        if parser is not None:
                            event = parser(obj)
                if event is None:
                    self.line = line
                    obj = self._decode(raw)
                    if obj is _BLANK:
                        continue
                    event = self._parse(line, obj)
                elif workers is not None:
                    for field in worker_fields[type(event)]:
                        w = getattr(event, field)
                        if w is not None and w not in workers:
                            self._check_workers(event, line)
                self.events += 1
                self.line = line
                yield line, event
        finally:
            self.line = line


_BLANK = object()


class open_history:
    """Open a history file (``"-"`` is standard input) for reading.

    Use as a context manager::

        with open_history("trace.jsonl") as reader:
            for line, event in reader:
                ...
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
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
            except OSError as exc:
                raise HistoryFormatError(
                    f"cannot open: {exc.strerror}", source=self.path, value=self.path
                ) from None
            self._file = stream
        try:
            return HistoryReader(stream, name)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str | os.PathLike[str]) -> Iterator[tuple[int, Event]]:
    """Yield ``(line, event)`` from the history at ``path``, streaming."""
    with open_history(path) as reader:
        yield from reader


class HistoryWriter:
    """Write a history: the header first, then one event per line."""

    def __init__(self, stream: IO[str], header: HistoryHeader | None = None) -> None:
        self._stream = stream
        self.line = 0
        if header is not None:
            self._write(header.to_dict())

    def _write(self, obj: dict[str, Any]) -> None:
        self._stream.write(json.dumps(obj, separators=(", ", ": ")))
        self._stream.write("\n")
        self.line += 1

    def write(self, event: Event) -> int:
        """Write one event; returns its line number."""
        self._write(event.to_dict())
        return self.line


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
