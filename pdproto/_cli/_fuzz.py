"""``pdproto fuzz``: randomised stateful testing of a model with Hypothesis."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import time
from typing import Any

from .._errors import UsageError
from . import EXIT_OK, EXIT_VIOLATION, positive_int


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fuzz",
        help="fuzz a model with Hypothesis stateful testing against the monitor",
        description=(
            "Drive a handoff model through random runs (Hypothesis stateful testing with "
            "swarm testing over fault kinds and steering toward unvisited states), check "
            "every step with the monitor, and drive each run to quiescence for the leak and "
            "stuck checks.  A failure is shrunk, printed as a step table and written as a "
            "history.  Exit 0 clean, 1 violation, 2 bad input."
        ),
    )
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a name from the catalogue (pdproto check --list), a model file, or "
                   "module:attribute (default: the reference model)")
    p.add_argument("--examples", type=positive_int, default=200, metavar="N",
                   help="runs to try (default 200)")
    p.add_argument("--steps", type=positive_int, default=300, metavar="N",
                   help="rule steps per example before teardown drives it to quiescence (default 300)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="make the run repeatable")
    p.add_argument("--requests", type=positive_int, metavar="N", help="number of requests")
    p.add_argument("--workers", metavar="P:D", help="prefill and decode worker counts, e.g. 2:2")
    p.add_argument("--blocks", type=positive_int, metavar="N", help="block pool size of every worker")
    p.add_argument("--mode", choices=("push", "pull"), help="protocol family")
    p.add_argument("--faults", metavar="KIND=N,...",
                   help="fault budgets replacing the model's defaults, e.g. all=2 or cancel=1,dup=2")
    p.add_argument("--out", metavar="FAILURE.jsonl",
                   help="write the shrunk failing history here (pdproto audit / replay read it)")
    p.add_argument("--no-database", action="store_true",
                   help="do not use Hypothesis's example database (.hypothesis/)")
    p.add_argument("--backend", choices=("none", "torch"), default="none",
                   help="also run every step on real KV buffers (torch; imported only then)")
    p.add_argument("--device", default="cpu", help="torch device for --backend torch (cpu or cuda)")
    p.add_argument("--dtype", default="float32", help="torch dtype for --backend torch")
    p.add_argument("--coverage-exhaustive", type=positive_int, nargs="?", const=2_000_000, default=None,
                   metavar="MAX_STATES",
                   help="first count every reachable model state (breadth-first, up to MAX_STATES) "
                   "and report the fraction the fuzzing covered")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)



def parse_workers(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise UsageError("--workers", text, "P:D with two integers >= 1, e.g. 2:2")
    return int(p), int(d)


def run(args: argparse.Namespace, console: Any) -> int:
    from hypothesis import seed as hseed
    from hypothesis import settings
    from hypothesis.database import DirectoryBasedExampleDatabase
    from hypothesis.stateful import get_state_machine_test

    from ..protocol._config import parse_faults
    from ..drivers._loader import load_model
    from ..spec._history import write_history
    from ..testing import HandoffFailure, handoff_machine, pick_failure

    workers = parse_workers(args.workers) if args.workers else (None, None)
    faults = parse_faults(args.faults) if args.faults is not None else None
    model, info = load_model(
        args.model, mode=args.mode, requests=args.requests, blocks=args.blocks, faults=faults,
        prefill_workers=workers[0], decode_workers=workers[1],
    )
    out = args.out
    if out is not None:
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise UsageError("--out", out, "a file in an existing directory")
    backend = None
    if args.backend == "torch":
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise UsageError("--device", args.device, "cpu or cuda")
        from ..backends._torch import TorchBackend

        device, dtype = args.device, args.dtype

        def backend(header: Any) -> Any:
            return TorchBackend(header, device=device, dtype=dtype)

    machine = handoff_machine(model, out=out, backend=backend)
    stats = machine.stats
    if args.coverage_exhaustive is not None:
        from ..testing import reachable_states

        stats.reachable = reachable_states(model, max_states=args.coverage_exhaustive)
    database = None if args.no_database else DirectoryBasedExampleDatabase(".hypothesis/examples")
    test = get_state_machine_test(
        machine,
        settings=settings(
            max_examples=args.examples,
            stateful_step_count=args.steps,
            deadline=None,
            database=database,
            suppress_health_check=list(__import__("hypothesis").HealthCheck),
            print_blob=False,
        ),
    )
    identity = f"pdproto-fuzz:{info.name}:{info.config!r}".encode()
    test._hypothesis_internal_database_key = hashlib.sha256(identity).digest()  # type: ignore[attr-defined]
    if args.seed is not None:
        test = hseed(args.seed)(test)

    failure: HandoffFailure | None = None
    captured = io.StringIO()
    t0 = time.perf_counter()
    with _progress(console, args, stats, info.name):
        with contextlib.redirect_stdout(captured):
            try:
                test()
            except Exception as exc:
                failure = pick_failure(exc)
                if failure is None:
                    raise
    if failure is not None and out is not None:
        # with several distinct bugs Hypothesis replays each; the file must
        # hold the one reported here
        write_history(out, failure.events, failure.header)
    seconds = time.perf_counter() - t0
    summary = stats.to_dict()
    summary["seconds"] = round(seconds, 3)
    summary["steps_per_second"] = round(stats.steps / seconds, 1) if seconds else 0.0
    summary["examples_per_second"] = round(stats.examples / seconds, 2) if seconds else 0.0
    result: dict[str, Any] = {
        "ok": failure is None,
        "model": info.name,
        "expected": info.expected,
        **summary,
        "seed": args.seed,
        "violation": None,
    }
    if failure is not None:
        v = failure.violation
        result["violation"] = {
            "invariant": v.invariant,
            "line": v.line,
            "message": v.message,
            "witness": list(v.witness),
            "trace": [
                {"step": i, "actor": actor, "action": str(action), "fault": action.fault,
                 "events": [e.to_dict() for e in events]}
                for i, (actor, action, events) in enumerate(failure.trace, 1)
            ],
        }
        result["out"] = failure.history
    if args.json:
        print(json.dumps(result))
    else:
        _report(console, result, failure)
    return EXIT_VIOLATION if failure is not None else EXIT_OK


@contextlib.contextmanager
def _progress(console: Any, args: argparse.Namespace, stats: Any, name: str) -> Any:
    """A live status line on standard error (only on a terminal)."""
    if args.json or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.live import Live

    err = Console(stderr=True)

    def line() -> str:
        return (f"fuzzing {name}: {stats.examples}/{args.examples} examples, {stats.steps} steps, "
                f"{stats.distinct_states} distinct states")

    with Live(line(), console=err, refresh_per_second=5, transient=True) as live:
        import threading

        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.2):
                live.update(line())

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _report(console: Any, result: dict[str, Any], failure: Any) -> None:
    from rich.table import Table

    verdict = "[green]ok[/]" if result["ok"] else "[red]VIOLATION[/]"
    table = Table(title=f"pdproto fuzz {result['model']}: {verdict}", show_header=False)
    for key in ("examples", "steps", "teardown_steps", "seconds", "steps_per_second",
                "examples_per_second", "distinct_states", "reachable_states", "coverage"):
        if result.get(key) is not None:
            table.add_row(key.replace("_", " "), str(result[key]))
    table.add_row("action kinds", ", ".join(f"{k} {n}" for k, n in result["action_kinds"].items()))
    table.add_row("fault kinds", ", ".join(f"{k} {n}" for k, n in result["fault_kinds"].items()) or "-")
    if result["seed"] is not None:
        table.add_row("seed", str(result["seed"]))
    console.print(table)
    if failure is None:
        return
    v = failure.violation
    console.print(f"[red]{v.invariant}[/] at history line {v.line}: {v.message}", markup=True)
    steps = Table(title=f"shrunk counterexample: {len(failure.trace)} steps")
    steps.add_column("#", justify="right")
    steps.add_column("actor")
    steps.add_column("action")
    steps.add_column("events")
    for i, (actor, action, events) in enumerate(failure.trace, 1):
        evs = "\n".join(json.dumps(e.to_dict()) for e in events) or "-"
        steps.add_row(str(i), actor, str(action) + (" [fault]" if action.fault else ""), evs)
    console.print(steps)
    if failure.history:
        console.print(f"history written to {failure.history}: pdproto audit {failure.history}")
