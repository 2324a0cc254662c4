"""A handoff lost between P and D strands P's source blocks: nothing expires them.

Project vLLM, https://github.com/vllm-project/vllm/pull/20139 (the window is
documented in https://github.com/llm-d/llm-d/pull/1138).  Mechanism: after
vllm-project/vllm#19223, P still held a finished prefill's blocks forever when
the request never reached D's scheduler (lost in flight, the proxy or router
failed, or the client disconnected inside the routing proxy), because only
D's read notification frees them and D never learns of the request; the fix
attaches a TTL to every block set awaiting a remote read.  In the model the
handoff is P's ready message, lost; the reference's ``expire`` rule fails a
prefilled generation whose ready is gone (the cleanup frees P's source), and
this mutant's never fires, so the generation waits forever while P holds its
blocks.
Family: pull.  Caught as ``stuck``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "stuck"
PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/pull/20139",
    "https://github.com/llm-d/llm-d/pull/1138",
)
FAMILY = "pull"
FAULTS = ("loss",)
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"loss": 1})


def no_ttl(m, s, r, q):
    return False  # BUG: no expiry for blocks awaiting a read that will never come


class LostHandoffStrandsSource(HandoffModel):
    name = "lost_handoff_strands_source"
    rules = REFERENCE.replace("expire", guard=no_ttl)


def build(config: ModelConfig) -> HandoffModel:
    return LostHandoffStrandsSource(config)
