"""The discrete-event simulator (``pdproto simulate``, docs/simulate.md):
colocated continuous batching, chunked prefill and PD disaggregation at the
same device budget, with every PD handoff emitted as history events and
judged by the monitor.  Imports only pdproto's errors, version, spec and
cost (matplotlib lazily, for the plots)."""

from ._engine import ARMS as ARMS
from ._engine import SimConfig as SimConfig
from ._engine import SimResult as SimResult
from ._engine import SimulationCheckError as SimulationCheckError
from ._engine import latency_for as latency_for
from ._engine import simulate as simulate
from ._latency import DEVICES as DEVICES
from ._latency import MODELS as MODELS
from ._latency import DeviceSpec as DeviceSpec
from ._latency import ModelSpec as ModelSpec
from ._latency import PiecewiseLinear as PiecewiseLinear
from ._latency import Roofline as Roofline
from ._metrics import SLO as SLO
from ._metrics import Gauge as Gauge
from ._metrics import Metrics as Metrics
from ._metrics import RequestRecord as RequestRecord
from ._metrics import percentile as percentile
from ._metrics import stats as stats
from ._plot import plot_cdfs as plot_cdfs
from ._plot import plot_goodput_vs_rate as plot_goodput_vs_rate
from ._plot import plot_goodput_vs_ratio as plot_goodput_vs_ratio
from ._plot import plot_occupancy as plot_occupancy
from ._plot import plot_timeline as plot_timeline
from ._sweep import SIGNALS as SIGNALS
from ._sweep import SweepRow as SweepRow
from ._sweep import cheapest as cheapest
from ._sweep import expected_span as expected_span
from ._sweep import fit_error as fit_error
from ._sweep import max_rate as max_rate
from ._sweep import signals as signals
from ._sweep import splits as splits
from ._sweep import sweep as sweep
from ._workload import Arrival as Arrival
from ._workload import Cancellation as Cancellation
from ._workload import Lengths as Lengths
from ._workload import SimRequest as SimRequest
from ._workload import TraceFormatError as TraceFormatError
from ._workload import WorkloadSpec as WorkloadSpec
from ._workload import load_trace as load_trace
from ._workload import make_workload as make_workload
from ._workload import write_jsonl as write_jsonl

__all__ = [
    "Gauge",
    "percentile",
    "stats",
    "plot_cdfs",
    "plot_goodput_vs_rate",
    "plot_goodput_vs_ratio",
    "plot_occupancy",
    "plot_timeline",
    "expected_span",
    "fit_error",
    "splits",
    "write_jsonl",
    "DEVICES",
    "MODELS",
    "DeviceSpec",
    "ModelSpec",
    "PiecewiseLinear",
    "Roofline",
    "Arrival",
    "Cancellation",
    "Lengths",
    "SimRequest",
    "TraceFormatError",
    "WorkloadSpec",
    "load_trace",
    "make_workload",
    "SLO",
    "Metrics",
    "RequestRecord",
    "ARMS",
    "SimConfig",
    "SimResult",
    "SimulationCheckError",
    "latency_for",
    "simulate",
    "SIGNALS",
    "SweepRow",
    "cheapest",
    "max_rate",
    "signals",
    "sweep",
]
