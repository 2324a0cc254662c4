"""The initiator keeps starting chunks of a handoff that was aborted.

Reproduces sgl-project/sglang#27372 (before it, an abort on D did not stop P
from starting the remaining KV chunks of the request; the fix has D send
ABORT so that P stops starting chunks) and the stale-chunk path of
sgl-project/sglang#36707 (a chunk for an already failed room is still
dequeued and handled).  With ``chunks`` the handoff is several transfers
under one ticket, started one after the other; the reference starts the
next chunk only for a live generation whose transfer was not aborted.  This
mutant starts it whenever chunks are left: a cancelled generation's next
chunk starts after the abort.  Caught as ``resurrection``.
Family: push.  https://github.com/sgl-project/sglang/issues/27372
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "resurrection"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/issues/27372",
    "https://github.com/sgl-project/sglang/issues/36707",
)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, chunks=2, faults={"cancel": 1})


def chunks_left(m, s, x, q):
    return x.chunk + 1 < m.chunks  # BUG: ignores the abort and the generation's end


class ChunkSentAfterAbort(HandoffModel):
    name = "chunk_sent_after_abort"
    rules = REFERENCE.replace("next_chunk", guard=chunks_left)


def build(config: ModelConfig) -> HandoffModel:
    return ChunkSentAfterAbort(config)
