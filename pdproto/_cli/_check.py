"""``pdproto check``: explore a model exhaustively and judge it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._errors import UsageError
from ..backends import TRANSPORTS
from ..spec import POLICIES
from . import EXIT_OK, EXIT_VIOLATION, positive_int
from ._args import check_output_path, esc, print_json

GRAPH_LIMIT = 20_000
#: with --backend torch: the search stops here unless --max-states says otherwise ...
BACKEND_DEFAULT_STATES = 200_000
#: ... and --max-states above this is refused (every frontier state holds KV pools)
BACKEND_MAX_STATES = 2_000_000
#: KV shapes of the backend along the search: tiny, the protocol needs no more
BACKEND_LAYERS, BACKEND_KV_HEADS, BACKEND_HEAD_DIM = 1, 2, 8


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="explore a model exhaustively (breadth-first) against the monitor",
        description=(
            "Explore every reachable state of a handoff model (breadth-first over the model "
            "state and the monitor's verdict state) and report violations with shortest "
            "counterexamples, deadlocks, and unreachable 'sometimes' properties.  Exit 0 "
            "clean (also a partial search that --max-states or --max-seconds stopped before "
            "it was exhaustive: the report says partial), 1 violation or deadlock, 2 bad input."
        ),
    )
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a name from the catalogue (see --list), a path to a model file, or "
        "module:attribute (default: the reference model)",
    )
    p.add_argument("--list", action="store_true", help="list the catalogue's models and exit")
    p.add_argument(
        "--policy",
        "--mode",
        dest="policy",
        choices=POLICIES,
        help="protocol family of the configuration (--mode is the same flag)",
    )
    p.add_argument("--requests", type=positive_int, metavar="N", help="number of requests")
    p.add_argument("--blocks", type=positive_int, metavar="N", help="block pool size of every worker")
    p.add_argument(
        "--faults",
        metavar="KIND=N,...",
        help="fault budgets replacing the model's defaults (kinds not named get 0), e.g. "
        "cancel=1,dup=1 (also all=1, none)",
    )
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        default=None,
        help="format 1.1: P caches the prompt's prefix (its full blocks before the last token) "
        "and later prefills share it (share events; needs --prompt-len > --block-size)",
    )
    p.add_argument(
        "--chunks",
        type=positive_int,
        metavar="N",
        help="format 1.1: the handoff is N transfers under one ticket, each for a range of "
        "prompt positions (with --layerwise: one layer each); default 1",
    )
    p.add_argument(
        "--layerwise",
        action="store_true",
        default=None,
        help="with --chunks N (N >= 2): chunk i moves layer i of N layers, every position",
    )
    p.add_argument("--block-size", type=positive_int, metavar="N", help="tokens per KV block")
    p.add_argument("--prompt-len", type=positive_int, metavar="N", help="prompt length of every request")
    p.add_argument(
        "--max-states",
        type=positive_int,
        metavar="N",
        help="stop after N distinct states (a partial report: JSON partial and stopped_by)",
    )
    p.add_argument(
        "--max-seconds",
        type=_seconds,
        metavar="S",
        help="stop after S seconds (a partial report: JSON partial and stopped_by)",
    )
    p.add_argument(
        "--workers",
        type=_workers_value,
        action="append",
        metavar="N|P:D",
        help="N: explore on N worker processes, states partitioned by hash (same answers as "
        "the serial search; see docs/scaling.md); P:D: the model's prefill and decode worker "
        "counts, e.g. 2:2, as in pdproto fuzz (give the flag twice for both); --processes N "
        "and --pd-workers P:D say each meaning alone",
    )
    p.add_argument(
        "--processes",
        type=positive_int,
        action="append",
        dest="workers",
        metavar="N",
        help="explore on N worker processes (the same as --workers N)",
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
        const="",
        default=None,
        metavar="ADDRESS",
        help="explore on Ray actors (--workers of them, default 2): a local Ray instance, "
        "or the cluster at ADDRESS (auto, ray://HEAD:10001); needs pdproto[ray]",
    )
    p.add_argument(
        "--fingerprint",
        action="store_true",
        help="keep 64-bit fingerprints instead of states (less memory; prints the "
        "probability that a hash collision hid a state)",
    )
    p.add_argument("--no-symmetry", action="store_true", help="do not reduce by symmetry")
    p.add_argument(
        "--no-monitor",
        action="store_true",
        help="check the model against its own invariants and sometimes properties "
        "alone (no event monitor: for models that emit no handoff events)",
    )
    p.add_argument(
        "--continue",
        dest="keep_going",
        action="store_true",
        help="keep exploring after a counterexample (one shortest trace per invariant)",
    )
    p.add_argument(
        "--backend",
        choices=("torch",),
        default=None,
        help="also run every explored step on real paged KV buffers (torch) along the "
        "breadth-first tree and report kv-corruption (capped at "
        f"{BACKEND_DEFAULT_STATES:,} states unless --max-states, at most "
        f"{BACKEND_MAX_STATES:,})",
    )
    p.add_argument("--device", default=None, help="with --backend torch: cpu (default) or cuda")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
        help="with --backend torch: KV dtype (default bfloat16)",
    )
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
        help="with --backend torch: also run a real transformer (as pdproto replay --model: "
        "tiny-llama, tiny-qwen2, tiny-mistral, smollm2-135m or a local model folder) on every "
        "explored step and compare its logits with a colocated run (logit-divergence; slow: "
        "for small searches)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--out",
        metavar="TRACE.jsonl",
        help="write the (first) counterexample as a history that `pdproto audit` reads",
    )
    p.add_argument(
        "--graph",
        metavar="FILE",
        help=f"write the explored state graph (.graphml or .dot; at most {GRAPH_LIMIT} states)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Any) -> int:
    from ..drivers import explore, list_models, load_model
    from ..protocol import parse_faults

    if args.list:
        return _list(args, console, list_models())
    if args.graph is not None and not args.graph.endswith((".graphml", ".dot")):
        raise UsageError("--graph", args.graph, "a file name ending in .graphml or .dot")
    if args.graph is not None and args.fingerprint:
        raise UsageError("--graph with --fingerprint", args.graph, "exact mode (drop --fingerprint)")
    args.workers, model_workers = _split_workers(args.workers)
    parallel = args.workers is not None or args.ray is not None
    if parallel and args.graph is not None:
        raise UsageError("--graph with --workers/--ray", args.graph, "a serial search (drop --workers/--ray)")
    if parallel and args.backend is not None:
        raise UsageError(
            "--backend with --workers/--ray", args.backend, "a serial search (drop --workers/--ray)"
        )
    check_output_path(args.out, "--out")  # before the run, not at its end
    check_output_path(args.graph, "--graph")
    backend_opts = _backend_options(args)
    faults = parse_faults(args.faults) if args.faults is not None else None
    model, info = load_model(
        args.model,
        mode=args.policy,
        requests=args.requests,
        blocks=args.blocks,
        faults=faults,
        prefix_cache=args.prefix_cache,
        chunks=args.chunks,
        layerwise=args.layerwise,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        prefill_workers=model_workers[0],
        decode_workers=model_workers[1],
    )
    for warning in info.warnings:  # one plain line each, never wrapped
        print(f"pdproto check: warning: {warning}", file=sys.stderr)
    max_states = args.max_states
    backend = None
    if backend_opts is not None:
        backend = _backend_factory(model, backend_opts)
        if max_states is None:
            max_states = BACKEND_DEFAULT_STATES

    progress, live = _progress(args)
    try:
        result = explore(
            model,
            backend=backend,
            max_states=max_states,
            symmetry=not args.no_symmetry,
            monitor=not args.no_monitor,
            fingerprint=args.fingerprint,
            progress=progress,
            keep_graph=args.graph is not None,
            graph_limit=GRAPH_LIMIT,
            stop_on_first=not args.keep_going,
            max_seconds=args.max_seconds,
            workers=args.workers,
            ray=None if args.ray is None else (args.ray or True),
        )
    finally:
        if live is not None:
            live.stop()
        if backend is not None and hasattr(backend, "close"):
            backend.close()  # the transport's agents (one for the whole search)

    if args.graph is not None:
        if result.graph is None:
            raise UsageError(
                "--graph",
                args.graph,
                f"a state space of at most {GRAPH_LIMIT} states (this one has more than that; "
                "use a smaller configuration or --max-states)",
            )
        _write_graph(result.graph, args.graph)

    written = None
    failures = result.failures
    if args.out is not None and failures:
        written = _write_trace(args.out, result, failures[0])

    if args.json:
        obj = result.to_dict()
        obj["config"] = _config_dict(info.config)
        obj["expected"] = info.expected
        if written is not None:
            obj["out"] = written
        if backend_opts is not None:
            obj["backend"] = dict(backend_opts, name="torch", max_states=max_states)
        if args.graph is not None:
            obj["graph"] = args.graph
        if args.no_monitor:
            obj["monitor"] = False
        if parallel:
            obj["workers"] = args.workers if args.workers is not None else 2
            obj["ray"] = args.ray or True if args.ray is not None else False
        print_json(obj, console.file)
    else:
        _report(console, result, info, written, args, backend_opts)
    if not result.ok:
        return EXIT_VIOLATION
    return EXIT_OK


def _workers_value(text: str) -> Any:
    """An argparse type for --workers: N (an int) or P:D (a pair)."""
    from ._fuzz import parse_workers

    if ":" in text:
        try:
            return parse_workers(text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not {exc.allowed}") from None
    return positive_int(text)


def _pd_workers_value(text: str) -> tuple[int, int]:
    """--pd-workers P:D: the model's prefill and decode worker counts."""
    from ._fuzz import parse_workers

    try:
        return parse_workers(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not {exc.allowed}") from None


def _split_workers(values: list | None) -> tuple[int | None, tuple[int | None, int | None]]:
    """(worker processes or None, (prefill, decode) model workers or Nones)
    from the --workers values; each form at most once."""
    counts = [v for v in values or () if isinstance(v, int)]
    pairs = [v for v in values or () if isinstance(v, tuple)]
    if len(counts) > 1 or len(pairs) > 1:
        extra = counts[1] if len(counts) > 1 else "{}:{}".format(*pairs[1])
        raise UsageError("--workers", extra, "N once and P:D once")
    return (counts[0] if counts else None), (pairs[0] if pairs else (None, None))


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (ASCII digits, one dot)."""
    import math

    ok = bool(text) and text.isascii() and text.replace(".", "", 1).isdigit()
    value = float(text) if ok else math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _backend_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """Check the --backend options (before loading anything); None without --backend."""
    if args.backend is None:
        for flag, value in (
            ("--device", args.device),
            ("--dtype", args.dtype),
            ("--transformer", args.transformer),
            ("--transport", args.transport),
        ):
            if value is not None:
                raise UsageError(flag, value, "--backend torch along with it")
        return None
    if args.max_states is not None and args.max_states > BACKEND_MAX_STATES:
        raise UsageError(
            "--max-states with --backend torch",
            args.max_states,
            f"at most {BACKEND_MAX_STATES:,} (every state of the search frontier holds its own "
            "KV pools; check larger spaces without --backend)",
        )
    return {
        "device": args.device or "cpu",
        "dtype": args.dtype or "bfloat16",
        "layers": BACKEND_LAYERS,
        "kv_heads": BACKEND_KV_HEADS,
        "head_dim": BACKEND_HEAD_DIM,
        **({"model": args.transformer} if args.transformer is not None else {}),
        **({"transport": args.transport} if args.transport not in (None, "copy") else {}),
    }


def _backend_factory(model: Any, opts: dict[str, Any]) -> Any:
    """A factory of torch backends for ``model``'s header; imports torch (a
    clear error, exit 2, when it is missing)."""
    from ..drivers import load_torch_backend
    from ..spec import HistoryHeader

    header = getattr(model, "header", None) or HistoryHeader()
    if "model" in opts:  # a real transformer beside the ownership channel (its own layers and heads)
        from ..drivers import model_backend_factory

        make = model_backend_factory(
            opts["model"], device=opts["device"], dtype=opts["dtype"], head_dim=opts["head_dim"]
        )
        first = make(header)  # a bad model, --device or --dtype fails before the search
        opts["device"] = str(first.device)
        opts["layers"], opts["kv_heads"] = first.m.layers, first.m.kv_heads
        return lambda: make(header)
    tb = load_torch_backend()
    if "transport" in opts and "model" in opts:
        raise UsageError("--transport with --transformer", opts["transport"], "copy")
    from ..drivers import load_transport

    tr = load_transport(opts.get("transport"))  # one transport (its agents) for every state's backend
    # one backend now: a bad --device or --dtype fails before the search
    first = tb.TorchBackend(
        header,
        device=opts["device"],
        dtype=opts["dtype"],
        layers=opts["layers"],
        kv_heads=opts["kv_heads"],
        head_dim=opts["head_dim"],
        transport=tr,
    )
    opts["device"] = str(first.device)
    opts["dtype"] = first.layout.dtype
    opts["block_size"] = first.layout.block_size

    def factory() -> Any:
        return tb.TorchBackend(
            header,
            device=opts["device"],
            dtype=opts["dtype"],
            layers=opts["layers"],
            kv_heads=opts["kv_heads"],
            head_dim=opts["head_dim"],
            transport=tr,
        )

    factory.close = tr.close  # type: ignore[attr-defined]
    return factory


# -- output -------------------------------------------------------------------


#: The format 1.1 fields of a handoff configuration, with their "off" value:
#: left out of the printed configuration when off.
_V11_OFF = {"prefix_cache": False, "chunks": 1, "layerwise": False, "heartbeat": False}


def _config_dict(config: Any) -> Any:
    if config is None:
        return None
    try:
        import attrs

        if attrs.has(type(config)):
            out = attrs.asdict(config)
            if isinstance(out.get("faults"), dict):
                out["faults"] = {k: v for k, v in out["faults"].items() if v}
            if "policy" in out and "mode" not in out:  # "mode": the key's name before "policy"
                out = {"mode": out["policy"], **out}
            for key, off in _V11_OFF.items():  # format 1 configurations print as before
                if key in out and out[key] == off:
                    del out[key]
            return out
    except Exception:  # pragma: no cover - best effort
        pass
    return repr(config)


def _list(args: argparse.Namespace, console: Any, models: list) -> int:
    from ..drivers import list_rows  # the catalogue's rows in short (docs/bugs.md in full)

    rows = list_rows(models)
    if args.json:
        print_json(rows, console.file)
        return EXIT_OK
    from rich.table import Table

    table = Table(title="models (docs/bugs.md has every tool's verdict)", title_justify="left")
    for column in ("model", "expected invariant", "project", "family", "faults", "what it models"):
        table.add_column(column)
    for r in rows:
        expected = r["expected"] or ("none (benign)" if r["benign"] else "none (correct)")
        table.add_row(
            esc(r["model"]),
            esc(expected),
            esc(r["project"]),
            esc(r["family"]),
            esc(", ".join(r["faults"]) or "-"),
            esc(r["summary"]),
        )
    console.print(table)
    return EXIT_OK


def _progress(args: argparse.Namespace) -> tuple[Any, Any]:
    """A live status line on stderr: only on a terminal, never with --json
    (nor when stdout is not a terminal: the output goes to a file or a pipe)."""
    from rich.console import Console

    err = Console(stderr=True, highlight=False)
    if args.json or not err.is_terminal or not sys.stdout.isatty():
        return None, None
    from rich.live import Live
    from rich.text import Text

    live = Live(Text("exploring ..."), console=err, transient=True, refresh_per_second=5)
    live.start()

    def progress(info: dict[str, Any]) -> None:
        live.update(Text(progress_line(info)))

    return progress, live


def progress_line(info: dict[str, Any]) -> str:
    """One status line from an explorer progress dict: states, states/s,
    transitions, level, frontier, memory, and an ETA when the level sizes
    shrink steadily (the rest of the search then is about their geometric
    tail)."""
    sec = info["seconds"]
    rate = info["states"] / sec if sec > 0 else 0.0
    parts = [
        f"exploring: {info['states']:,} states ({rate:,.0f}/s)",
        f"{info['transitions']:,} transitions",
        f"level {info.get('level', info['depth'])}",
        f"frontier {info.get('frontier', info['queue']):,}",
    ]
    if info.get("memory"):
        parts.append(f"{info['memory'] / 2**20:,.0f} MiB")
    if info.get("workers"):
        parts.append(f"{info['workers']} workers")
    eta = _eta(info.get("levels") or [], rate)
    if eta is not None:
        parts.append(f"ETA {eta:,.0f} s")
    parts.append(f"{sec:.1f} s")
    text = ", ".join(parts)
    if info["violations"]:
        text += f", {info['violations']} counterexample(s)"
    return text


def _eta(levels: list[int], rate: float) -> float | None:
    """Seconds left, when the last three levels shrink (ratio r < 1): the
    levels to come are about last * (r + r^2 + ...)."""
    if len(levels) < 3 or rate <= 0 or not (levels[-1] < levels[-2] < levels[-3]):
        return None
    r = max(levels[-1] / levels[-2], levels[-2] / levels[-3])
    if r >= 1:
        return None
    return levels[-1] * r / (1 - r) / rate


def _event_text(ev: Any) -> str:
    d = ev.to_dict()
    name = d.pop("ev")
    parts = []
    for k, v in d.items():
        if isinstance(v, list):
            v = "[" + ",".join(map(str, v)) + "]"
        parts.append(f"{k}={v}")
    return f"{name}(" + " ".join(parts) + ")"


def _report(
    console: Any,
    result: Any,
    info: Any,
    written: str | None,
    args: argparse.Namespace,
    backend_opts: dict[str, Any] | None = None,
) -> None:
    from rich.table import Table

    verdict = "[bold green]OK[/]" if result.ok else "[bold red]FAILED[/]"
    table = Table(title=f"pdproto check {esc(info.spec)}: {verdict}", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("model", esc(result.model))
    if info.config is not None:
        table.add_row("configuration", esc(_config_text(info.config)))
    if info.has_expected:
        table.add_row("expected", info.expected or "no violation (correct model)")
    table.add_row(
        "distinct states",
        f"{result.states:,}"
        + (
            ""
            if result.complete
            else (
                f" (partial: stopped by --{(result.stopped_by or 'max_states').replace('_', '-')}, "
                "not exhaustive)"
                if result.truncated
                else " (stopped at the first counterexample)"
            )
        ),
    )
    if result.truncated and backend_opts is not None and args.max_states is None:
        table.add_row(
            "",
            f"[yellow]--backend torch stops at {BACKEND_DEFAULT_STATES:,} states unless "
            f"--max-states (at most {BACKEND_MAX_STATES:,})[/]",
        )
    table.add_row("transitions", f"{result.transitions:,}")
    table.add_row("depth", str(result.depth))
    sps = result.states_per_second
    table.add_row("time", f"{result.seconds:.2f} s ({sps:,.0f} states/s)")
    table.add_row("symmetry", result.symmetry)
    if args.workers is not None or args.ray is not None:
        where = (
            "Ray actors" + (f" at {args.ray}" if args.ray else " (local Ray)")
            if args.ray is not None
            else "worker processes"
        )
        table.add_row("parallel", f"{args.workers or 2} {where}, level-synchronous (docs/scaling.md)")
    if args.no_monitor:
        table.add_row("monitor", "off (the model's own invariants and sometimes only)")
    if backend_opts is not None:
        o = backend_opts
        table.add_row(
            "backend",
            f"torch on {o['device']} ({o['dtype']}, {o['layers']} layer x {o['kv_heads']} KV heads x head "
            f"dim {o['head_dim']}, block size {o['block_size']}): every step of the breadth-first tree "
            "replayed on KV buffers",
        )
    if result.bytes_per_state is not None and not result.fingerprint:
        table.add_row("storage", f"exact states, {result.bytes_per_state:.0f} bytes/state stored")
    if result.fingerprint:
        table.add_row(
            "storage",
            f"fingerprints, {result.bytes_per_state:.1f} bytes/state; probability that a hash "
            f"collision hid a state: {result.collision_probability:.2g}",
        )
    table.add_row("violations", _count(len(result.violations) + len(result.invariant_failures)))
    table.add_row("deadlocks", _count(len(result.deadlocks)))
    if result.complete:
        if result.unmet_sometimes:
            table.add_row("sometimes", "[red]never reached: " + ", ".join(result.unmet_sometimes) + "[/]")
        elif result.met_sometimes:
            table.add_row("sometimes", f"all {len(result.met_sometimes)} reached")
    elif result.unmet_sometimes:
        table.add_row(
            "sometimes",
            "not judged (search incomplete); not yet reached: " + ", ".join(result.unmet_sometimes),
        )
    console.print(table)

    for cx in result.failures:
        kind = {"violation": "violation", "deadlock": "deadlock", "state-invariant": "state invariant"}[
            cx.kind
        ]
        console.print()
        console.print(
            f"[bold red]{kind}: {cx.invariant}[/] ({len(cx.trace)} steps, shortest): ",
            esc(cx.message),
            sep="",
            markup=True,
            highlight=False,
        )
        steps = Table(show_lines=False)
        steps.add_column("#", justify="right")
        steps.add_column("actor")
        steps.add_column("action")
        steps.add_column("events")
        for s in cx.trace:
            action = str(s.action) + (" [fault]" if s.fault else "")
            steps.add_row(
                str(s.index),
                esc(s.actor or "?"),
                esc(action),
                esc("\n".join(_event_text(e) for e in s.events) or "-"),
            )
        console.print(steps)
        if cx.kind == "deadlock":
            console.print("no action is enabled after the last step, and the history ends here.")
    if written is not None:
        console.print(
            f"counterexample written to {esc(written)} (check it with: pdproto audit {esc(written)})"
        )
    elif args.out is not None:
        console.print(f"no counterexample; {esc(args.out)} not written")


def _count(n: int) -> str:
    return "[green]none[/]" if n == 0 else f"[red]{n}[/]"


def _config_text(config: Any) -> str:
    d = _config_dict(config)
    if isinstance(d, dict):
        faults = d.pop("faults", None)
        text = ", ".join(f"{k}={v}" for k, v in d.items())
        if faults:
            text += ", faults " + ", ".join(f"{k}={v}" for k, v in faults.items())
        return text
    return str(d)


def _write_trace(path: str, result: Any, cx: Any) -> str:
    from ..drivers import trace_header
    from ..spec import write_history

    try:
        write_history(path, cx.events, trace_header(result.header, cx))
    except OSError as exc:
        raise UsageError("--out", path, f"a writable file ({exc.strerror})") from None
    return path


def _write_graph(graph: Any, path: str) -> None:
    try:
        if path.endswith(".graphml"):
            import networkx as nx

            nx.write_graphml(graph, path)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write("digraph states {\n")
                for node, data in graph.nodes(data=True):
                    shape = ' shape="doublecircle"' if data.get("initial") else ""
                    fh.write(f"  {node}{shape};\n")
                for a, b, data in graph.edges(data=True):
                    label = json.dumps(data.get("action", ""))
                    fh.write(f"  {a} -> {b} [label={label}];\n")
                fh.write("}\n")
    except OSError as exc:
        raise UsageError("--graph", path, f"a writable file ({exc.strerror})") from None
