"""The exceptions pdproto raises.  Each carries its data as attributes."""

from __future__ import annotations

__all__ = [
    "PdprotoError",
    "FileFormatError",
    "HistoryFormatError",
    "UsageError",
    "LimitError",
    "MissingExtraError",
    "ModelLoadError",
    "TransportError",
    "MAX_INT_DIGITS",
    "format_amount",
    "parse_int",
]


class PdprotoError(Exception):
    """Base class of every error pdproto raises on purpose.

    The command-line interface turns these into one clear message and exit
    status 2; anything else is a bug in pdproto.
    """


class UsageError(PdprotoError, ValueError):
    """A bad argument: ``what`` was given ``value``; ``allowed`` says what fits."""

    def __init__(self, what: str, value: object, allowed: str) -> None:
        self.what = what
        self.value = value
        self.allowed = allowed
        super().__init__(f"{what}: {value!r} is not allowed; expected {allowed}")


class FileFormatError(PdprotoError, ValueError):
    """A file that does not follow its format (a history, a trace).

    ``source`` names the file (or ``<stdin>``), ``line`` is 1-based (0 when
    the problem is not tied to a line), ``field`` the offending key or
    column (or None), ``value`` the offending value, and ``problem`` says
    what was expected.  The message is ``source:line: field 'f': problem``,
    with `` (got value)`` added where the kind of file says so.
    """

    #: whether the message ends with the offending value
    SHOW_VALUE = False

    def __init__(
        self,
        problem: str,
        *,
        source: str = "<file>",
        line: int = 0,
        field: str | None = None,
        value: object = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.line = line
        self.field = field
        self.value = value
        where = f"{source}:{line}" if line else source
        what = f" field {field!r}:" if field is not None else ""
        got = ""
        if self.SHOW_VALUE and value is not None:
            shown = value[:40] + "..." if isinstance(value, str) and len(value) > 40 else value
            got = f" (got {shown!r})"
        super().__init__(f"{where}:{what} {problem}{got}")


class HistoryFormatError(FileFormatError):
    """A history that does not follow the format (see :class:`FileFormatError`)."""

    def __init__(
        self,
        problem: str,
        *,
        source: str = "<history>",
        line: int = 0,
        field: str | None = None,
        value: object = None,
    ) -> None:
        super().__init__(problem, source=source, line=line, field=field, value=value)

    def located(self, source: str, line: int) -> HistoryFormatError:
        """The same error, placed at ``source``:``line``."""
        return HistoryFormatError(self.problem, source=source, line=line, field=self.field, value=self.value)


class LimitError(PdprotoError, ValueError):
    """A run that would need more than a limit allows, refused before it starts.

    ``what`` says what needs it, ``needed`` and ``limit`` are in ``unit``
    (bytes, characters, ...), ``flag`` names the setting that raises the limit.
    ``line`` is the 1-based history line that asked for it (0 when none).
    """

    def __init__(
        self, what: str, needed: int, limit: int, flag: str, *, unit: str = "bytes", line: int = 0
    ) -> None:
        self.what = what
        self.needed = needed
        self.limit = limit
        self.flag = flag
        self.unit = unit
        self.line = line
        where = f"history line {line}: " if line else ""
        super().__init__(
            f"{where}{what} needs {format_amount(needed, unit)}, over the limit of "
            f"{format_amount(limit, unit)}; raise it with {flag}"
        )


class MissingExtraError(PdprotoError, ImportError):
    """A feature needs an optional dependency that is not installed:
    ``feature`` needs the ``module`` of the ``extra`` (``pip install 'pdproto[extra]'``)."""

    def __init__(self, feature: str, module: str, extra: str, hint: str = "") -> None:
        self.feature = feature
        self.module = module
        self.extra = extra
        self.hint = hint
        super().__init__(
            f"{feature} needs {module}, which is not installed: pip install 'pdproto[{extra}]'"
            + (f" ({hint})" if hint else "")
        )


class TransportError(PdprotoError):
    """A transport library (``--transport nixl`` / ``mooncake``) that failed
    where the history says the transfer succeeded, that did not finish in
    time, or that cannot start here: ``transport`` names it, ``what`` the
    transfer or step, ``detail`` is the library's own text."""

    def __init__(self, transport: str, what: str, detail: str) -> None:
        self.transport = transport
        self.what = what
        self.detail = detail
        super().__init__(f"the {transport} transport: {what}: {detail}")


class ModelLoadError(PdprotoError):
    """A model (file, module or builder) that failed while pdproto loaded it.

    ``spec`` is the model as given, ``stage`` what was being done
    (``"import"``, ``"build"``), ``file`` and ``line`` where the model's own
    code failed (None/0 when unknown), ``error`` the exception it raised (also
    the ``__cause__``, which ``pdproto --debug`` prints in full).
    """

    def __init__(
        self, spec: str, stage: str, error: BaseException, file: str | None = None, line: int = 0
    ) -> None:
        self.spec = spec
        self.stage = stage
        self.error = error
        self.file = file
        self.line = line
        where = f"{file}:{line}: " if file and line else (f"{file}: " if file else "")
        text = error.msg if isinstance(error, SyntaxError) and error.msg else str(error)
        text = " ".join(text.split())
        if len(text) > 200:
            text = text[:200] + "..."
        kind = type(error).__name__
        super().__init__(f"model {spec!r} failed at {stage}: {where}{kind}" + (f": {text}" if text else ""))


def format_amount(value: int, unit: str = "bytes") -> str:
    """``value`` for a message: binary units for bytes; huge numbers as ``~10**N``."""
    if unit != "bytes":
        return f"{value:,} {unit}" if value < 10**15 else f"~10**{len(str(value)) - 1} {unit}"
    if value >= 2**70:
        return f"~10**{len(str(value)) - 1} bytes"
    amount = float(value)
    for name in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB"):
        if amount < 1024 or name == "ZiB":
            return f"{value} bytes" if name == "bytes" else f"{amount:.1f} {name}"
        amount /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


#: Python refuses to convert decimal strings longer than this (sys.int_info).
MAX_INT_DIGITS = 4300


def parse_int(text: str, what: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``text`` as an integer: ASCII digits only (``str.isdigit`` also accepts
    ``'²'``, which ``int`` refuses, and ``int`` accepts Arabic-Indic digits),
    an optional sign, ``_`` between digits, at most :data:`MAX_INT_DIGITS`
    digits, within ``[minimum, maximum]``.  Raises :class:`UsageError`
    naming ``what``."""
    bounds = _bounds(minimum, maximum)
    # ASCII whitespace only: str.strip also drops characters such as '\x1f'
    # that int() refuses around a number
    s = text.strip(" \t\n\r\x0b\x0c") if isinstance(text, str) else ""
    digits = s[1:] if s[:1] in ("+", "-") else s
    if not (
        digits
        and digits.isascii()
        and digits.replace("_", "").isdigit()
        and not digits.startswith("_")
        and not digits.endswith("_")
        and "__" not in digits
    ):
        raise UsageError(what, text, f"an integer{bounds} in ASCII digits")
    if len(digits) > MAX_INT_DIGITS:
        raise UsageError(what, f"{s[:12]}... ({len(digits)} digits)", f"an integer{bounds}")
    value = int(s)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        shown: object = value if len(digits) <= 30 else f"{s[:12]}... ({len(digits)} digits)"
        raise UsageError(what, shown, f"an integer{bounds}")
    return value


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum:,}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum:,}"
    return ""
