"""P frees its source blocks when a timer expires while D is still reading them.

Reproduces vllm-project/vllm#21570: in pull mode the prefill side frees the
KV blocks of a finished prefill after a fixed abort timeout even though the
decode side's read is still in flight.  The reference only lets P's source
lease expire after D committed (the read is over); this mutant arms the timer
as soon as the read starts.  Caught as ``early-source-free``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "early-source-free"
DEFAULT_CONFIG = ModelConfig(mode="pull", requests=1, blocks=1, faults={"timeout": 1})


class PFreesSourceOnTimer(HandoffModel):
    name = "p_frees_source_on_timer"

    def _can_p_lease(self, s, r, q):
        # BUG: the timer ignores the read in flight
        return (not self.push) and q.ph in ("X", "C") and bool(q.src)


def build(config: ModelConfig) -> HandoffModel:
    return PFreesSourceOnTimer(config)
