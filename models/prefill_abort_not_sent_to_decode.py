"""A request aborted on P while it prefills is never reported to D, which keeps its reserved slots.
Caveat: leak only because the model has no D-side waiting timeout: SGLang's D
frees the slots after 300 s (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).

Reproduces sgl-project/sglang#28651 (production outage with the Mooncake
transfer backend): ``MooncakeKVSender.abort()`` never notified the decode
peer, so when the prefill side aborted a request (an abort storm after
gateway TTFT timeouts) the paired decode request kept its pre-allocated KV
slots and waited the full 300 s ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``;
the fix notifies decode at once.  The reference's cancellation token reaches
every worker, so D frees its target of a cancelled generation that no
transfer writes.  This mutant's D never hears of a cancel that hit the
request while P was prefilling it (the model has no D waiting timeout for
an ended generation, so the hold is for good).  Family: push (D reserves
first).  Caught at a quiet state as ``leak``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

PROJECT = "sglang"
LINKS = ("https://github.com/sgl-project/sglang/pull/28651",)
FAMILY = "push"
FAULTS = ("cancel",)
CAVEAT = (
    "Leak only because the model has no D-side waiting timeout: SGLang's D frees the slots after 300 s "
    "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)."
)
PHASE = "prefilling"
EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


def d_frees_target(m, s, r, q, xi):
    # BUG: P's abort of a request it is prefilling is not sent to D
    return xi < 0 and not (q.end is End.CANCELLED and q.ph is Phase.PREFILLING)


class PrefillAbortNotSentToDecode(HandoffModel):
    name = "prefill_abort_not_sent_to_decode"
    rules = REFERENCE.replace("free_target", guard=d_frees_target)


def build(config: ModelConfig) -> HandoffModel:
    return PrefillAbortNotSentToDecode(config)
