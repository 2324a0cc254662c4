"""The ``pdproto`` command line.  Each command lives in its own module
``pdproto._cli._<name>`` with ``add_parser(subparsers)``; the parser it adds
sets ``run=callable(args, console) -> int``.

Exit codes are shared by every command: 0 clean, 1 a violation was found,
2 bad input (malformed file, bad flag or value), reported as one message
without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .._errors import PdprotoError

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2

# Order is the order shown by ``pdproto --help``.
COMMANDS = ("check", "fuzz", "audit", "replay", "cost")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the error into exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="pdproto",
        description="Model and verify the prefill->decode KV handoff protocol.",
    )
    parser.add_argument("--version", action="version", version=f"pdproto {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}._{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return int(exc.code or 0)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    try:
        return int(args.run(args, console))
    except PdprotoError as exc:
        err.print(f"pdproto {args.command}: error: {exc}", markup=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("pdproto: interrupted", markup=False)
        return 130
    except BrokenPipeError:
        return EXIT_OK


def entry() -> None:  # pragma: no cover - console-script shim
    sys.exit(main())
