"""D holds its target blocks on abort until a transfer completion that never comes.

Reproduces vllm-project/vllm#46283: an aborted request's reserved KV blocks
on the decode side are released only by the transfer-completion callback; a
request aborted before its transfer started (or whose transfer failed) never
gets one, so the blocks leak.  Caught at a quiet state as ``leak``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1, faults={"cancel": 1})


class DHoldsTargetOnAbort(HandoffModel):
    name = "d_holds_target_on_abort"

    def _can_d_free(self, s, r, q, xi):
        # BUG: only a successful completion (or a commit) releases the target
        return xi < 0 and (q.xs == 2 or q.ph == "C")


def build(config: ModelConfig) -> HandoffModel:
    return DHoldsTargetOnAbort(config)
