"""After P's request is retried under a new id, D reserves under the first attempt's id.

Reproduces NVIDIA/TensorRT-LLM#15309: the disaggregated orchestrator's HTTP
client regenerated ``disagg_request_id`` when it retried a context request
after a transient disconnect, so the context (prefill) server enqueued the KV
under the retry's id, but the orchestrator built the generation (decode)
request with the original id; the generation server waited on the old
receive id and the request hit the KV-transfer watchdog timeout.  The fix
carries the context response's id forward.  The reference's retry gives
every attempt a fresh ticket and D reserves under the ticket of the
generation it reads; this mutant's D reserves under the ticket of the
request's first attempt, so the read runs under a ticket D never reserved.
Family: pull (the context phase runs first, the generation side then
fetches the KV).  Caught as ``ticket-mismatch``.
"""

import attrs

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import Reserve

PROJECT = "tensorrt-llm"
LINKS = ("https://github.com/NVIDIA/TensorRT-LLM/pull/15309",)
FAMILY = "pull"
FAULTS = ("timeout", "retry")
EXPECTED = "ticket-mismatch"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"timeout": 1, "retry": 1})

_recv_ready = REFERENCE["pull"].recv_ready.effect


def reserve_under_original_id(m, s, msg, q, ev):
    first = len(ev)
    s = _recv_ready(m, s, msg, q, ev)
    # BUG: D's request carries the id of the first attempt, not the retried one's
    ev[first:] = [attrs.evolve(e, ticket=m.tk(msg.r, 0)) if type(e) is Reserve else e for e in ev[first:]]
    return s


class DecodeWaitsOnFirstAttemptId(HandoffModel):
    name = "decode_waits_on_first_attempt_id"
    rules = REFERENCE.replace("recv_ready", effect=reserve_under_original_id)


def build(config: ModelConfig) -> HandoffModel:
    return DecodeWaitsOnFirstAttemptId(config)
