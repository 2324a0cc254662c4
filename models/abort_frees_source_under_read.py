"""An abort of a prefill already handed off frees P's source blocks while D is still reading them.

Project vLLM, https://github.com/vllm-project/vllm/pull/25067 (observed in
llm-d 4P1D, llm-d/llm-d#187).  Mechanism: the client disconnects just as the
prefill finishes and its blocks are held for the remote decode, and the
scheduler's abort path frees the finished-but-held request's blocks at once;
D's NIXL READ of those blocks is still to come or in flight, so it can read
blocks that a new prefill was given (the fix ignores the abort once the
request is handed to the transfer and relies on the expiry).  In the model
the abort is a client cancel while D's read is in flight; the reference's
cleanup has P wait for the read to end before it frees, and this mutant's
``free_source`` does not wait when the generation was cancelled.
Family: pull.  Caught as ``early-source-free``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

EXPECTED = "early-source-free"
PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/pull/25067",
    "https://github.com/llm-d/llm-d/issues/187",
)
FAMILY = "pull"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})


def no_read_or_aborted(m, s, r, q, xi):
    # BUG: an abort frees the held blocks whether or not D's read is over
    return xi < 0 or q.end is End.CANCELLED


class AbortFreesSourceUnderRead(HandoffModel):
    name = "abort_frees_source_under_read"
    rules = REFERENCE.replace("free_source", guard=no_read_or_aborted)


def build(config: ModelConfig) -> HandoffModel:
    return AbortFreesSourceUnderRead(config)
