"""``pdproto conform``: does some behaviour of a model explain a history?"""

from __future__ import annotations

import argparse
from typing import Any

from ..drivers import ConformanceResult, conform
from ..spec import EVENT_TYPES, POLICIES
from ._args import esc, positive_int, print_result
from ._audit import print_violations


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conform",
        help="check that a model's behaviour explains a (possibly partial) history",
        description=(
            "Decide whether some behaviour of MODEL (default: the reference) explains the history: "
            "every observed event is one the model emits, in an order it allows; the model may take "
            "unobserved steps in between.  Ids (blocks, tickets, transfers, workers, generations) are "
            "matched up to a consistent renaming.  Reports the first event no behaviour explains, the "
            "model states still possible before it and the events the model could have produced, and "
            "the monitor's verdict on the same history.  Exit 0 when the history conforms, 1 when it "
            "does not, 2 when the input is malformed.  See docs/conformance.md."
        ),
    )
    p.add_argument("file", metavar="HISTORY", help="the history (JSON Lines), or - for standard input")
    p.add_argument(
        "--model",
        default="reference",
        metavar="MODEL",
        help="a catalogue name (pdproto check --list), a model file or module:attr (default: reference)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="protocol family (overrides the header; default: the header's, else push)",
    )
    p.add_argument(
        "--observed",
        default=None,
        metavar="KINDS",
        help="the event kinds the history observed, comma-separated (overrides the header; "
        "default: the header's, else all): " + ", ".join(EVENT_TYPES),
    )
    p.add_argument(
        "--complete",
        action="store_true",
        help="the history runs until the system went quiet: every model step it began must be seen whole",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per block (default: the header's, else inferred from the block counts)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Any) -> int:
    result = conform(
        args.file,
        args.model,
        policy=args.policy,
        observed=args.observed,
        complete=True if args.complete else None,
        block_size=args.block_size,
    )
    return print_result(result, args.json, lambda: _print_report(console, args.file, result))


def _print_report(console: Any, path: str, result: ConformanceResult) -> None:
    name = "<stdin>" if path == "-" else path
    partial = "" if len(result.observed) == len(EVENT_TYPES) else f", observed: {', '.join(result.observed)}"
    console.print(
        f"[bold]{esc(name)}[/]: {result.events} events, {result.requests} requests "
        f"(model {esc(result.model)}, policy {result.policy}{esc(partial)})"
    )
    if result.ok:
        console.print(f"[green]conforms[/]: a behaviour of {esc(result.model)} explains every event")
    else:
        where = f"line {result.line}" + (f", request {result.request!r}" if result.request else "")
        console.print(f"[red]does not conform[/] at {esc(where)}: {esc(result.reason)}")
        if result.event is not None:
            console.print(f"  event: {esc(str(dict(result.event)))}")
        if result.states:
            more = result.states_total - len(result.states)
            console.print(
                "  model states possible just before it" + (f" ({more} more)" if more > 0 else "") + ":"
            )
            for s in result.states:
                console.print(f"    - {esc(s)}")
        if result.expected:
            console.print("  events the model could have produced there:")
            for e in result.expected:
                console.print(f"    - {esc(e)}")
    if result.bounded:
        console.print("[yellow]a search bound was hit: a rejection may be false (see docs/conformance.md)[/]")
    if result.violations:
        console.print("monitor:")
        print_violations(console, result.violations)
    else:
        console.print("monitor: [green]ok[/]: no invariant violated")
    if result.not_judged:
        console.print(
            f"[dim]not judged (their evidence was not observed): {esc(', '.join(result.not_judged))}[/]"
        )
