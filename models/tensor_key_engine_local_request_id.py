"""P sends the KV under a key built from its engine-local request id, which D never reserved.

Reproduces vllm-project/vllm#42839 (P2pNcclConnector; fixes in
vllm-project/vllm#42931 and related PRs): after vLLM appended a random
per-engine suffix to request ids, P keyed the tensors it sends by its own
id (``<id>-AAAA#layer``) while D waited on the key built from its own id
(``<id>-BBBB#layer``), so D waited forever (PUT) or missed the KV (GET).
The reference names the whole handoff by the one ticket D reserved, which
the request carries to P; in this mutant P derives the name of the transfer
it starts on its own, so the write goes under a ticket that was never
reserved.  Family: push (P writes into D).  Caught as ``ticket-mismatch``.
"""

import attrs

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import TransferStart

PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/42839",)
FAMILY = "push"
FAULTS = ()
EXPECTED = "ticket-mismatch"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)


def prefill_done_engine_local_key(m, s, r, q, ev):
    first = len(ev)
    s = REFERENCE[m.policy].prefill_done.effect(m, s, r, q, ev)  # pull: P starts no transfer here
    # BUG: P names the transfer after its own engine-local request id, not D's ticket
    ev[first:] = [
        attrs.evolve(e, ticket=f"{e.ticket}-{m.wname[q.p]}") if type(e) is TransferStart else e
        for e in ev[first:]
    ]
    return s


class TensorKeyEngineLocalRequestId(HandoffModel):
    name = "tensor_key_engine_local_request_id"
    rules = REFERENCE.replace("prefill_done", effect=prefill_done_engine_local_key)


def build(config: ModelConfig) -> HandoffModel:
    return TensorKeyEngineLocalRequestId(config)
