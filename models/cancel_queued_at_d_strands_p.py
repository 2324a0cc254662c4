"""A cancel while the request waits in D's queue never tells P, whose blocks are stranded.

Reproduces vllm-project/vllm#19223: in pull mode, a request aborted while it
waits in the decode side's queue for KV is dropped there without telling the
prefill side, which keeps the request's KV blocks forever.  Caught at a quiet
state as ``leak``.
Family: pull.  https://github.com/vllm-project/vllm/issues/19223
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

EXPECTED = "leak"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/19223",)
FAMILY = "pull"
FAULTS = ("cancel",)
PHASE = "waiting"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=2, blocks=1, faults={"cancel": 1})


def p_frees_source(m, s, r, q, xi):
    # BUG: a generation cancelled in D's queue never reaches P
    return xi < 0 and not (q.ph is Phase.WAITING and q.end is End.CANCELLED)


class CancelQueuedAtDStrandsP(HandoffModel):
    name = "cancel_queued_at_d_strands_p"
    rules = REFERENCE.replace("free_source", guard=p_frees_source)


def build(config: ModelConfig) -> HandoffModel:
    return CancelQueuedAtDStrandsP(config)
