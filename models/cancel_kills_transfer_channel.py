"""A cancel tears down the transport under a KV transfer in flight, whose blocks are then never freed.

Project Dynamo, https://github.com/ai-dynamo/dynamo/pull/7489.  Mechanism: a
client disconnect kills the request's engine context, and the kill
propagates through ``link_child()`` to the prefill child context, which tears
down the RPC transport below the application while the NIXL KV transfer is
running; neither side ever sees the transfer end, so the blocks it held are
never freed and a 1P1D deployment stops serving (the fix routes the cancel
through the protocol instead of killing the channel).  In the model the
reference's ``cleanup`` aborts the transfer and frees each side's blocks
when the data plane reports its end; this mutant's ``cleanup`` drops the
transfer with its channel, so no end is ever reported and nothing is freed.
Family: pull (Dynamo's disaggregated TensorRT-LLM and vLLM paths prefill
first, then the decode worker takes the KV).  Caught as ``leak``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "leak"
PROJECT = "dynamo"
LINKS = ("https://github.com/ai-dynamo/dynamo/pull/7489",)
FAMILY = "pull"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})

_cleanup = REFERENCE["pull"].cleanup.effect


def kill_channel(m, s, r, ev):
    xi = m.xfer_of(s, r)
    if xi < 0:
        return _cleanup(m, s, r, ev)
    # BUG: the kill tears the transport down under the transfer: it vanishes without an end
    # (no abort, no completion, no failure reaches a handler) and its blocks stay held
    return s._replace(xfers=s.xfers[:xi] + s.xfers[xi + 1 :])


class CancelKillsTransferChannel(HandoffModel):
    name = "cancel_kills_transfer_channel"
    rules = REFERENCE.replace("cleanup", effect=kill_channel)


def build(config: ModelConfig) -> HandoffModel:
    return CancelKillsTransferChannel(config)
