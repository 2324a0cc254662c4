"""A client cancel during prefill never reaches the prefill worker, which keeps the request's blocks.
Caveat: leak only because the model has no P-side lease on an ended
generation's blocks: the engines bound the real hold (vLLM's prefill worker
frees them after its 480 s abort timeout, VLLM_NIXL_ABORT_REQUEST_TIMEOUT).

Reproduces ai-dynamo/dynamo#13691 (analysis and fix in ai-dynamo/dynamo#14507):
Dynamo's prefill router built the remote-prefill request with
``Context::with_id_and_metadata``, which shares no cancellation state with
the client's context, so a client that disconnected before the first token
never stopped the remote prefill: the frontend saw every disconnect but no
abort reached the engine, and the prefill worker kept the request's KV for
a decode that would never collect it (measured on vLLM, SGLang and
TensorRT-LLM backends).  The reference's cancellation token reaches every
worker, and P frees the source of a cancelled generation that no transfer
reads; this mutant's P never hears a cancel that arrives while it is
prefilling (the model has no P lease for an ended generation, so the hold is
for good).  Family: pull (vLLM behind Dynamo: P prefills first, D reads).
Caught at a quiet state as ``leak``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

PROJECT = "dynamo"
LINKS = ("https://github.com/ai-dynamo/dynamo/issues/13691", "https://github.com/ai-dynamo/dynamo/pull/14507")
FAMILY = "pull"
FAULTS = ("cancel",)
CAVEAT = (
    "Leak only because the model has no P-side lease on an ended generation's blocks: the engines bound "
    "the real hold (vLLM's prefill worker frees them after its 480 s abort timeout, "
    "VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."
)
PHASE = "prefilling"
EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})


def p_frees_source(m, s, r, q, xi):
    # BUG: the remote prefill shares no cancellation state with the client's request
    return xi < 0 and not (q.end is End.CANCELLED and q.ph is Phase.PREFILLING)


class CancelNotPropagatedToPrefill(HandoffModel):
    name = "cancel_not_propagated_to_prefill"
    rules = REFERENCE.replace("free_source", guard=p_frees_source)


def build(config: ModelConfig) -> HandoffModel:
    return CancelNotPropagatedToPrefill(config)
