"""An abort after the handoff is ignored and D holds the blocks for good.

Reproduces vllm-project/vllm#29906: once the KV handoff completed, an abort of
the request no longer reaches the decode side's block manager, so the
request's KV blocks are never freed.  Caught at a quiet state as ``leak``.
Family: push.  https://github.com/vllm-project/vllm/issues/29906
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

EXPECTED = "leak"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/29906",)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "committed"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


def d_frees_target(m, s, r, q, xi):
    # BUG: a cancel of a committed generation never reaches D's block manager
    return xi < 0 and not (q.ph is Phase.COMMITTED and q.end is End.CANCELLED)


class AbortIgnoredAfterHandoff(HandoffModel):
    name = "abort_ignored_after_handoff"
    rules = REFERENCE.replace("free_target", guard=d_frees_target)


def build(config: ModelConfig) -> HandoffModel:
    return AbortIgnoredAfterHandoff(config)
