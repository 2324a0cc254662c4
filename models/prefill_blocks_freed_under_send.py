"""P returns its prefill blocks to the allocator when prefill completes, while the send from them runs.

Project Dynamo, https://github.com/ai-dynamo/dynamo/issues/826.  Mechanism:
Dynamo's disaggregated vLLM path gave prefill blocks back to the allocator
once the prefill completed and held only the staging blocks until the
transfer to the decode worker finished; on the MLA path, which skips the
staging copy, the transfer is issued straight from the prefill blocks, so
they can be reallocated and overwritten before the transfer has read them.
In the model P writes into D's reserved blocks (the push family); the
reference frees P's source when the write has completed, and this mutant's
``prefill_done`` frees it as soon as the write is started.
Family: push.  Caught as ``early-source-free``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "early-source-free"
PROJECT = "dynamo"
LINKS = ("https://github.com/ai-dynamo/dynamo/issues/826",)
FAMILY = "push"
FAULTS = ()
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)


def send_from_returned_blocks(m, s, r, q, ev):
    s = REFERENCE[m.policy].prefill_done.effect(
        m, s, r, q, ev
    )  # push: starts the write from the prefill blocks
    if m.xfer_of(s, r) < 0:
        return s  # pull: no send runs from the prefill blocks yet (D reads them later)
    # BUG: prefill blocks go back to the allocator at prefill completion, with no staging copy
    return m.set_req(s, r, m.table.free_source.effect(m, s, r, s.reqs[r], ev))


class PrefillBlocksFreedUnderSend(HandoffModel):
    name = "prefill_blocks_freed_under_send"
    rules = REFERENCE.replace("prefill_done", effect=send_from_returned_blocks)


def build(config: ModelConfig) -> HandoffModel:
    return PrefillBlocksFreedUnderSend(config)
