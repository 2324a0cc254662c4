"""An abort after the handoff is ignored and D holds the blocks for good.

Reproduces vllm-project/vllm#29906: once the KV handoff completed, an abort of
the request no longer reaches the decode side's block manager, so the
request's KV blocks are never freed.  Caught at a quiet state as ``leak``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1, faults={"cancel": 1})


class AbortIgnoredAfterHandoff(HandoffModel):
    name = "abort_ignored_after_handoff"

    def _can_d_free(self, s, r, q, xi):
        # BUG: a cancel of a committed generation is dropped
        return xi < 0 and not (q.ph == "C" and q.end == "c")


def build(config: ModelConfig) -> HandoffModel:
    return AbortIgnoredAfterHandoff(config)
