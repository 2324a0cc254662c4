"""``pdproto import``: turn an engine's own log into a partial history."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._errors import UsageError
from ..importers import ENGINES, MAX_LOG_LINE, ImportResult, import_log
from ._args import EXIT_OK, check_output_path, one_line, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="turn a vLLM, SGLang or Dynamo log into a partial history",
        description=(
            "Read an engine's own log ('-' reads standard input) and write a history (format 1.1, "
            "JSON Lines) of the handoff lines it knows, each event with its log line under "
            "'log_line'; the header declares the event kinds such a log can show, so that "
            "'pdproto audit' judges only what they prove. Lines that look like handoff lines but "
            "match no known format are counted and shown on standard error. Engines and the "
            "source versions whose formats are read: "
            + "; ".join(f"{name}: {src}" for name, src in ENGINES.items())
            + ". Exit 0 when imported, 2 on bad input."
        ),
    )
    p.add_argument("engine", metavar="ENGINE", help=f"the engine that wrote the log: {', '.join(ENGINES)}")
    p.add_argument("log", metavar="LOG", help="the log file, or - for standard input")
    p.add_argument(
        "-o",
        "--out",
        metavar="HISTORY",
        default=None,
        help="write the history here (replaced only once complete, keeping the mode of the file it "
        "replaces; '-' or none: standard output)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary of the import on standard error instead of the text one",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Any) -> int:
    if args.engine not in ENGINES:  # before -o is checked: the first problem is the one named
        raise UsageError("ENGINE", args.engine, f"one of {', '.join(ENGINES)}")
    out = None if args.out == "-" else check_output_path(args.out, "-o")
    result = import_log(args.engine, args.log, out)
    if args.json:
        print_json(result.to_dict(), file=sys.stderr)
    else:
        _summary(args, result)
    return EXIT_OK


def _summary(args: argparse.Namespace, result: ImportResult) -> None:
    """A few plain lines on standard error (standard output may hold the history)."""
    name = "<stdin>" if args.log == "-" else args.log
    known = sum(result.recognised.values())
    write = sys.stderr.write
    write(
        f"pdproto import: {name}: {result.lines:,} lines, {known:,} known handoff lines, "
        f"{result.events:,} events ({result.engine}; formats of {result.source})\n"
    )
    more = (
        f" (no DEBUG lines; at DEBUG level also: {', '.join(result.more_at_debug)})"
        if result.more_at_debug
        else ""
    )
    write(f"pdproto import: observed kinds: {', '.join(result.observed) or '-'}{more}\n")
    if not result.lines:
        write(f"pdproto import: warning: {name} is empty: the history has no events\n")
    if result.dropped:
        write(
            f"pdproto import: warning: {result.dropped:,} event(s) left out: the log does not show "
            "every event "
            "of their kind for the requests it names (see docs/importers.md, Limits)\n"
        )
    if result.overlong:
        write(
            f"pdproto import: warning: {result.overlong:,} line(s) longer than {MAX_LOG_LINE:,} characters: "
            "only their beginning was read\n"
        )
    if result.unrecognised:
        write(
            f"pdproto import: warning: {result.unrecognised:,} line(s) look like handoff lines but match "
            f"no known {result.engine} format; first:\n"
        )
        for example in result.examples:
            write(f"  {name}:{example.line}: {one_line(example.text)}\n")
