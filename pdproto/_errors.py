"""The exceptions pdproto raises.  Each carries its data as attributes."""

from __future__ import annotations

__all__ = ["PdprotoError", "HistoryFormatError", "UsageError"]


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


class HistoryFormatError(PdprotoError, ValueError):
    """A history that does not follow the format.

    ``source`` names the file (or ``<stdin>``), ``line`` is 1-based (0 when
    the problem is not tied to a line), ``field`` the offending key (or None),
    ``value`` the offending value, and ``problem`` says what was expected.
    """

    def __init__(
        self,
        problem: str,
        *,
        source: str = "<history>",
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
        super().__init__(f"{where}:{what} {problem}")

    def located(self, source: str, line: int) -> "HistoryFormatError":
        """The same error, placed at ``source``:``line``."""
        return HistoryFormatError(
            self.problem, source=source, line=line, field=self.field, value=self.value
        )
