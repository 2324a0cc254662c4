"""After a restart, D reuses blocks that a write of the old incarnation can still land on.

Reproduces ai-dynamo/nixl#2027: a restarted decode worker re-registers and
hands out its KV memory while a transfer addressed to the old incarnation is
still in flight, so the stale write lands in blocks now owned by another
request.  The reference quarantines such blocks until the transfer ends.
Caught as ``early-target-reuse``.
Family: push.  https://github.com/ai-dynamo/nixl/issues/2027
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "early-target-reuse"
PROJECT = "nixl"
LINKS = ("https://github.com/ai-dynamo/nixl/issues/2027",)
FAMILY = "push"
FAULTS = ("restart",)
DEFAULT_CONFIG = ModelConfig(policy="push", requests=2, blocks=1, faults={"restart": 1})


def fenced(m, s, x):
    return False  # BUG: no fencing of the old incarnation's writes


class RestartWithoutFencing(HandoffModel):
    name = "restart_without_fencing"
    # The blocks a stale write can still land on look free to this model but
    # not to the monitor, so free blocks are not interchangeable: no block
    # renaming (requests and workers are still symmetric).
    SYMMETRIC_BLOCKS = False
    rules = REFERENCE.replace("fence", guard=fenced)


def build(config: ModelConfig) -> HandoffModel:
    return RestartWithoutFencing(config)
