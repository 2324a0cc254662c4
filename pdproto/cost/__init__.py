"""The cost model of one KV handoff (``pdproto cost``): KV size, transfer time,
colocated vs disaggregated timelines, break-even wait, and their plots."""

from ._model import DTYPE_BYTES as DTYPE_BYTES
from ._model import GIB as GIB
from ._model import MIB as MIB
from ._model import PRESETS as PRESETS
from ._model import CostModel as CostModel
from ._model import CostReport as CostReport
from ._model import KVShape as KVShape
from ._model import Link as Link
from ._model import Span as Span
from ._model import Timeline as Timeline
from ._model import Timing as Timing
from ._model import estimate as estimate
from ._model import format_bytes as format_bytes
from ._plot import timeline_svg as timeline_svg
from ._plot import write_plot as write_plot

__all__ = [
    "DTYPE_BYTES",
    "GIB",
    "MIB",
    "PRESETS",
    "CostModel",
    "CostReport",
    "KVShape",
    "Link",
    "Span",
    "Timeline",
    "Timing",
    "estimate",
    "format_bytes",
    "timeline_svg",
    "write_plot",
]
