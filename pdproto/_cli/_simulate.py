"""``pdproto simulate``: colocated, chunked prefill and PD at the same device
budget on one workload, with goodput, pool signals and every PD handoff
judged by the monitor; ``--sweep`` picks N_P:N_D (and TP per role).

Exit codes: 0 clean, 1 the monitor found a violation (the run stops there,
naming the request and the simulated time), 2 bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._errors import UsageError, parse_int
from . import EXIT_OK, EXIT_VIOLATION
from ._args import check_output_path, esc, int_type, print_json

__all__ = ["add_parser", "run"]

_INT = int_type(minimum=0)
_POS = int_type(minimum=1)
DEFAULT_SLO = "ttft:500,tpot:50"
DEFAULT_PROMPT = "lognormal:1000,0.6"
DEFAULT_OUTPUT = "lognormal:200,0.6"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate colocated, chunked prefill and PD serving at the same device budget",
        description=(
            "Discrete-event simulation of one workload on colocated continuous batching, chunked "
            "prefill and PD disaggregation (N_P prefill + N_D decode instances) at the same device "
            "budget: TTFT, TPOT, ITL, E2E, the first generated gap, goodput under --slo, pool queues, "
            "KV occupancy, utilisation, transfers and weight copies.  Every PD handoff is emitted as "
            "history events and judged inline by the monitor.  --sweep finds the best N_P:N_D.  "
            "Exit 0 clean, 1 a monitor violation, 2 bad input.  See docs/simulate.md."
        ),
    )
    w = p.add_argument_group("workload")
    w.add_argument("--requests", "-n", type=_POS, metavar="N", help="requests to simulate (default 2000)")
    w.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="RPS",
        help="mean arrival rate, requests/s (default 4; with --trace: rescales the trace's time)",
    )
    w.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "fixed", "trace"),
        default=None,
        help="arrival process (default poisson; trace with --trace)",
    )
    w.add_argument("--cv", type=float, metavar="X", help="gamma: coefficient of variation of the gaps")
    w.add_argument("--burstiness", type=float, metavar="K", help="gamma: vLLM's burstiness (shape = 1/cv^2)")
    w.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a trace (Azure, SplitwiseSim, Vidur, Mooncake CSV/JSONL, or our JSONL)",
    )
    w.add_argument("--trace-format", metavar="NAME", help="the trace's format (default: from its header)")
    w.add_argument("--time-scale", type=float, metavar="X", help="trace replay: multiply its times by X")
    w.add_argument(
        "--prompt",
        metavar="DIST",
        help=f"prompt lengths: fixed:N, uniform:LO,HI, lognormal:MEDIAN,SIGMA"
        f"[,LO,HI], empirical:A,B,..., trace (default {DEFAULT_PROMPT}; trace with --trace)",
    )
    w.add_argument("--output", metavar="DIST", help=f"output lengths, same forms (default {DEFAULT_OUTPUT})")
    w.add_argument(
        "--cancel-rate", type=float, default=0.0, metavar="P", help="share of requests the client cancels"
    )
    w.add_argument(
        "--cancel-phase",
        choices=("queued", "prefill", "transfer", "decode"),
        help="the phase a cancel waits for (default: any, at --cancel-delay after arrival)",
    )
    w.add_argument("--cancel-delay", type=float, metavar="S", help="earliest cancel, s after arrival")
    w.add_argument("--seed", type=_INT, default=0, metavar="N", help="random seed (default 0)")

    s = p.add_argument_group("system")
    s.add_argument(
        "--llm",
        "--model",
        dest="model",
        default="llama-3-8b",
        metavar="NAME",
        help="the LLM served (the cost model's presets; default llama-3-8b; --model is the same flag)",
    )
    s.add_argument(
        "--device",
        default="h100-sxm",
        metavar="NAME",
        help="device: a100-80g, h100-sxm, h200 (default h100-sxm)",
    )
    s.add_argument(
        "--arm",
        choices=("all", "colocated", "chunked", "pd"),
        default="all",
        help="which arm(s) to run (default all three at the same budget)",
    )
    s.add_argument("--pd", metavar="NP:ND", help="prefill:decode instances of the PD arm (default 1:1)")
    s.add_argument("--tp-p", type=_POS, metavar="N", help="TP of a prefill instance (default 1)")
    s.add_argument("--tp-d", type=_POS, metavar="N", help="TP of a decode instance (default 1)")
    s.add_argument(
        "--devices",
        type=_POS,
        metavar="N",
        help="device budget of the colocated arms (default: what PD uses)",
    )
    s.add_argument("--tp", type=_POS, metavar="N", help="TP of a colocated instance (default 1)")
    s.add_argument(
        "--block-size", type=_POS, default=64, metavar="N", help="tokens per KV block (default 64)"
    )
    s.add_argument(
        "--kv-blocks",
        type=_POS,
        metavar="N",
        help="KV blocks per instance (default: what fits beside the weights)",
    )
    s.add_argument(
        "--max-batch-tokens", type=_POS, default=8192, metavar="N", help="prefill batch cap (default 8192)"
    )
    s.add_argument(
        "--chunk-tokens",
        type=_POS,
        default=512,
        metavar="N",
        help="chunked prefill step budget (default 512)",
    )
    s.add_argument(
        "--latency-table",
        metavar="CSV",
        help="piecewise-linear step times (phase,tokens,ms) instead of "
        "the roofline (with --sweep: one --tps size)",
    )

    n = p.add_argument_group("KV transfer (PD)")
    n.add_argument(
        "--bandwidth", type=float, default=25.0, metavar="GIBPS", help="per link, GiB/s (default 25)"
    )
    n.add_argument("--latency-ms", type=float, default=0.05, metavar="X", help="per transfer (default 0.05)")
    n.add_argument(
        "--links", type=_POS, default=1, metavar="N", help="links per P instance's egress (default 1: shared)"
    )
    n.add_argument(
        "--layerwise", action="store_true", help="overlap the transfer with the prefill, layer by layer"
    )
    n.add_argument(
        "--coord-ms", type=float, default=2.0, metavar="X", help="handoff coordination (default 2)"
    )

    f = p.add_argument_group("faults (PD) and admission")
    f.add_argument(
        "--transfer-fail-rate", type=float, default=0.0, metavar="P", help="share of transfers that fail"
    )
    f.add_argument("--transfer-timeout-ms", type=float, metavar="X", help="abort a transfer running longer")
    f.add_argument(
        "--max-retries", type=_INT, default=3, metavar="N", help="new generations per request (default 3)"
    )
    f.add_argument(
        "--queue-timeout", type=float, metavar="S", help="reject a request waiting longer for admission"
    )
    f.add_argument("--max-queue", type=_POS, metavar="N", help="reject arrivals beyond this queue length")

    v = p.add_argument_group("protocol")
    v.add_argument(
        "--history", metavar="FILE", help="write the PD arm's handoff events (pdproto audit reads it)"
    )
    v.add_argument("--no-monitor", action="store_true", help="do not judge the handoffs inline")
    v.add_argument(
        "--decode-events",
        choices=("first", "all"),
        default="first",
        help="decode events per generation: the first (the handoff boundary; default) or every token",
    )

    g = p.add_argument_group("goodput and sweep")
    g.add_argument(
        "--slo",
        default=DEFAULT_SLO,
        metavar="KEY:MS,...",
        help=f"SLO bounds in ms: ttft, tpot, e2e, itl, first_gap (default {DEFAULT_SLO})",
    )
    g.add_argument(
        "--target", type=float, default=0.9, metavar="X", help="SLO attainment target (default 0.9)"
    )
    g.add_argument(
        "--sweep", action="store_true", help="the P:D picker: max rate meeting --target per configuration"
    )
    g.add_argument("--budget", type=_POS, metavar="N", help="--sweep: device budget (default 4)")
    g.add_argument("--tps", metavar="A,B", help="--sweep: TP sizes per role to try (default 1)")
    g.add_argument(
        "--at-rate",
        type=float,
        metavar="RPS",
        help="--sweep: instead, the cheapest budget meeting --target at this rate",
    )
    g.add_argument(
        "--max-devices", type=_POS, metavar="N", help="--sweep --at-rate: largest budget (default 16)"
    )
    g.add_argument(
        "--sweep-requests", type=_POS, metavar="N", help="--sweep: requests per probe, at least (default 400)"
    )
    g.add_argument(
        "--sweep-span",
        type=float,
        metavar="S",
        help="--sweep: a probe runs at least S simulated seconds of arrivals (default 20)",
    )

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    o.add_argument("--plot", metavar="DIR", help="write plots there (needs matplotlib)")
    p.set_defaults(run=run)


# -- inputs -------------------------------------------------------------------------


def _numbers(text: str, flag: str, form: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(flag, text, form) from None


def parse_lengths(text: str, flag: str) -> Any:
    """``fixed:N``, ``uniform:LO,HI``, ``lognormal:MEDIAN,SIGMA[,LO,HI]``,
    ``empirical:A,B,...``, ``trace``."""
    from ..sim import Lengths

    form = "fixed:N, uniform:LO,HI, lognormal:MEDIAN,SIGMA[,LO,HI], empirical:A,B,... or trace"
    kind, _sep, rest = text.strip().partition(":")
    kind = kind.lower()
    if kind == "trace" and not rest:
        return Lengths.trace()
    nums = _numbers(rest, flag, form)
    ints = [int(x) for x in nums if x == int(x)]
    try:
        if kind == "fixed" and len(nums) == 1 and len(ints) == 1:
            return Lengths.fixed(ints[0])
        if kind == "uniform" and len(nums) == 2 and len(ints) == 2:
            return Lengths.uniform(*ints)
        if kind == "lognormal" and len(nums) in (2, 4):
            if len(nums) == 4:
                if nums[2] != int(nums[2]) or nums[3] != int(nums[3]):
                    raise UsageError(flag, text, form)
                return Lengths.lognormal(nums[0], nums[1], int(nums[2]), int(nums[3]))
            return Lengths.lognormal(nums[0], nums[1])
        if kind == "empirical" and nums and len(ints) == len(nums):
            return Lengths.empirical(ints)
    except UsageError as exc:
        raise UsageError(flag, text, f"{form} ({exc})") from None
    raise UsageError(flag, text, form)


def _workload(args: argparse.Namespace) -> Any:
    from ..sim import Arrival, Cancellation, WorkloadSpec

    trace = args.trace
    arrival_kind = args.arrival or ("trace" if trace else "poisson")
    if arrival_kind == "trace" and not trace:
        raise UsageError("--arrival", "trace", "a trace file given with --trace")
    rate = args.rate
    if arrival_kind == "poisson":
        arrival = Arrival.poisson(rate if rate is not None else 4.0)
    elif arrival_kind == "gamma":
        if (args.cv is None) == (args.burstiness is None):
            raise UsageError(
                "--arrival", "gamma", "exactly one of --cv and --burstiness with --arrival gamma"
            )
        arrival = Arrival.gamma(rate if rate is not None else 4.0, args.cv, burstiness=args.burstiness)
    elif arrival_kind == "fixed":
        arrival = Arrival.fixed(rate if rate is not None else 4.0)
    else:
        arrival = Arrival.trace(args.time_scale)
    for flag, value in (("--prompt", args.prompt), ("--output", args.output)):
        if not trace and value is not None and value.strip().lower() == "trace":
            raise UsageError(
                flag,
                value,
                "a trace file given with --trace for lengths from a trace (or fixed:N, "
                "uniform:LO,HI, lognormal:MEDIAN,SIGMA[,LO,HI], empirical:A,B,...)",
            )
    default_len = "trace" if trace else None
    prompt = parse_lengths(args.prompt or default_len or DEFAULT_PROMPT, "--prompt")
    output = parse_lengths(args.output or default_len or DEFAULT_OUTPUT, "--output")
    cancel = None
    if args.cancel_rate:
        cancel = Cancellation(args.cancel_rate, args.cancel_phase, args.cancel_delay)
    spec = WorkloadSpec(arrival, prompt, output, cancel, trace, args.trace_format)
    if arrival_kind == "trace" and rate is not None:
        spec = spec.with_rate(rate)
    return spec


def _pd_split(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        if sep:
            return parse_int(a, "--pd", minimum=1), parse_int(b, "--pd", minimum=1)
    except UsageError:
        pass
    raise UsageError("--pd", text, "NP:ND with two integers >= 1, e.g. 2:1")


_FLAG = {
    "bandwidth_gibps": "--bandwidth",
    "latency_ms": "--latency-ms",
    "coord_ms": "--coord-ms",
    "transfer_fail_rate": "--transfer-fail-rate",
    "transfer_timeout_ms": "--transfer-timeout-ms",
    "queue_timeout_s": "--queue-timeout",
    "model": "--model",
    "device": "--device",
    "tp": "--tp",
    "max_retries": "--max-retries",
    "rate": "--rate",
    "cancel rate": "--cancel-rate",
    "cancel delay": "--cancel-delay",
    "time scale": "--time-scale",
    "cv": "--cv",
    "burstiness": "--burstiness",
    "time_scale": "--time-scale",
    "trace format": "--trace-format",
    "latency table": "--latency-table",
}


def _renamed(exc: UsageError) -> UsageError:
    flag = _FLAG.get(exc.what)
    return UsageError(flag, exc.value, exc.allowed) if flag else exc


def _configs(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    import attrs

    from ..sim import SimConfig

    n_p, n_d = _pd_split(args.pd)
    pd_devices = n_p * args.tp_p + n_d * args.tp_d
    devices = args.devices if args.devices is not None else pd_devices
    base = SimConfig(
        arm="pd",
        model=args.model,
        device=args.device,
        devices=devices,
        tp=args.tp,
        n_p=n_p,
        n_d=n_d,
        tp_p=args.tp_p,
        tp_d=args.tp_d,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        max_batch_tokens=args.max_batch_tokens,
        chunk_tokens=args.chunk_tokens,
        bandwidth_gibps=args.bandwidth,
        latency_ms=args.latency_ms,
        links=args.links,
        layerwise=args.layerwise,
        coord_ms=args.coord_ms,
        transfer_fail_rate=args.transfer_fail_rate,
        transfer_timeout_ms=args.transfer_timeout_ms,
        max_retries=args.max_retries,
        queue_timeout_s=args.queue_timeout,
        max_queue=args.max_queue,
        seed=args.seed,
    )
    arms = ("colocated", "chunked", "pd") if args.arm == "all" else (args.arm,)
    if not args.sweep and arms != ("pd",) and devices % args.tp:
        if args.devices is not None:
            raise UsageError(
                "--devices",
                devices,
                f"a multiple of --tp {args.tp} (a colocated instance takes "
                f"--tp devices; the rest would idle)",
            )
        raise UsageError(
            "--tp",
            args.tp,
            f"a divisor of the {devices} devices PD uses (--pd {args.pd}), or give "
            f"--devices (a colocated instance takes --tp devices; the rest would idle)",
        )
    return base, [attrs.evolve(base, arm=a) for a in arms]


def _tps(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({parse_int(x, "--tps", minimum=1) for x in text.split(",")}))
    except UsageError:
        raise UsageError("--tps", text, "TP sizes as integers >= 1 separated by commas, e.g. 1,2") from None


# -- running ------------------------------------------------------------------------


class _FirstArrivals:
    """A record sink that passes every record on to ``add`` and keeps the
    ``k`` completed requests that arrived first (the seed's two-request
    timeline), whenever they finish."""

    def __init__(self, add: Any, k: int = 2) -> None:
        self.add, self.k = add, k
        self.records: list[Any] = []

    def __call__(self, record: Any) -> None:
        self.add(record)
        if record.completed and (len(self.records) < self.k or record.arrival < self.records[-1].arrival):
            self.records = sorted([*self.records, record], key=lambda x: x.arrival)[: self.k]


def _run_arm(
    spec: Any, cfg: Any, args: argparse.Namespace, slo: Any, table: Any, history: Any
) -> dict[str, Any]:
    from ..sim import Metrics, expected_span, make_workload, signals, simulate

    m = Metrics(
        cfg.label(),
        devices=cfg.used_devices,
        weight_copies=cfg.weight_copies,
        keep_records=200 if args.plot else 0,
    )
    first = _FirstArrivals(m.add) if args.plot else None
    pd = cfg.arm == "pd"
    res = simulate(
        make_workload(spec, args.requests, args.seed),
        cfg,
        metrics=m,
        sink=first,
        monitor=pd and not args.no_monitor,
        history=history if pd else None,
        decode_events=args.decode_events,
        table=table,
        sample_dt=expected_span(spec, args.requests) / 400,
    )
    summary = m.summary(slo, duration=res.duration)
    out = {
        "arm": cfg.arm,
        "label": cfg.label(),
        "result": res.to_dict(),
        "metrics": summary,
        "signals": signals(res),
        "_metrics": m,
        "_result": res,
        "_first": first.records if first else [],
    }
    faults = cfg.transfer_fail_rate > 0 or cfg.transfer_timeout_ms is not None
    if pd and faults and res.ok:
        import attrs

        clean = attrs.evolve(cfg, transfer_fail_rate=0.0, transfer_timeout_ms=None)
        m2 = Metrics(clean.label(), devices=clean.used_devices, weight_copies=clean.weight_copies)
        res2 = simulate(
            make_workload(spec, args.requests, args.seed), clean, metrics=m2, monitor=False, table=table
        )
        s2 = m2.summary(slo, duration=res2.duration)
        out["goodput_lost_to_faults"] = {
            "goodput_without_faults": s2["goodput"],
            "goodput_with_faults": summary["goodput"],
            "lost": s2["goodput"] - summary["goodput"],
            "lost_share": (s2["goodput"] - summary["goodput"]) / s2["goodput"] if s2["goodput"] else 0.0,
        }
    return out


def _check_fits(configs: list[Any], table: Any) -> None:
    """Every arm's instances can be built (the weights fit, with room for KV) before any arm runs."""
    from ..sim import fit_error

    for cfg in configs:
        exc = fit_error(cfg, table)
        if exc is None:
            continue
        if exc.what not in ("tp", "kv_blocks"):
            raise _renamed(exc) from None
        flag, tp = ("--tp-p/--tp-d", f"{cfg.tp_p}/{cfg.tp_d}") if cfg.arm == "pd" else ("--tp", cfg.tp)
        raise UsageError(
            flag, tp, f"{exc.allowed} (the {cfg.label()} arm; or another --model, --device)"
        ) from None


#: flags whose default is None in the parser (so that only one typed counts in _check_ignored), and
#: their values when not given
_DEFAULTS = {
    "pd": "1:1",
    "tp_p": 1,
    "tp_d": 1,
    "tp": 1,
    "requests": 2000,
    "time_scale": 1.0,
    "cancel_delay": 0.0,
    "tps": "1",
    "max_devices": 16,
    "sweep_requests": 400,
    "sweep_span": 20.0,
}


def _check_ignored(args: argparse.Namespace) -> None:
    """A flag typed where nothing reads it is an error (before the defaults fill in)."""
    arrival = args.arrival or ("trace" if args.trace else "poisson")
    sweep, cheapest = args.sweep, args.sweep and args.at_rate is not None
    no_cancel = "no {} without --cancel-rate P > 0 (only cancelled requests have a cancel phase or delay)"
    rules = (
        (
            "--cv",
            args.cv,
            arrival != "gamma",
            f"no --cv unless --arrival gamma (the arrival here is {arrival})",
        ),
        (
            "--burstiness",
            args.burstiness,
            arrival != "gamma",
            f"no --burstiness unless --arrival gamma (the arrival here is {arrival})",
        ),
        ("--cancel-phase", args.cancel_phase, not args.cancel_rate, no_cancel.format("--cancel-phase")),
        ("--cancel-delay", args.cancel_delay, not args.cancel_rate, no_cancel.format("--cancel-delay")),
        (
            "--time-scale",
            args.time_scale,
            arrival != "trace",
            f"no --time-scale unless a trace is replayed (--trace FILE; the arrival here is {arrival})",
        ),
        ("--trace-format", args.trace_format, not args.trace, "no --trace-format without --trace FILE"),
        ("--requests", args.requests, sweep, "no --requests with --sweep (its probes take --sweep-requests)"),
        ("--history", args.history, sweep, "no --history with --sweep (its probes write no history)"),
        (
            "--budget",
            args.budget,
            not sweep or cheapest,
            "--budget only with --sweep, and not with --at-rate (which tries budgets up to --max-devices)",
        ),
        ("--max-devices", args.max_devices, not cheapest, "--max-devices only with --sweep --at-rate"),
        ("--at-rate", args.at_rate, not sweep, "--at-rate only with --sweep"),
        ("--tp", args.tp, args.arm == "pd", "no --tp with --arm pd (a PD run takes --tp-p and --tp-d)"),
        (
            "--devices",
            args.devices,
            args.arm == "pd",
            "no --devices with --arm pd (PD uses NP*TP_P + ND*TP_D devices from --pd, --tp-p, --tp-d)",
        ),
        ("--tps", args.tps, not sweep, "--tps only with --sweep (a single run takes --tp, --tp-p, --tp-d)"),
        *(
            (
                flag,
                value,
                sweep,
                f"no {flag} with --sweep (it tries every split of --budget, or of each budget up "
                f"to --max-devices, with TP sizes from --tps)",
            )
            for flag, value in (
                ("--pd", args.pd),
                ("--tp-p", args.tp_p),
                ("--tp-d", args.tp_d),
                ("--devices", args.devices),
                ("--tp", args.tp),
            )
        ),
        ("--sweep-requests", args.sweep_requests, not sweep, "--sweep-requests only with --sweep"),
        ("--sweep-span", args.sweep_span, not sweep, "--sweep-span only with --sweep"),
    )
    for flag, value, ignored, allowed in rules:
        if value is not None and ignored:
            raise UsageError(flag, value, allowed)
    for key, value in _DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def run(args: argparse.Namespace, console: Any) -> int:
    from ..sim import SLO, PiecewiseLinear

    _check_ignored(args)
    if not 0 < args.target <= 1:
        raise UsageError("--target", args.target, "an attainment in (0, 1]")
    check_output_path(args.history, "--history")
    if args.plot:
        _plot_dir(args.plot)
    try:
        slo = SLO.parse(args.slo)
        spec = _workload(args)
        base, configs = _configs(args)
        table = PiecewiseLinear.from_csv(args.latency_table) if args.latency_table else None
    except UsageError as exc:
        raise _renamed(exc) from None
    if args.sweep:
        return _sweep(args, console, spec, base, slo, table)
    if args.history and all(c.arm != "pd" for c in configs):
        raise UsageError("--history", args.history, "a PD run (--arm pd or all): only PD has handoffs")
    _check_fits(configs, table)
    if args.plot:
        _plot_dir(args.plot, create=True)
    history = None
    runs = []
    try:
        if args.history:
            history = open(args.history, "w", encoding="utf-8")  # noqa: SIM115
        for cfg in configs:
            runs.append(_run_arm(spec, cfg, args, slo, table, history))
            if not runs[-1]["_result"].ok:
                break
    finally:
        if history is not None:
            history.close()
    plots = _plots(args.plot, runs, slo) if args.plot else []
    violation = next((r["result"]["violation"] for r in runs if r["result"]["violation"]), None)
    if args.json:
        print_json(
            {
                "workload": _describe_workload(spec, args, runs),
                "slo_ms": slo.to_ms(),
                "target": args.target,
                "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
                "verdict": _verdict(runs),
                "violation": violation,
                "plots": plots,
            }
        )
    else:
        _report(console, spec, args, slo, runs)
        for path in plots:
            console.print(f"  plot: {esc(path)}")
    return EXIT_VIOLATION if violation else EXIT_OK


def _describe_workload(
    spec: Any, args: argparse.Namespace, runs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    made = runs[0]["result"]["requests"] if runs else args.requests  # a trace may hold fewer
    return {
        "requests": made,
        "rate": spec.rate,
        "arrival": spec.arrival.kind,
        "prompt": _dist(spec.prompt),
        "output": _dist(spec.output),
        "trace": spec.trace,
        "seed": args.seed,
    }


def _verdict(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [r for r in runs if r["result"]["violation"] is None]
    if not done:
        return None
    best = max(done, key=lambda r: r["metrics"].get("goodput_per_device", 0.0))
    out = {"best": best["label"], "goodput_per_device": best["metrics"].get("goodput_per_device")}
    pd = next((r for r in done if r["arm"] == "pd"), None)
    if pd is not None:
        for r in done:
            if r is not pd:
                other = r["metrics"].get("goodput_per_device") or 0.0
                out[f"pd_vs_{r['arm']}"] = (
                    pd["metrics"].get("goodput_per_device", 0.0) / other if other else None
                )
    return out


# -- the report ---------------------------------------------------------------------


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x if round(x, digits) else 0.0:,.{digits}f}"  # never a negative zero
    return f"{x:,}"


def _why(result: dict[str, Any]) -> str:
    """Why a run rejected or failed requests: counts by the engine's reason."""
    parts = []
    for key, what in (("rejections", "rejected at admission"), ("failures", "failed")):
        by = dict(result.get(key) or {})
        if by:
            reasons = ", ".join(
                f"{n:,} {why}" for why, n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))
            )
            parts.append(f"{sum(by.values()):,} {what} ({reasons})")
    return "; ".join(parts)


def _lost(lost: dict[str, Any]) -> str:
    """The goodput lost to faults in words: 0 when it rounds to zero (never "-0.000"), and a gain by
    chance (the faults change the timing) said as such."""
    without = f"{_f(lost['goodput_without_faults'], 3)} without faults"
    x = lost["lost"]
    if round(x, 3) == 0:
        return f"0 rps ({without})"
    if x < 0:
        return f"0 rps ({_f(-x, 3)} more with them, by the changed timing; {without})"
    return f"{_f(x, 3)} rps ({_f(100 * lost['lost_share'], 1)}%; {without})"


def _p(stats: dict[str, Any], key: str) -> Any:
    return stats.get(key) if stats else None


def _dist(lengths: Any) -> str:
    k = lengths.kind
    if k == "fixed":
        return f"fixed {lengths.value}"
    if k == "uniform":
        return f"uniform {lengths.low}..{lengths.high}"
    if k == "lognormal":
        clip = f", {lengths.low}..{lengths.high}" if lengths.high is not None else ""
        return f"lognormal(median {lengths.median:g}, sigma {lengths.sigma:g}{clip})"
    if k == "empirical":
        return f"empirical ({len(lengths.values)} values)"
    return "from the trace"


def _report(console: Any, spec: Any, args: argparse.Namespace, slo: Any, runs: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.text import Text

    w = _describe_workload(spec, args, runs)
    console.print(Text(f"pdproto simulate — {args.model} on {args.device}", style="bold"))
    console.print(
        f"  workload: {w['requests']:,} requests, {w['arrival']} arrivals at {_f(w['rate'], 2)} rps; prompt "
        f"{_dist(spec.prompt)}, output {_dist(spec.output)}"
        + (f"; trace {esc(w['trace'])}" if w["trace"] else "")
    )
    console.print(f"  SLO: {esc(str(slo))} ms, attainment target {args.target:g}")
    t = Table(title="Arms at the same budget (latencies in ms)", title_justify="left")
    t.add_column("")
    for r in runs:
        t.add_column(esc(r["label"]), justify="right")

    def row(name: str, fn: Any) -> None:
        t.add_row(name, *[fn(r["metrics"]) for r in runs])

    def pct(key: str, q: str) -> Any:  # "—" when no request gave a sample (all rejected, say)
        return lambda m: _f(m[key].get(q) if m[key].get("count") else None)

    row("devices (copies)", lambda m: f"{m['devices']} ({m['weight_copies']})")
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("first_gap_ms", "first gap"),
        ("e2e_ms", "E2E"),
    ):
        for q in ("median", "p90", "p99"):
            row(f"{name} {'p50' if q == 'median' else q}", pct(key, q))
    row("throughput, req/s", lambda m: _f(m["request_throughput"], 2))
    row("output tokens/s", lambda m: _f(m["output_throughput"], 0))
    row("goodput, req/s", lambda m: _f(m.get("goodput"), 2))
    row("goodput per device", lambda m: _f(m.get("goodput_per_device"), 3))
    row("SLO attainment", lambda m: _f(m.get("attainment"), 3))
    row("rejected/failed/cancel", lambda m: f"{m['rejected']}/{m['failed']}/{m['cancelled']}")
    console.print(t)
    for r in runs:
        why = _why(r["result"])
        if why:
            console.print(f"  {esc(r['label'])}: {esc(why)}")
    pools = Table(title="Pools", title_justify="left")
    pools.add_column("")
    cols = [(r, name, pool) for r in runs for name, pool in r["result"]["pools"].items()]
    for r, name, _pool in cols:
        pools.add_column(esc(f"{r['arm']}: {name}"), justify="right")
    for label, fn in (
        ("instances", lambda p: f"{p['instances']} × tp{p['tp']}"),
        ("utilisation", lambda p: _f(p["utilisation"], 2)),
        ("mean queue *", lambda p: _f(p["mean_queue"], 2)),
        (
            "waiting for D",
            lambda p: _f(p["mean_reservation_queue"], 2) if "mean_reservation_queue" in p else "",
        ),
        ("KV mean", lambda p: _f(p["mean_kv_occupancy"], 3)),
        ("KV peak", lambda p: _f(p["peak_kv_occupancy"], 3)),
        ("KV blocks each", lambda p: f"{p['kv_blocks']:,}"),
        ("preempted", lambda p: str(p["preempted"])),
    ):
        pools.add_row(label, *[fn(pool) for _r, _n, pool in cols])
    console.print(pools)
    note = "  * mean queue: requests waiting to be scheduled, summed over the pool's instances"
    if any(name == "prefill" for _r, name, _p in cols):
        note += (
            "; for a prefill pool, plus the requests waiting for a D reservation (the 'waiting for D' row)"
        )
    console.print(note)
    for r in runs:
        if r["arm"] != "pd":
            continue
        res = r["result"]
        x = res["transfers"]
        console.print(
            f"  PD transfers: {x['count']:,}, {x['bytes'] / 2**30:,.1f} GiB over {x['bandwidth_gibps']:g} "
            f"GiB/s per P egress{' (layer-wise)' if x['layerwise'] else ''}; mean {_f(x['mean_ms'], 2)} ms, "
            f"of which queueing {_f(x['mean_queueing_ms'], 2)} ms; peak {x['peak_concurrent']} concurrent"
        )
        fl = res["faults"]
        console.print(
            f"  faults: {fl['transfer_failures']} transfer failures, {fl['timeouts']} timeouts, "
            f"{fl['retries']} retries (new generations), {fl['preempted']} preempted, {fl['cancelled']} "
            f"cancelled, {fl['failed']} failed, {fl['rejected']} rejected"
        )
        lost = r.get("goodput_lost_to_faults")
        if lost:
            console.print(f"  goodput lost to faults: {_lost(lost)}")
        mon = (
            "off"
            if args.no_monitor
            else (
                f"{res['events']:,} events judged, no violation" if res["violation"] is None else "VIOLATION"
            )
        )
        console.print(
            f"  monitor: {mon}" + (f"; history written to {esc(args.history)}" if args.history else "")
        )
        if res["violation"]:
            v = res["violation"]
            console.print(
                Text(
                    f"  {v['invariant']}: request {v['request']} at t = {v['time_s']:.6f} s: {v['message']}",
                    style="bold red",
                )
            )
        console.print(Text("  Section 06 signals (PD):", style="bold"))
        _print_signals(console, r["signals"], "    ")
    v = _verdict(runs)
    per = [r["metrics"].get("goodput_per_device") or 0.0 for r in runs if r["result"]["violation"] is None]
    if v is not None and len(per) > 1 and min(per) > 0 and max(per) <= 1.01 * min(per):
        console.print(
            Text(
                "Every arm serves this load (goodput per device within 1%): the difference is in the "
                "latencies above; --sweep compares the highest rates each sustains.",
                style="bold",
            )
        )
    elif v is not None and len(runs) > 1:
        extra = "; ".join(
            f"PD/{k[6:]} = {x:.2f}×" for k, x in v.items() if k.startswith("pd_vs_") and x is not None
        )
        console.print(
            Text(
                f"Best goodput per device: {v['best']} ({_f(v['goodput_per_device'], 3)} rps/device)"
                + (f"; {extra}" if extra else ""),
                style="bold",
            )
        )


def _print_signals(console: Any, sigs: Any, indent: str, *, fired_only: bool = False) -> None:
    """The section 06 signals, one line each: ``YES`` with its evidence and the
    seed's direction, or ``no`` (with ``fired_only``: only the fired ones, or
    "none fired")."""
    from rich.text import Text

    if fired_only and not any(sg["fired"] for sg in sigs):
        console.print(f"{indent}none fired")
    for sg in sigs:
        if sg["fired"]:
            ev = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sg["evidence"].items()
            )
            console.print(Text(f"{indent}YES {sg['signal']}: {ev}", style="bold"))
            console.print(f"{indent}    -> {esc(sg['direction'])}")
        elif not fired_only:
            console.print(f"{indent}no  {sg['signal']}")


def _sweep(args: argparse.Namespace, console: Any, spec: Any, base: Any, slo: Any, table: Any) -> int:
    from ..sim import cheapest, sweep

    tps = _tps(args.tps)
    if table is not None and len(tps) > 1:
        raise UsageError(
            "--latency-table",
            args.latency_table,
            f"one TP size with --sweep --latency-table (the "
            f"table gives one TP's step times; --tps {args.tps} compares {len(tps)}): --tps N, or "
            f"the roofline to compare TP sizes",
        )
    if not (args.sweep_span > 0 and args.sweep_span < 1e9):
        raise UsageError("--sweep-span", args.sweep_span, "a number of seconds > 0")
    arms = ("colocated", "chunked", "pd") if args.arm == "all" else (args.arm,)
    if args.at_rate is not None:
        if not (args.at_rate > 0 and args.at_rate < 1e9):
            raise UsageError("--at-rate", args.at_rate, "a rate in requests/s > 0")
        if args.plot:
            raise UsageError(
                "--plot",
                args.plot,
                "no --plot with --sweep --at-rate (it draws nothing; plots come "
                "with a single run or --sweep --budget)",
            )
        budget, tried = cheapest(
            spec,
            base,
            args.at_rate,
            slo,
            max_devices=args.max_devices,
            tps=tps,
            target=args.target,
            n=args.sweep_requests,
            seed=args.seed,
            arms=arms,
            span=args.sweep_span,
            table=table,
        )
        data = {
            "mode": "cheapest",
            "rate": args.at_rate,
            "budget": budget,
            "configs": [
                {
                    "label": c.label(),
                    "devices": c.used_devices,
                    "attainment": p.attainment,
                    "goodput": p.goodput,
                }
                for c, p in tried
            ],
        }
        if args.json:
            print_json(data)
        else:
            from rich.table import Table

            if not budget:
                console.print(
                    f"No configuration up to {args.max_devices} devices meets {args.target:g} attainment "
                    f"of {esc(str(slo))} at {args.at_rate:g} rps."
                )
            else:
                console.print(
                    f"Cheapest budget meeting {args.target:g} attainment of {esc(str(slo))} ms at "
                    f"{args.at_rate:g} rps: {budget} device(s)."
                )
                t = Table(title=f"Configurations on {budget} device(s)", title_justify="left")
                for col in ("configuration", "attainment", "goodput"):
                    t.add_column(col)
                for c, p in tried:
                    t.add_row(esc(c.label()), f"{p.attainment:.3f}", f"{p.goodput:.2f}")
                console.print(t)
        return EXIT_OK
    budget = args.budget or 4
    if args.plot:
        _plot_dir(args.plot, create=True)
    rows = sweep(
        spec,
        base,
        budget,
        slo,
        tps=tps,
        target=args.target,
        n=args.sweep_requests,
        seed=args.seed,
        arms=arms,
        span=args.sweep_span,
        table=table,
    )
    if not rows:
        from ..sim import splits

        if not splits(budget, base, tps, arms=arms):
            raise UsageError(
                "--budget",
                budget,
                f"a budget with a configuration of --arm {args.arm} at --tps "
                f"{args.tps} (PD takes at least one P and one D instance, a colocated instance TP "
                f"devices)",
            )
        raise UsageError(
            "--budget",
            budget,
            f"a budget with a configuration whose instances fit {args.model} on "
            f"{args.device} at --tps {args.tps} (larger TP sizes hold larger weights)",
        )
    plots = _sweep_plots(args.plot, rows) if args.plot else []
    if args.json:
        print_json(
            {
                "mode": "budget",
                "budget": budget,
                "slo_ms": slo.to_ms(),
                "target": args.target,
                "rows": [r.to_dict() for r in rows],
                "plots": plots,
            }
        )
        return EXIT_OK
    from rich.table import Table
    from rich.text import Text

    steps = f", step times from {args.latency_table}" if table is not None else ""
    console.print(
        Text(
            f"P:D picker — {budget} device(s), {args.model} on {args.device}{steps}, SLO {slo} ms at "
            f"{args.target:g} attainment ({args.sweep_requests} requests per probe)",
            style="bold",
        )
    )
    t = Table(title="Highest rate (req/s) meeting the target, found by binary search", title_justify="left")
    for col in ("configuration", "devices", "copies", "max rate", "per device", "vs colocated"):
        t.add_column(col, justify="left" if col == "configuration" else "right")
    colo = next((r for r in rows if r.config.arm == "colocated"), None)
    for r in rows:
        rel = r.per_device / colo.per_device if colo is not None and colo.per_device else None
        t.add_row(
            esc(r.config.label()),
            str(r.devices),
            str(r.config.weight_copies),
            f"{r.max_rate:.2f}",
            f"{r.per_device:.3f}",
            f"{rel:.2f}×" if rel else "—",
        )
    console.print(t)
    if rows:
        console.print(
            Text(f"Pick: {rows[0].config.label()} ({rows[0].per_device:.3f} rps per device)", style="bold")
        )
    pd_rows = [r for r in rows if r.config.arm == "pd"]
    if pd_rows:
        console.print(Text("Section 06 signals (PD) at each configuration's max rate:", style="bold"))
    for r in pd_rows:
        console.print(f"  {esc(r.config.label())} at {r.max_rate:.2f} rps:")
        if r.signals:
            _print_signals(console, r.signals, "    ", fired_only=True)
        else:
            console.print("    no rate met the target: no run to read")
    for path in plots:
        console.print(f"  plot: {esc(path)}")
    return EXIT_OK


def _plot_dir(directory: str, *, create: bool = False) -> str:
    """Check ``directory`` for --plot: a directory, or a path where one can be
    made; with ``create`` make it (with its parents)."""
    import os

    if not directory or "\0" in directory:
        raise UsageError("--plot", directory, "a directory path")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError("--plot", directory, "a directory (this path is a file)")
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise UsageError("--plot", directory, f"a directory that can be made ({exc.strerror})") from None
    return directory


def _plots(directory: str, runs: list[dict[str, Any]], slo: Any) -> list[str]:
    """CDFs of TTFT and ITL per arm; per arm, pool occupancy and the timeline of the two completed requests
    that arrived first (the seed's two-request timeline)."""
    import os

    from .. import sim

    written = [
        sim.plot_cdfs({r["label"]: r["_metrics"] for r in runs}, os.path.join(directory, "cdf.png"), slo=slo)
    ]
    for r in runs:
        samples = r["_result"].samples
        if samples:
            written.append(sim.plot_occupancy(samples, os.path.join(directory, f"occupancy-{r['arm']}.png")))
        recs = r["_first"]  # the two earliest arrivals among the completed requests
        if len(recs) == 2:
            written.append(
                sim.plot_timeline(
                    recs,
                    os.path.join(directory, f"timeline-{r['arm']}.png"),
                    title=f"first two requests, {r['label']}",
                )
            )
    return [str(w) for w in written]


def _sweep_plots(directory: str, rows: list[Any]) -> list[str]:
    import os

    from .. import sim

    pts = [(r.config.label(), r.per_device) for r in rows if r.config.arm == "pd"]
    refs = []
    for arm in ("colocated", "chunked"):  # the best of each (rows come best first)
        best = next((r for r in rows if r.config.arm == arm), None)
        if best is not None:
            refs.append((best.config.label(), best.per_device))
    out = []
    if pts:
        out.append(
            sim.plot_goodput_vs_ratio(pts, os.path.join(directory, "goodput-vs-ratio.png"), baselines=refs)
        )
    good = {
        r.config.label(): [(p.rate, p.goodput / r.devices) for p in sorted(r.probes, key=lambda p: p.rate)]
        for r in rows
    }
    out.append(
        sim.plot_goodput_vs_rate(
            good,
            os.path.join(directory, "goodput-vs-rate.png"),
            best={r.config.label(): r.max_rate for r in rows},
        )
    )
    return [str(w) for w in out]
