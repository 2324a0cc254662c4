"""``pdproto audit``: judge a recorded history against the invariants."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import UsageError
from ..drivers import AuditResult, audit
from ..spec import INVARIANTS, MAX_LINE_BYTES, POLICIES
from ._args import esc, positive_int, print_result


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="check a history file (JSON Lines) against the handoff invariants",
        description=(
            "Read a history (format 1 or 1.1, JSON Lines; '-' reads standard input) and report "
            "every violated invariant with its line and the earlier lines that set it up. "
            "A partial history (its header's observed, or --observed) is judged only on the "
            "invariants its observed event kinds can prove; the others are listed as not judged. "
            "Exit 0 when clean, 1 when an invariant is violated, 2 when the input is "
            "malformed or unreadable."
        ),
    )
    p.add_argument("file", metavar="FILE", nargs="?", help="the history to audit, or - for standard input")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="protocol family (overrides the header; default: the header's, else push)",
    )
    p.add_argument(
        "--complete",
        action="store_true",
        help="the history runs until the system went quiet: apply the leak and stuck checks",
    )
    p.add_argument(
        "--skip",
        nargs="+",
        default=[],
        action="extend",
        metavar="INVARIANT",
        help="invariant ids not to report, space- or comma-separated (" + ", ".join(INVARIANTS) + ")",
    )
    p.add_argument(
        "--max-line-bytes",
        type=positive_int,
        default=MAX_LINE_BYTES,
        metavar="N",
        help=f"longest line accepted, in bytes (default {MAX_LINE_BYTES:,})",
    )
    p.add_argument(
        "--observed",
        action="append",
        default=None,
        metavar="KINDS",
        help="judge the history as partial, observing only these event kinds (comma-separated; "
        "overrides the header's observed; events of other kinds are ignored): invariants whose "
        "evidence needs other kinds are listed as not judged",
    )
    p.set_defaults(run=run)


def split_skip(args: argparse.Namespace) -> list[str]:
    """The invariant ids of ``--skip``; in ``--skip A B FILE`` the greedy
    option swallowed FILE, so a last entry that is no invariant id is the file."""
    skip = [s for part in args.skip for s in part.split(",") if s]
    if args.file is None:
        if skip and skip[-1] not in INVARIANTS:
            args.file = skip.pop()
        else:
            raise UsageError("FILE", None, "a history file to audit, or - for standard input")
    return skip


def run(args: argparse.Namespace, console: Any) -> int:
    args.skip = split_skip(args)
    observed = ",".join(args.observed) if args.observed else None
    result = audit(
        args.file,
        policy=args.policy,
        complete=args.complete,
        skip=args.skip,
        max_line_bytes=args.max_line_bytes,
        observed=observed,
    )
    return print_result(result, args.json, lambda: _print_report(console, args.file, result))


def _print_report(console: Any, path: str, result: AuditResult) -> None:
    name = "<stdin>" if path == "-" else path
    violations = result.violations
    mode = f"policy {result.policy}, " + ("complete" if result.complete else "not complete")
    if result.observed is not None:
        mode += ", partial"
    console.print(f"[bold]{esc(name)}[/]: {result.events} events, {result.requests} requests ({mode})")
    if result.observed is not None:
        console.print(f"observed: {esc(', '.join(result.observed)) or '(no kind)'}")
        if result.not_judged:
            console.print(
                f"[yellow]not judged[/] ({len(result.not_judged)}): the observed kinds cannot prove them"
            )
            for inv, _, missing in result.not_judged:
                console.print(f"  {esc(inv)}: needs {esc(', '.join(missing))}")
    if not violations:
        console.print("[green]ok[/]: no invariant violated")
        if not result.complete:
            console.print(
                "[dim]leak and stuck were not checked: pass --complete if the history runs "
                "until the system went quiet[/]"
            )
        return
    print_violations(console, violations, log_lines=result.log_lines or None)


def print_violations(
    console: Any,
    violations: Any,
    level: Callable[[Any], str] | None = None,
    log_lines: Mapping[int, int] | None = None,
) -> None:
    """The violations as a table (line, the source log's line when
    ``log_lines`` maps it, the ``level`` column when given, invariant,
    message, witness lines) and a line counting them."""
    from rich.table import Table

    table = Table(show_lines=False)
    table.add_column("line", justify="right")
    if log_lines is not None:
        table.add_column("log line", justify="right")
    if level is not None:
        table.add_column("level")
    table.add_column("invariant", style="red")
    table.add_column("message")
    table.add_column("witness")
    for v in violations:
        cells = [str(v.line), esc(v.invariant), esc(v.message), ", ".join(map(str, v.witness)) or "-"]
        if level is not None:
            cells.insert(1, level(v))
        if log_lines is not None:
            cells.insert(1, str(log_lines.get(v.line, "-")))
        table.add_row(*cells)
    console.print(table)
    console.print(f"[red]{len(violations)} violation(s)[/]: {summarize(violations)}")


def summarize(violations: Any) -> str:
    """``"inv x2, other x1"``: how many violations of each invariant, in order of first appearance."""
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.invariant] = counts.get(v.invariant, 0) + 1
    return ", ".join(f"{inv} x{n}" for inv, n in counts.items())
