"""Reading and writing histories: JSON Lines, format version 1.

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
    "MAX_LINE_BYTES",
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
#: The longest line the reader accepts by default, in bytes (``pdproto audit
#: --max-line-bytes`` raises it).  An event line is well under a kilobyte.
MAX_LINE_BYTES = 4 << 20
#: Bytes read from a file at a time.
_CHUNK = 1 << 20
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
            raise HistoryFormatError(
                "JSON nested too deeply", source=self.name, line=self.line
            ) from None
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
                f"line longer than {self.max_line_bytes:,} bytes (the limit; raise it with "
                "--max-line-bytes)",
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
                    event = self._parse(line, obj)
                elif workers is not None:
                    for field in worker_fields[type(event)]:
                        w = getattr(event, field)
                        if w is not None and w not in workers:
                            self._check_workers(event, line)
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
