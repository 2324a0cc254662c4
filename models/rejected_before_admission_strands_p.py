"""A request that D rejects before admitting it never tells P, whose blocks are stranded.
Caveat: leak only because the model has no P-side lease on an ended
generation's blocks: vLLM's P frees them after its 480 s abort timeout
(VLLM_NIXL_ABORT_REQUEST_TIMEOUT).

Project vLLM, https://github.com/vllm-project/vllm/pull/41269.  Mechanism: D
can refuse a handed-off request before its engine admits it (request
validation or template errors, an errored engine, a missing
``previous_response_id``); no read is ever scheduled, so the notification
that frees P's blocks is never sent and P holds them until its abort timeout
(480 s); the fix routes such rejections to the connector so that P is
notified.  In the model the request ends (a cancel; the model has no
separate rejection) while it is prefilled and D has not admitted it; the
reference's cleanup reaches P, which frees its source, and this mutant's
``free_source`` skips a generation that ended before D admitted it.
Family: pull.  Caught as ``leak``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

EXPECTED = "leak"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/pull/41269",)
FAMILY = "pull"
FAULTS = ("cancel",)
CAVEAT = (
    "Leak only because the model has no P-side lease on an ended generation's blocks: vLLM's P frees them "
    "after its 480 s abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."
)
PHASE = "prefilled"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})


def p_notified(m, s, r, q, xi):
    # BUG: a request refused before D admitted it has no path to P's connector
    return xi < 0 and not (q.ph is Phase.PREFILLED and q.end is not End.LIVE)


class RejectedBeforeAdmissionStrandsP(HandoffModel):
    name = "rejected_before_admission_strands_p"
    rules = REFERENCE.replace("free_source", guard=p_notified)


def build(config: ModelConfig) -> HandoffModel:
    return RejectedBeforeAdmissionStrandsP(config)
