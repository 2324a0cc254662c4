"""A cancel while the request waits in D's queue never tells P, whose blocks are stranded.

Reproduces vllm-project/vllm#19223: in pull mode, a request aborted while it
waits in the decode side's queue for KV is dropped there without telling the
prefill side, which keeps the request's KV blocks forever.  Caught at a quiet
state as ``leak``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(mode="pull", requests=2, blocks=1, faults={"cancel": 1})


class CancelQueuedAtDStrandsP(HandoffModel):
    name = "cancel_queued_at_d_strands_p"

    def _can_p_free(self, s, r, q, xi):
        # BUG: a generation cancelled in D's queue never reaches P
        return xi < 0 and not (q.ph == "W" and q.end == "c")


def build(config: ModelConfig) -> HandoffModel:
    return CancelQueuedAtDStrandsP(config)
