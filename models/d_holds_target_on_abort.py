"""D holds its target blocks on abort until a transfer completion that never comes.

Reproduces vllm-project/vllm#46283: an aborted request's reserved KV blocks
on the decode side are released only by the transfer-completion callback; a
request aborted before its transfer started (or whose transfer failed) never
gets one, so the blocks leak.  Caught at a quiet state as ``leak``.
Family: push.  https://github.com/vllm-project/vllm/issues/46283
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, Phase, XferState

EXPECTED = "leak"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/46283",)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "reserved"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


def d_frees_target(m, s, r, q, xi):
    # BUG: only a successful completion (or a commit) releases the target
    return xi < 0 and (q.xs is XferState.DONE or q.ph is Phase.COMMITTED)


class DHoldsTargetOnAbort(HandoffModel):
    name = "d_holds_target_on_abort"
    rules = REFERENCE.replace("free_target", guard=d_frees_target)


def build(config: ModelConfig) -> HandoffModel:
    return DHoldsTargetOnAbort(config)
