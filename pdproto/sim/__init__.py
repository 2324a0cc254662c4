"""The discrete-event simulator (``pdproto simulate``): colocated continuous
batching, chunked prefill and PD disaggregation at the same device budget,
with every PD handoff emitted as history events and judged by the monitor.
Imports only pdproto's errors, version, spec and cost (matplotlib lazily)."""

from ._latency import DEVICES as DEVICES
from ._latency import MODELS as MODELS
from ._latency import DeviceSpec as DeviceSpec
from ._latency import ModelSpec as ModelSpec
from ._latency import PiecewiseLinear as PiecewiseLinear
from ._latency import Roofline as Roofline
from ._engine import ARMS as ARMS
from ._engine import SimConfig as SimConfig
from ._engine import SimResult as SimResult
from ._engine import latency_for as latency_for
from ._engine import simulate as simulate

__all__ = [
    "DEVICES",
    "MODELS",
    "DeviceSpec",
    "ModelSpec",
    "PiecewiseLinear",
    "Roofline",
    "ARMS",
    "SimConfig",
    "SimResult",
    "latency_for",
    "simulate",
]
