"""What every log importer shares: reading a log line by line, the result,
and writing the partial history.

An importer reads an engine's own log (text, one record per line) and turns
the lines it knows into history events.  It never invents: an event is
written only for a line whose meaning the engine's source code fixes, with
the original line number on it (:data:`LOG_LINE_KEY`).  A line that looks like
a handoff line (it names a request and speaks of KV, transfers or blocks) but
matches no known format is counted and its first examples are kept
(:attr:`ImportResult.unrecognised`): never dropped silently.

Streaming, constant memory: the log is read one line at a time (each cut at
:data:`MAX_LOG_LINE`), and the events go to a temporary spool file, because
the header, written first, says what was observed, which is known only at the
end (a vLLM log at DEBUG level shows more kinds than one at INFO).  The state
an importer keeps per request is bounded (:data:`MAX_TRACKED`).
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, ClassVar

import attrs

from .._errors import UsageError
from ..spec import HistoryHeader, HistoryWriter, Observation, parse_event

__all__ = [
    "LOG_LINE_KEY",
    "MAX_EXAMPLES",
    "MAX_LOG_LINE",
    "MAX_TRACKED",
    "Unrecognised",
    "ImportResult",
    "LogImporter",
    "Pattern",
    "run_import",
]

#: The extra key each imported event carries: the 1-based line of the log it
#: came from (a history's own line numbers are those of the history file).
LOG_LINE_KEY = "log_line"
#: How many unrecognised handoff-looking lines are kept as examples.
MAX_EXAMPLES = 5
#: The most request ids an importer remembers at once (lease expiries still
#: to be matched, duplicate suppression across TP ranks); the oldest is
#: forgotten first, so memory stays bounded on any log.
MAX_TRACKED = 1 << 16
#: The longest log line read whole, in characters; the rest of a longer line
#: is skipped (its first MAX_LOG_LINE characters are matched), so that one
#: endless line cannot exhaust memory.
MAX_LOG_LINE = 1 << 20
#: How an event's request is written in the spool (HistoryWriter's JSON).
_REQUEST_KEY = '"request": "'
#: Characters of an unrecognised line kept in an example.
_EXAMPLE_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@attrs.frozen
class Unrecognised:
    """A line that looks like a handoff line but matches no known format."""

    line: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "text": self.text}


@attrs.frozen
class ImportResult:
    """What an import read and wrote.

    ``engine`` and ``source`` name the engine and the version of its source
    code whose log formats were read; ``lines`` is the number of log lines,
    ``events`` the number of events written, ``recognised`` counts the lines
    of each known format (by name, in the importer's order; formats that give
    no event are counted too), ``unrecognised`` the handoff-looking lines that
    matched no format, ``examples`` the first of them.  ``observed`` is the
    set of event kinds the header declares; ``debug`` says whether the log
    holds DEBUG lines (more kinds are observed then); ``more_at_debug`` the
    kinds the same log at DEBUG level would add (empty when it is at DEBUG);
    ``overlong`` the lines longer than :data:`MAX_LOG_LINE` characters (only
    their beginning was read); ``dropped`` the events read but left out of the
    history because the log does not show every event of their kind for the
    requests it names (such a kind cannot be declared observed).
    """

    engine: str
    source: str
    lines: int
    events: int
    recognised: Mapping[str, int]
    unrecognised: int
    examples: tuple[Unrecognised, ...]
    observed: tuple[str, ...]
    debug: bool
    more_at_debug: tuple[str, ...] = ()
    overlong: int = 0
    dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "source": self.source,
            "lines": self.lines,
            "events": self.events,
            "recognised": dict(self.recognised),
            "unrecognised": self.unrecognised,
            "examples": [e.to_dict() for e in self.examples],
            "observed": list(self.observed),
            "debug": self.debug,
            "more_at_debug": list(self.more_at_debug),
            "overlong": self.overlong,
            "dropped": self.dropped,
        }


#: A handler turns a match into event objects (dicts, ``"ev"`` first, without
#: the log line, which is added for it).  It may return an empty list: the
#: line is known and means no event (a duplicate of another TP rank's line, a
#: line that only confirms an earlier one); or None: the line has the format
#: but a value the importer cannot read (a status it does not know), and is
#: counted as unrecognised, never guessed at.
Handler = Callable[["re.Match[str]"], list]


@attrs.frozen
class Pattern:
    """One known log format: a cheap ``anchor`` substring every such line
    contains, the ``regex`` (searched in the line) and the method of the
    importer that handles a match (by name).  ``level`` is the level the
    engine logs it at."""

    name: str
    anchor: str
    regex: re.Pattern[str]
    handler: str
    level: str


class Bounded:
    """A set that forgets its oldest members beyond ``limit``."""

    def __init__(self, limit: int = MAX_TRACKED) -> None:
        self._items: collections.OrderedDict[object, None] = collections.OrderedDict()
        self._limit = limit

    def add(self, item: object) -> bool:
        """Add ``item``; False when it was already there."""
        if item in self._items:
            return False
        self._items[item] = None
        if len(self._items) > self._limit:
            self._items.popitem(last=False)
        return True

    def discard(self, item: object) -> bool:
        """Remove ``item``; True when it was there."""
        return self._items.pop(item, 0) is None

    def __contains__(self, item: object) -> bool:
        return item in self._items


class LogImporter:
    """Base of the engine importers.

    A subclass sets :attr:`ENGINE`, :attr:`SOURCE` (the engine and version
    whose source fixes the formats), :attr:`POLICY`, :attr:`PATTERNS`,
    :attr:`KEYWORDS` (a line without any of them is skipped at once: the fast
    path of long logs), :attr:`HANDOFF` (what makes an unknown line look like
    a handoff line: every one of these patterns is found in it), the kinds it
    observes (:attr:`KINDS`, and :attr:`DEBUG_KINDS` when DEBUG lines add
    some) and the fields each records (:attr:`RECORDS`).  One instance reads
    one log.
    """

    ENGINE: ClassVar[str] = ""
    SOURCE: ClassVar[str] = ""
    POLICY: ClassVar[str] = "push"
    PATTERNS: ClassVar[Sequence[Pattern]] = ()
    KEYWORDS: ClassVar[tuple[str, ...]] = ()
    HANDOFF: ClassVar[tuple[re.Pattern[str], ...]] = (re.compile(r"(?!)"),)
    KINDS: ClassVar[tuple[str, ...]] = ()
    DEBUG_KINDS: ClassVar[tuple[str, ...]] = ()
    #: the fields each observed kind records (a kind not here records all)
    RECORDS: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: how a DEBUG line of this engine looks, in its text and JSON formats,
    #: searched after colour codes are removed (a log with one has the
    #: :attr:`DEBUG_KINDS` observed; so has a log where a line of a format
    #: the engine logs at DEBUG level matched)
    DEBUG_MARKS: ClassVar[tuple[str, ...]] = (" DEBUG ", '"DEBUG"', "[DEBUG]")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {p.name: 0 for p in self.PATTERNS}
        self.unrecognised = 0
        self.examples: list[Unrecognised] = []
        self.debug = False
        self.lines = 0
        self.overlong = 0
        #: request ids to write differently in events already spooled (an id
        #: learnt to be another name of a request after its first events)
        self.renames: dict[str, str] = {}
        self._handlers = [
            (p.name, p.anchor, p.regex, getattr(self, p.handler), p.level == "DEBUG") for p in self.PATTERNS
        ]

    def known(self, match: re.Match[str]) -> list:
        """The handler of a known line that means no event."""
        return []

    def observed(self, debug: bool | None = None) -> tuple[str, ...]:
        """The event kinds this log lets the history declare observed (with
        ``debug``: those it would at that level): kinds of which the log
        shows every event for the requests the history names."""
        debug = self.debug if debug is None else debug
        kinds = set(self.KINDS) | (set(self.DEBUG_KINDS) if debug else set())
        return tuple(sorted(kinds))

    def left_out(self) -> frozenset[str]:
        """The requests (by the name written) none of whose events may be
        written: the log does not show every event of the observed kinds for
        them.  Known at the end of the log."""
        return frozenset()

    def observation(self, kinds: Iterable[str] | None = None) -> Observation:
        """The header's ``observed``: ``kinds`` (default :meth:`observed`)
        with the fields each records."""
        kinds = self.observed() if kinds is None else tuple(kinds)
        return Observation(kinds, {k: self.RECORDS[k] for k in kinds if k in self.RECORDS})

    def lines_of(self, fh: IO[str]) -> Iterator[str]:
        """The lines of an open log, each cut at :data:`MAX_LOG_LINE`
        characters (the rest of a longer line is read and dropped; counted in
        :attr:`overlong`)."""
        read = fh.readline
        limit = MAX_LOG_LINE
        while True:
            line = read(limit)
            if not line:
                return
            if len(line) == limit and line[-1] != "\n":
                self.overlong += 1
                rest = read(limit)
                while rest and rest[-1] != "\n":
                    rest = read(limit)
            yield line

    def events(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        """The event objects of ``lines`` (a log, one line per item, line 1
        first), each with its log line under :data:`LOG_LINE_KEY`."""
        keywords = self.KEYWORDS
        handlers = self._handlers
        handoff = self.HANDOFF
        marks = self.DEBUG_MARKS
        debug = self.debug or not marks  # no marks: the engine's lines carry no level
        lineno = 0
        for lineno, line in enumerate(lines, 1):
            if "\x1b" in line:
                line = _ANSI.sub("", line)
            if not debug:
                if line.startswith("DEBUG "):
                    debug = self.debug = True
                else:
                    for mark in marks:
                        if mark in line:
                            debug = self.debug = True
                            break
            for keyword in keywords:
                if keyword in line:
                    break
            else:
                continue
            for name, anchor, regex, handle, at_debug in handlers:
                if anchor in line:
                    match = regex.search(line)
                    if match is not None:
                        out = handle(match)
                        if out is None:  # the format, but a value the importer cannot read
                            self._unrecognised(lineno, line)
                            break
                        self.counts[name] += 1
                        if at_debug and not debug:  # the engine logs this format at DEBUG only
                            debug = self.debug = True
                        for obj in out:
                            obj[LOG_LINE_KEY] = lineno
                            yield obj
                        break
            else:
                if all(p.search(line) for p in handoff):
                    self._unrecognised(lineno, line)
        self.lines = lineno

    def _unrecognised(self, lineno: int, line: str) -> None:
        self.unrecognised += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(Unrecognised(lineno, line.rstrip("\r\n")[:_EXAMPLE_CHARS]))

    def header(self, observation: Observation | None = None) -> HistoryHeader:
        """The header of the imported history: partial (feature
        ``observed``), not complete (a log excerpt need not run until the
        system went quiet); ``observation`` defaults to what the log read so
        far showed (:meth:`observation`)."""
        return HistoryHeader(
            policy=self.POLICY,
            complete=False,
            features=frozenset({"observed"}),
            observed=self.observation() if observation is None else observation,
            extra={
                "description": f"imported from a {self.ENGINE} log by pdproto import",
                "source": self.SOURCE,
            },
        )


#: How much of the start of a log is looked at for signs of a binary file.
_SNIFF = 8192


def _open_log(path: str) -> IO[str]:
    """The log at ``path`` ('-': standard input) as text; a binary or
    gzip-compressed file is refused (read as text, it would import as an empty
    history)."""
    try:
        raw = open(sys.stdin.fileno(), "rb", closefd=False) if path == "-" else open(path, "rb")
    except FileNotFoundError:
        raise UsageError("LOG", path, "a readable log file (no such file)") from None
    except IsADirectoryError:
        raise UsageError("LOG", path, "a readable log file, not a directory") from None
    except OSError as exc:
        raise UsageError("LOG", path, f"a readable log file ({exc.strerror or exc})") from None
    try:
        head = raw.peek(_SNIFF)[:_SNIFF]
    except OSError as exc:
        raw.close()
        raise UsageError("LOG", path, f"a readable log file ({exc.strerror or exc})") from None
    if head.startswith(b"\x1f\x8b"):
        raw.close()
        raise UsageError("LOG", path, "a text log (this one is gzip-compressed: gunzip it first)")
    if b"\0" in head:
        raw.close()
        raise UsageError("LOG", path, "a text log (this one is a binary file: NUL bytes in its first 8 KiB)")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="\n")


def run_import(importer: LogImporter, log: str, out: str | IO[str] | None = None) -> ImportResult:
    """Read the log at ``log`` ('-': standard input) with ``importer`` and
    write the partial history to ``out``: a path (written to a temporary file
    beside it and renamed over it only when complete, so an existing file is
    never left half-written; '-' is standard output), an open text stream,
    or None (standard output).
    """
    if out == "-":
        out = None
    with _open_log(log) as fh, _Spool() as spool:
        # The spool starts with a provisional header observing every kind the
        # engine can show, so the writer checks each event against it; the
        # final header (what this log showed) replaces that line.
        widest = importer.header(importer.observation(importer.KINDS + importer.DEBUG_KINDS))
        writer = HistoryWriter(spool, widest)  # type: ignore[arg-type]  # the writer only calls write()
        observed, features = widest.observed, widest.features
        written: set[str] = set()
        add_kind = written.add
        total = 0
        write = writer.write
        renames = importer.renames
        try:
            for obj in importer.events(importer.lines_of(fh)):
                add_kind(obj["ev"])
                write(parse_event(obj, features, False, observed))
                total += 1
                if len(renames) > MAX_TRACKED:  # rename what is spooled so far: memory stays bounded
                    spool.rename(renames)
                    renames.clear()
        except OSError as exc:  # reading the log (or writing the spool) failed midway
            raise UsageError(
                "LOG", log, f"a log that can be read to its end ({exc.strerror or exc})"
            ) from None
        spooled = spool.file
        header = importer.header()
        assert header.observed is not None  # an imported history is partial
        keep = frozenset(header.observed.kinds)
        left_out = importer.left_out()
        spooled.seek(0)
        spooled.readline()

        def copy(stream: IO[str]) -> tuple[int, int]:
            return _copy_events(
                spooled, total, stream, importer.renames, keep if written - keep else None, left_out
            )

        if out is None or not isinstance(out, str):
            stream = sys.stdout if out is None else out
            HistoryWriter(stream, header)
            count, dropped = copy(stream)
            stream.flush()
        else:
            count, dropped = _write_atomically(out, header, copy)
    return ImportResult(
        engine=importer.ENGINE,
        source=importer.SOURCE,
        lines=importer.lines,
        events=count,
        recognised=dict(importer.counts),
        unrecognised=importer.unrecognised,
        examples=tuple(importer.examples),
        observed=tuple(sorted(keep)),
        debug=importer.debug,
        more_at_debug=() if importer.debug else tuple(sorted(set(importer.observed(True)) - keep)),
        overlong=importer.overlong,
        dropped=dropped,
    )


class _Spool:
    """The temporary file the events go to, written through :attr:`write`;
    :meth:`rename` replaces it by a copy with request ids renamed."""

    def __init__(self) -> None:
        self.file: IO[str] = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        self.write = self.file.write

    def rename(self, renames: Mapping[str, str]) -> None:
        new: IO[str] = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        try:
            self.file.seek(0)
            new.write(self.file.readline())
            _copy_events(self.file, 0, new, renames, None, frozenset())
        except BaseException:
            new.close()
            raise
        self.file.close()
        self.file, self.write = new, new.write

    def __enter__(self) -> _Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _copy_events(
    spool: IO[str],
    total: int,
    stream: IO[str],
    renames: Mapping[str, str],
    keep: frozenset[str] | None,
    left_out: frozenset[str],
) -> tuple[int, int]:
    """Copy the ``total`` spooled events to ``stream``, each request id in
    ``renames`` written as its new name, only (``keep`` not None) the events
    of the kinds in ``keep``, none of a request (by its new name) in
    ``left_out``; returns (events written, events left out)."""
    if not renames and keep is None and not left_out:  # the common case: the spool as it is
        shutil.copyfileobj(spool, stream)
        return total, 0
    count = dropped = 0
    write = stream.write
    # The spool's lines are the writer's JSON: '{"ev": "KIND", ...' with the
    # request as '"request": "ID"'; an id with an escape is read as JSON.
    for line in spool:
        if keep is not None and line[8 : line.index('"', 8)] not in keep:
            dropped += 1
            continue
        start = line.find(_REQUEST_KEY)
        if start < 0:
            write(line)
            count += 1
            continue
        start += len(_REQUEST_KEY)
        end = line.index('"', start)
        request = line[start:end]
        if "\\" in request:  # an escape (a quote may end the id later): JSON
            obj = json.loads(line)
            request = obj["request"]
            new = renames.get(request)
            if new is not None:
                request = obj["request"] = new
                line = json.dumps(obj, separators=(", ", ": ")) + "\n"
        else:
            new = renames.get(request)
            if new is not None:
                request = new
                line = line[: start - 1] + json.dumps(new) + line[end + 1 :]
        if request in left_out:
            dropped += 1
            continue
        write(line)
        count += 1
    return count, dropped


def _write_atomically(
    path: str, header: HistoryHeader, copy: Callable[[IO[str]], tuple[int, int]]
) -> tuple[int, int]:
    """Write ``header`` and ``copy``'s events to a temporary file beside
    ``path`` and rename it over ``path``; the file gets the mode of the one
    it replaces, or that of a new file under the umask.  A file system error
    is a :class:`UsageError` naming ``-o``."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pdproto-import-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            HistoryWriter(fh, header)
            counts = copy(fh)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        return counts
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError):
            raise UsageError("-o", path, f"a file you may write ({exc.strerror or exc})") from None
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
