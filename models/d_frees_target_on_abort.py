"""D frees its target blocks on abort while the transfer can still write them.

Reproduces sgl-project/sglang#35049 and vllm-project/vllm#32255: on a
cancel or timeout the decode side returns the reserved KV blocks to its pool
at once, while P's RDMA write into them is still in flight; the blocks can
be handed to another request and then overwritten.  The reference aborts the
transfer and frees the target only once the data plane says it ended.
Caught as ``early-target-reuse``.
Family: push.  https://github.com/sgl-project/sglang/issues/35049
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "early-target-reuse"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/issues/35049",
    "https://github.com/vllm-project/vllm/issues/32255",
)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


def d_frees_target(m, s, r, q, xi):
    return True  # BUG: does not wait for the write in flight


class DFreesTargetOnAbort(HandoffModel):
    name = "d_frees_target_on_abort"
    rules = REFERENCE.replace("free_target", guard=d_frees_target)


def build(config: ModelConfig) -> HandoffModel:
    return DFreesTargetOnAbort(config)
