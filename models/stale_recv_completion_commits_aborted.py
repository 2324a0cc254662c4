"""D's handler of a finished KV read runs for a request that was aborted while the read was in flight.

Reproduces vllm-project/vllm#43226 (fix attempts vllm-project/vllm#43265 and
vllm-project/vllm#53079): with an async connector (Mooncake) a request aborted
while D's pull is in flight is freed, and the late ``finished_recving`` for it
reaches ``_update_from_kv_xfer_finished``, which assumes the request is still
live (an assert kills the engine core).  The reference's completion handler
(pull: D is the initiator) first checks the generation's end and only cleans
up an ended one; this mutant's handler treats every finished read as the
handoff of a live request, so D commits (and would schedule) a generation the
client already cancelled.  Family: pull.  Caught as ``resurrection`` (a commit
for a terminal generation).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, MsgKind

PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/issues/43226",
    "https://github.com/vllm-project/vllm/pull/53079",
)
FAMILY = "pull"
FAULTS = ("cancel",)
PHASE = "transferring"
EXPECTED = "resurrection"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})


def finished_recving(m, s, x, q, ev):
    # BUG: no "was the request freed meanwhile?" check: the late completion commits
    s = m.commit(s, x.r, q, ev, m.tk(x.r, q.gen))
    return m.send(s, MsgKind.RELEASE, x.r, q.gen, q.d, q.p)


class StaleRecvCompletionCommitsAborted(HandoffModel):
    name = "stale_recv_completion_commits_aborted"
    rules = REFERENCE.replace("on_xfer_done", effect=finished_recving)


def build(config: ModelConfig) -> HandoffModel:
    return StaleRecvCompletionCommitsAborted(config)
