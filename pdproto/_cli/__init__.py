"""The ``pdproto`` command line.  Each command lives in its own module
``pdproto._cli._<name>`` with ``add_parser(subparsers)``; the parser it adds
sets ``run=callable(args, console) -> int``.

Exit codes are shared by every command: 0 clean, 1 a violation was found,
2 bad input (malformed file, bad flag or value, a model that fails to load, a
run over a size limit), reported as one plain line on standard error without
a traceback (``pdproto --debug COMMAND ...`` prints the traceback too).  A
closed standard output (``pdproto cost | head -1``) ends the command quietly
with 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from .._errors import PdprotoError
from ._args import EXIT_BAD_INPUT as EXIT_BAD_INPUT
from ._args import EXIT_OK as EXIT_OK
from ._args import EXIT_VIOLATION as EXIT_VIOLATION
from ._args import positive_int as positive_int
from ._args import print_error

__all__ = [
    "COMMANDS",
    "EXIT_OK",
    "EXIT_VIOLATION",
    "EXIT_BAD_INPUT",
    "build_parser",
    "main",
    "entry",
    "positive_int",
]

# Order is the order shown by ``pdproto --help``.
COMMANDS = ("check", "fuzz", "audit", "conform", "import", "replay", "corpus", "cost", "simulate")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = _Parser(
        prog="pdproto",
        description="Model and verify the prefill->decode KV handoff protocol.",
    )
    parser.add_argument("--version", action="version", version=f"pdproto {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, print the full traceback as well as the one-line message",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}._{name}").add_parser(sub)
    for command in sub.choices.values():  # --debug after the command works too
        command.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on an error, print the full traceback too",
        )
    return parser


def _quiet_stdout() -> None:
    """Standard output was closed by the reader: send what is left to
    /dev/null so that the interpreter's last flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (tests)
        pass


def _console() -> object:
    """The console the commands print their reports on (standard output)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1: a closed pipe is no violation
            self.quiet = True
            raise BrokenPipeError

    return _Console(highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return int(exc.code or 0)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    debug = bool(getattr(args, "debug", False))
    console = _console()
    try:
        code = int(args.run(args, console))
        sys.stdout.flush()
        return code
    except PdprotoError as exc:
        print_error(args.command, exc, debug=debug)
        return EXIT_BAD_INPUT
    except MemoryError as exc:
        print_error(args.command, MemoryError("out of memory; use smaller sizes"), debug=debug)
        del exc
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write("pdproto: interrupted\n")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK


def entry() -> None:  # pragma: no cover - console-script shim
    sys.exit(main())
