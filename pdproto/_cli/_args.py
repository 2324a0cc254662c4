"""What every command shares: argument types, output checks, and plain (never
wrapped, never markup) output of errors and JSON.

Rich is for the human reports only.  A user string printed through rich is
escaped with :func:`esc` first, so ``[red]r1`` or ``[/oops]`` in a history
prints as itself instead of being read as markup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .._errors import PdprotoError, UsageError, parse_int

__all__ = [
    "int_type",
    "positive_int",
    "size_type",
    "parse_size",
    "check_output_path",
    "esc",
    "one_line",
    "print_error",
    "print_json",
    "print_result",
    "EXIT_OK",
    "EXIT_VIOLATION",
    "EXIT_BAD_INPUT",
]

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2


def int_type(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ASCII digits within the bounds (see
    :func:`pdproto._errors.parse_int`); argparse turns its error into exit 2."""

    def convert(text: str) -> int:
        try:
            return parse_int(text, "value", minimum=minimum, maximum=maximum)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(f"{exc.value!r} is not {exc.allowed}") from None

    convert.__name__ = "integer"
    return convert


#: An argparse type: an integer >= 1.
positive_int = int_type(minimum=1)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "mb": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "gb": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "tb": 2**40,
}


def parse_size(text: str, what: str) -> int:
    """``"4G"``, ``"512MiB"``, ``"1000000"`` -> bytes (binary units)."""
    s = text.strip() if isinstance(text, str) else ""
    i = len(s)
    while i and not s[i - 1].isdigit():
        i -= 1
    number, unit = s[:i], s[i:].strip().lower()
    if unit not in _UNITS or not number:
        raise UsageError(what, text, "a size in bytes, optionally with K, M, G or T (binary), e.g. 8G")
    return parse_int(number, what, minimum=1, maximum=2**60 // _UNITS[unit]) * _UNITS[unit]


def size_type(text: str) -> int:
    """An argparse type for :func:`parse_size`."""
    try:
        return parse_size(text, "size")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(f"{exc.value!r} is not {exc.allowed}") from None


size_type.__name__ = "size"


def check_output_path(path: str | None, flag: str) -> str | None:
    """Check, before a run, that ``path`` can be written: not a directory, in
    an existing, writable directory.  Raises :class:`UsageError` naming ``flag``."""
    if path is None:
        return None
    if not path or "\0" in path:
        raise UsageError(flag, path, "a file path")
    if os.path.isdir(path):
        raise UsageError(flag, path, "a file path, not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(flag, path, "a file in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(flag, path, "a file you may write")
    return path


def esc(value: object) -> str:
    """``value`` as text that rich prints literally (markup escaped)."""
    from rich.markup import escape

    return escape(str(value))


def one_line(text: str) -> str:
    """``text`` on one line: runs of whitespace, newlines included, become one space."""
    return " ".join(str(text).split())


def print_error(command: str | None, exc: BaseException, *, debug: bool = False) -> None:
    """Write ``pdproto COMMAND: error: MESSAGE`` as one plain line on standard
    error (never wrapped); with ``debug`` the full traceback first."""
    if debug:
        traceback.print_exception(exc)
    prefix = f"pdproto {command}" if command else "pdproto"
    message = (
        one_line(str(exc)) if isinstance(exc, PdprotoError) else one_line(f"{type(exc).__name__}: {exc}")
    )
    sys.stderr.write(f"{prefix}: error: {message}\n")
    sys.stderr.flush()


def print_json(obj: Any, file: Any = None) -> None:
    """One JSON document on standard output, a plain write (never wrapped)."""
    out = file if file is not None else sys.stdout
    out.write(json.dumps(obj) + "\n")


def print_result(result: Any, as_json: bool, report: Callable[[], None]) -> int:
    """Print a driver's ``result`` as one JSON object (``--json``), else call
    ``report()`` to print the human report; return the exit code: 0 when the
    result is ok, 1 when it holds a violation."""
    if as_json:
        print_json(result.to_dict())
    else:
        report()
    return EXIT_OK if result.ok else EXIT_VIOLATION
