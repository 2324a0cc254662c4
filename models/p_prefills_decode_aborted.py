"""P's waiting queue ignores a decode-side abort and still prefills the aborted request.
Caveat: the prefill is inferred: the report shows the aborted request left in
P's waiting queue holding a metadata slot, not that it was prefilled;
resurrection catches that inferred prefill.

Project SGLang, https://github.com/sgl-project/sglang/pull/28236 (a sister
of sgl-project/sglang#9817).  Mechanism: when D aborts a request it sends
ABORT to P, which marks the room's sender Failed; P dropped such requests
from its bootstrap and inflight queues but not from its waiting queue, so a
bootstrapped request aborted by D stayed there holding a metadata buffer
slot and sender state (orphans accumulate under load), and, nothing having
removed it, could be scheduled for a prefill nobody would read (inferred).
In the model D has reserved its blocks, the client cancels, and P has not started the prefill; the reference's
``prefill_start`` takes only live generations, and this mutant's also takes
a cancelled one.
Family: push (SGLang: D pre-allocates, P writes).  Caught as
``resurrection``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

EXPECTED = "resurrection"
PROJECT = "sglang"
LINKS = ("https://github.com/sgl-project/sglang/pull/28236",)
FAMILY = "push"
FAULTS = ("cancel",)
CAVEAT = (
    "The prefill is inferred: the report shows the aborted request left in P's waiting queue holding a "
    "metadata slot, not that it was prefilled; resurrection catches that inferred prefill."
)
PHASE = "reserved"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


class PPrefillsDecodeAborted(HandoffModel):
    name = "p_prefills_decode_aborted"
    # BUG: the waiting queue does not look at the abort (the sender's Failed state)
    rules = REFERENCE.replace("prefill_start", ends=(End.LIVE, End.CANCELLED))


def build(config: ModelConfig) -> HandoffModel:
    return PPrefillsDecodeAborted(config)
