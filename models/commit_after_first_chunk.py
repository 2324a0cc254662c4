"""The first chunk of a chunked handoff is taken for the last: D commits before the rest landed.

Reproduces the "last chunk" confusion of sgl-project/sglang#22716 (with
pipeline parallelism every stage believes it sends the last chunk and
signals completion) and the requirement sgl-project/sglang-jax#1523 states
for per-chunk transfers ("enqueue Decode only after every child transfer
succeeds", never exposing partial KV).  With ``chunks`` the handoff is
several transfers under one ticket; the reference starts the next chunk
when one lands and runs the completion handler (push: notify; pull: commit)
after the last one only.  This mutant's ``next_chunk`` never fires: the
first chunk's completion is treated as the handoff's, and D commits with
only its positions (or layers) written.  Caught as ``commit-before-ready``.
Family: push.  https://github.com/sgl-project/sglang/issues/22716
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "commit-before-ready"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/issues/22716",
    "https://github.com/sgl-project/sglang-jax/issues/1523",
)
FAMILY = "push"
FAULTS = ()
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, chunks=2)


def never_more_chunks(m, s, x, q):
    return False  # BUG: every chunk is taken for the last one


class CommitAfterFirstChunk(HandoffModel):
    name = "commit_after_first_chunk"
    rules = REFERENCE.replace("next_chunk", guard=never_more_chunks)


def build(config: ModelConfig) -> HandoffModel:
    return CommitAfterFirstChunk(config)
