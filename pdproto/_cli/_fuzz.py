"""``pdproto fuzz``: randomised stateful testing of a model with Hypothesis."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from .._errors import UsageError, parse_int
from ..backends import TRANSPORTS
from ..spec import POLICIES
from . import positive_int
from ._args import check_output_path, esc, print_result

#: drawn steps per example against a real system (each step is real work)
ADAPTER_STEPS = 40


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
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a name from the catalogue (pdproto check --list), a model file, or "
        "module:attribute (default: the reference model)",
    )
    p.add_argument(
        "--examples", type=positive_int, default=200, metavar="N", help="runs to try (default 200)"
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="rule steps per example before teardown drives it to quiescence (default 300; "
        f"{ADAPTER_STEPS} with --adapter)",
    )
    p.add_argument("--seed", type=int, default=None, metavar="S", help="make the run repeatable")
    p.add_argument("--requests", type=positive_int, metavar="N", help="number of requests")
    p.add_argument(
        "--workers",
        metavar="N|P:D",
        action="append",
        help="N: split the examples over N worker processes (distinct seeds derived from "
        "--seed, one example database, merged counts); P:D: the model's prefill and decode "
        "worker counts, e.g. 2:2 (give the flag twice for both); --processes N and "
        "--pd-workers P:D say each meaning alone",
    )
    p.add_argument(
        "--processes",
        type=_processes_value,
        action="append",
        dest="workers",
        metavar="N",
        help="split the examples over N worker processes (the same as --workers N)",
    )
    p.add_argument(
        "--pd-workers",
        type=_pd_workers_value,
        action="append",
        dest="workers",
        metavar="P:D",
        help="the model's prefill and decode worker counts, e.g. 2:2 (the same as --workers P:D)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const=True,
        default=False,
        metavar="ADDRESS",
        help="run the worker shares as Ray tasks: on a local Ray instance, or on the cluster "
        "at ADDRESS (--workers N tasks; default: the cluster's CPUs; needs pdproto[ray])",
    )
    p.add_argument("--blocks", type=positive_int, metavar="N", help="block pool size of every worker")
    p.add_argument(
        "--policy",
        "--mode",
        dest="policy",
        choices=POLICIES,
        help="protocol family (--mode is the same flag)",
    )
    p.add_argument(
        "--faults",
        metavar="KIND=N,...",
        help="fault budgets replacing the model's defaults, e.g. all=2 or cancel=1,dup=2",
    )
    p.add_argument(
        "--out",
        metavar="FAILURE.jsonl",
        help="write the shrunk failing history here (pdproto audit / replay read it)",
    )
    p.add_argument(
        "--no-database", action="store_true", help="do not use Hypothesis's example database (.hypothesis/)"
    )
    p.add_argument(
        "--backend",
        choices=("none", "torch"),
        default="none",
        help="also run every step on real KV buffers (torch; imported only then)",
    )
    p.add_argument("--device", default="cpu", help="torch device for --backend torch (cpu or cuda)")
    p.add_argument("--dtype", default="float32", help="torch dtype for --backend torch")
    p.add_argument(
        "--transport",
        default=None,
        choices=TRANSPORTS,
        help="with --backend torch: how transfers move KV (as pdproto replay --transport; default copy)",
    )
    p.add_argument(
        "--transformer",
        default=None,
        metavar="NAME|PATH",
        help="with --backend torch: also run a real transformer (as pdproto replay --model) "
        "and compare every decode's logits with a colocated run (logit-divergence; slow: "
        "for small runs)",
    )
    p.add_argument(
        "--coverage-exhaustive",
        type=positive_int,
        nargs="?",
        const=2_000_000,
        default=None,
        metavar="MAX_STATES",
        help="first count every reachable model state (breadth-first, up to MAX_STATES) "
        "and report the fraction the fuzzing covered",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="also run Hypothesis's own shrink and explain phases (off by default: the "
        "failure is shrunk exactly by replaying it)",
    )
    p.add_argument(
        "--adapter",
        metavar="NAME",
        help="fuzz a real system instead of a model: vllm (= vllm:pull), vllm:push, "
        "model:NAME, or module:attribute (docs/adapters.md); every violation found is "
        "shrunk and written as a history",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


#: flags that configure a model, and so mean nothing with --adapter
MODEL_ONLY = ("requests", "workers", "blocks", "policy", "faults", "coverage_exhaustive", "transformer")


def _processes_value(text: str) -> str:
    """--processes N: a worker process count (kept as text, as --workers N is)."""
    try:
        parse_int(text, "--processes", minimum=1)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not {exc.allowed}") from None
    return text


def _pd_workers_value(text: str) -> str:
    """--pd-workers P:D: the model's prefill and decode worker counts (kept as
    text, as --workers P:D is)."""
    try:
        parse_workers(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not {exc.allowed}") from None
    return text


def split_workers(values: list[str] | None) -> tuple[int | None, str | None]:
    """``--workers`` given as N (processes) and/or P:D (the model's workers):
    (N or None, P:D or None); each form at most once."""
    processes: int | None = None
    model: str | None = None
    for text in values or ():
        if ":" in text:
            if model is not None:
                raise UsageError("--workers", text, "P:D once (already given: " + model + ")")
            model = text
            continue
        if processes is not None:
            raise UsageError("--workers", text, f"N once (already given: {processes})")
        try:
            processes = parse_int(text, "--workers", minimum=1)
        except UsageError:
            raise UsageError(
                "--workers",
                text,
                "N (worker processes, an integer >= 1) or P:D (prefill:decode workers, e.g. 2:2)",
            ) from None
    return processes, model


def parse_workers(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    try:
        if not sep:
            raise UsageError("--workers", text, "P:D")
        return parse_int(p, "--workers", minimum=1), parse_int(d, "--workers", minimum=1)
    except UsageError:
        raise UsageError("--workers", text, "P:D with two integers >= 1, e.g. 2:2") from None


def run(args: argparse.Namespace, console: Any) -> int:
    if args.adapter is not None:
        return run_adapter(args, console)
    from ..drivers import FuzzStats, fuzz, load_model
    from ..protocol import parse_faults

    processes, pd = split_workers(args.workers)
    workers = parse_workers(pd) if pd else (None, None)
    faults = parse_faults(args.faults) if args.faults is not None else None
    model, info = load_model(
        args.model,
        mode=args.policy,
        requests=args.requests,
        blocks=args.blocks,
        faults=faults,
        prefill_workers=workers[0],
        decode_workers=workers[1],
    )
    check_output_path(args.out, "--out")  # before the run, not at its end
    backend = None
    if args.transformer is not None and args.backend != "torch":
        raise UsageError("--transformer", args.transformer, "--backend torch along with it")
    if args.transport is not None and args.backend != "torch":
        raise UsageError("--transport", args.transport, "--backend torch along with it")
    if args.transport not in (None, "copy") and args.transformer is not None:
        raise UsageError("--transport with --transformer", args.transport, "copy")
    parallel = (processes or 1) > 1 or args.ray is not False
    if (
        parallel
        and args.backend == "torch"
        and (args.device != "cpu" or args.transport not in (None, "copy") or args.transformer is not None)
    ):
        raise UsageError(
            "--workers/--ray",
            processes or args.ray,
            "a serial run with --backend torch on cuda, a --transport other than copy, or "
            "--transformer (their state does not cross into worker processes)",
        )
    if args.backend == "torch":
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise UsageError("--device", args.device, "cpu or cuda")
        from ..drivers import model_backend_factory, torch_backend_factory

        if args.transformer is not None:
            backend = model_backend_factory(args.transformer, device=args.device, dtype=args.dtype)
        else:
            backend = torch_backend_factory(device=args.device, dtype=args.dtype, transport=args.transport)
    stats = FuzzStats()
    progress = (
        _progress(console, args, stats, info.name)
        if not parallel
        else _status(
            console,
            args,
            f"fuzzing {info.name} on {processes or 'the cluster CPUs as'} "
            f"{'Ray tasks' if args.ray is not False else 'worker processes'}",
        )
    )
    try:
        with progress:
            result = fuzz(
                model,
                examples=args.examples,
                steps=args.steps or 300,
                seed=args.seed,
                out=args.out,
                database=None if args.no_database else ".hypothesis/examples",
                backend=backend,
                coverage_states=args.coverage_exhaustive,
                name=info.name,
                expected=info.expected,
                stats=stats,
                explain=args.explain,
                workers=processes,
                ray=args.ray,
            )
    except UsageError as exc:
        if exc.what != "workers":
            raise
        raise UsageError("--workers", exc.value, exc.allowed) from None
    finally:
        if backend is not None and hasattr(backend, "close"):
            backend.close()  # the transport torch_backend_factory made
    return print_result(result, args.json, lambda: _report(console, result.to_dict(), result.failure))


def _progress(console: Any, args: argparse.Namespace, stats: Any, name: str) -> Any:
    """A live status line on standard error (only on a terminal)."""
    return _status(
        console,
        args,
        lambda: (
            f"fuzzing {name}: {stats.examples}/{args.examples} examples, {stats.steps} steps, "
            f"{stats.distinct_states} distinct states"
        ),
    )


def _report(console: Any, result: dict[str, Any], failure: Any) -> None:
    from rich.table import Table

    verdict = "[green]ok[/]" if result["ok"] else "[red]VIOLATION[/]"
    table = Table(title=f"pdproto fuzz {esc(result['model'])}: {verdict}", show_header=False)
    for key in (
        "examples",
        "steps",
        "teardown_steps",
        "seconds",
        "steps_per_second",
        "examples_per_second",
        "distinct_states",
        "reachable_states",
        "coverage",
    ):
        if result.get(key) is not None:
            table.add_row(key.replace("_", " "), str(result[key]))
    table.add_row("action kinds", ", ".join(f"{k} {n}" for k, n in result["action_kinds"].items()))
    table.add_row("fault kinds", ", ".join(f"{k} {n}" for k, n in result["fault_kinds"].items()) or "-")
    phases = result.get("phase_seconds") or {}
    table.add_row("phase seconds", ", ".join(f"{k} {v}" for k, v in phases.items() if v) or "-")
    if result.get("worker_runs"):
        runs = result["worker_runs"]
        asked = result.get("workers_requested")
        shown = f"{result['workers']}" + (
            f" of {asked} asked for" if asked not in (None, result["workers"]) else ""
        )
        if result.get("found_by_worker") is not None:
            shown += (
                f"; the failure found by worker {result['found_by_worker']} at its example "
                f"{result.get('found_at_example')}"
            )
        table.add_row(
            "workers",
            f"{shown} (examples "
            + ", ".join(str(r["examples"]) for r in runs)
            + "; counts and distinct states merged; cpu seconds "
            f"{result.get('cpu_seconds')})",
        )
    if result["seed"] is not None:
        table.add_row("seed", str(result["seed"]))
    console.print(table)
    if failure is None:
        return
    v = failure.violation
    console.print(f"[red]{esc(v.invariant)}[/] at history line {v.line}: {esc(v.message)}", markup=True)
    steps = Table(title=f"shrunk counterexample: {len(failure.trace)} steps")
    steps.add_column("#", justify="right")
    steps.add_column("actor")
    steps.add_column("action")
    steps.add_column("events")
    for i, (actor, action, events) in enumerate(failure.trace, 1):
        evs = "\n".join(json.dumps(e.to_dict()) for e in events) or "-"
        steps.add_row(str(i), esc(actor), esc(str(action) + (" [fault]" if action.fault else "")), esc(evs))
    console.print(steps)
    if failure.history:
        console.print(f"history written to {esc(failure.history)}: pdproto audit {esc(failure.history)}")


def run_adapter(args: argparse.Namespace, console: Any) -> int:
    """``pdproto fuzz --adapter NAME``: fuzz a real system through its adapter."""
    import time

    from ..drivers import fuzz_adapter, load_adapter

    if args.model is not None:
        raise UsageError(
            "MODEL", args.model, "no model with --adapter (the adapter is the system under test)"
        )
    given = [f"--{k.replace('_', '-')}" for k in MODEL_ONLY if getattr(args, k) is not None]
    given += ["--backend"] if args.backend != "none" else []
    given += ["--explain"] if args.explain else []
    given += ["--ray"] if args.ray is not False else []
    if given:
        value = getattr(args, given[0][2:].replace("-", "_"), True)
        raise UsageError(
            given[0],
            " ".join(value) if isinstance(value, list) else value,
            "no model or parallel flag with --adapter (it configures a model run, not a real system)",
        )
    check_output_path(args.out, "--out")
    started = time.perf_counter()
    with _status(console, args, f"starting {args.adapter}"):
        adapter = load_adapter(args.adapter)
    startup = time.perf_counter() - started
    try:
        state = {"text": ""}

        def progress(examples: int, steps: int, failures: int) -> None:
            state["text"] = (
                f"fuzzing {adapter.name}: {examples}/{args.examples} examples, {steps} steps, "
                f"{failures} violation(s)"
            )

        with _status(console, args, lambda: state["text"] or f"fuzzing {adapter.name}"):
            result = fuzz_adapter(
                adapter,
                examples=args.examples,
                steps=args.steps or ADAPTER_STEPS,
                seed=args.seed,
                out=args.out,
                startup_seconds=startup,
                progress=progress,
            )
    finally:
        adapter.close()
    return print_result(result, args.json, lambda: _report_adapter(console, result))


@contextlib.contextmanager
def _status(console: Any, args: argparse.Namespace, text: Any) -> Any:
    """A live status line on standard error, refreshed five times a second
    (only on a terminal); ``text`` is a string or a function returning one."""
    if args.json or not sys.stderr.isatty():
        yield
        return
    import threading

    from rich.console import Console
    from rich.live import Live

    line = text if callable(text) else (lambda: text)
    with Live(line(), console=Console(stderr=True), refresh_per_second=5, transient=True) as live:
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


def _report_adapter(console: Any, result: Any) -> None:
    from rich.table import Table

    d = result.to_dict()
    verdict = "[green]ok[/]" if d["ok"] else "[red]VIOLATION[/]"
    table = Table(title=f"pdproto fuzz --adapter {esc(d['adapter'])}: {verdict}", show_header=False)
    for key in (
        "examples",
        "runs",
        "steps",
        "seconds",
        "startup_seconds",
        "examples_per_second",
        "runs_per_second",
        "steps_per_second",
        "signatures",
        "seed",
    ):
        if d.get(key) is not None:
            table.add_row(key.replace("_", " "), str(d[key]))
    table.add_row("action kinds", ", ".join(f"{k} {n}" for k, n in d["action_kinds"].items()) or "-")
    console.print(table)
    for f in result.failures:
        v = f.violation
        console.print(
            f"[red]{esc(v.invariant)}[/] at history line {v.line} after {len(f.steps)} steps: "
            f"{esc(v.message)}",
            markup=True,
        )
        console.print("  steps: " + esc(", ".join(str(a) + ("*" if a.fault else "") for a, _ in f.steps)))
        if f.known:
            console.print(f"  [yellow]known behaviour[/]: {esc(f.known)}", markup=True)
        else:
            console.print("  [red]not explained by the adapter's triage[/]", markup=True)
        if f.history:
            console.print(f"  history written to {esc(f.history)}: pdproto audit {esc(f.history)}")
