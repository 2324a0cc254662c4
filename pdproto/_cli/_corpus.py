"""``pdproto corpus``: run the regression corpus of histories (every
catalogue mutant's counterexample and sample clean histories of the correct
models) through audit, or re-enact it on a real system with ``--adapter``."""

from __future__ import annotations

import argparse
from typing import Any

from ._args import EXIT_OK, EXIT_VIOLATION, esc, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "corpus",
        help="run the regression corpus of histories (audit, or your adapter)",
        description=(
            "Run every history of a corpus (default: the shipped one, the counterexamples of the "
            "catalogue's mutants and sample clean histories of the reference and the benign variants; "
            "docs/bugs.md) and compare with its EXPECTED.json. Without --adapter each history is "
            "audited and must give its expected invariant at its expected line (clean ones: nothing). "
            "With --adapter each history is re-enacted on that system (as pdproto replay --adapter): "
            "a correct system reproduces no bug of the corpus and breaks no invariant on the clean "
            "histories. Exit 0 when every history passes, 1 otherwise, 2 on bad input."
        ),
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        default=None,
        help="a corpus directory holding EXPECTED.json (default: the shipped corpus)",
    )
    p.add_argument(
        "--adapter",
        metavar="NAME",
        default=None,
        help="re-enact the corpus on a real system: vllm (= vllm:pull), vllm:push, model:NAME "
        "(built with each history's configuration), or module:attribute (docs/adapters.md); "
        "histories of the other family are skipped",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Any) -> int:
    from ..drivers import corpus_dir, run_corpus

    directory = args.dir if args.dir is not None else corpus_dir()
    cases = run_corpus(directory, adapter=args.adapter)
    ran = [c for c in cases if c.skipped is None]
    failed = [c for c in ran if not c.ok]
    if args.json:
        print_json(
            {
                "ok": not failed,
                "corpus": directory,
                "adapter": args.adapter,
                "histories": len(cases),
                "ran": len(ran),
                "failed": len(failed),
                "cases": [c.to_dict() for c in cases],
            },
            console.file,
        )
        return EXIT_VIOLATION if failed else EXIT_OK
    from rich.table import Table

    what = f"on {args.adapter}" if args.adapter else "audited"
    table = Table(title=f"corpus {directory} ({what})", title_justify="left")
    for col in ("history", "expected", "got", "verdict"):
        table.add_column(col)
    for c in cases:
        want = "clean" if c.expected is None else f"{c.expected} at line {c.line}"
        verdict = (
            "skipped: " + c.skipped if c.skipped else ("[green]pass[/]" if c.ok else "[bold red]FAIL[/]")
        )
        table.add_row(esc(c.history), esc(want), esc(c.got), verdict if not c.skipped else esc(verdict))
    console.print(table)
    console.print(
        f"{len(ran) - len(failed)} of {len(ran)} histories pass"
        + (f" ({len(cases) - len(ran)} skipped)" if len(cases) != len(ran) else "")
    )
    return EXIT_VIOLATION if failed else EXIT_OK
