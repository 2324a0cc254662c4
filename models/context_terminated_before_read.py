"""P terminates a finished context request, freeing its blocks, before the handed-off KV was read.

Project TensorRT-LLM, https://github.com/NVIDIA/TensorRT-LLM/pull/13114 (the
same branch removed in https://github.com/NVIDIA/TensorRT-LLM/pull/12909).
Mechanism: with ``enable_partial_reuse_for_disagg`` the executor's
``force_terminate_for_partial_reuse`` branch terminated every finished
context request, including those in ``DISAGG_CONTEXT_TRANS_IN_PROGRESS``
whose KV the generation side had yet to receive; their blocks went back to
the pool under the transceiver's pending send (dangling pointers in
``mSenderFutures``, heap corruption, transfer errors).  In the model the
context request is P's prefill and the generation side reads after P's
ready (prefill first, then D reserves: the pull family); the reference keeps
P's source until D's release, and this mutant's ``prefill_done`` frees it
right after handing the request off (the block ids it handed off still
name them), so D's read touches blocks P no longer holds.
Family: pull.  Caught as ``foreign-block-access``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import Free

EXPECTED = "foreign-block-access"
PROJECT = "tensorrt-llm"
LINKS = (
    "https://github.com/NVIDIA/TensorRT-LLM/pull/13114",
    "https://github.com/NVIDIA/TensorRT-LLM/pull/12909",
)
FAMILY = "pull"
FAULTS = ()
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1)


def hand_off_and_terminate(m, s, r, q, ev):
    # BUG: the finished context request is terminated while its handoff is in progress; the
    # handed-off parameters (the record's source blocks) still name the freed blocks
    s = REFERENCE[m.policy].prefill_done.effect(m, s, r, q, ev)
    ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
    return s


class ContextTerminatedBeforeRead(HandoffModel):
    name = "context_terminated_before_read"
    rules = REFERENCE.replace("prefill_done", effect=hand_off_and_terminate)


def build(config: ModelConfig) -> HandoffModel:
    return ContextTerminatedBeforeRead(config)
