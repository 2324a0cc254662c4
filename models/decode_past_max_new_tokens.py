"""D decodes max_new_tokens more tokens, ignoring the first token P already produced.

Reproduces sgl-project/sglang#7147 (fixed by sgl-project/sglang#7598): with
PD disaggregation a request with ``max_new_tokens = 1`` returned two
completion tokens, because D ran its own decode budget without counting the
first token, which P sampled and handed over with the KV;
NVIDIA/TensorRT-LLM#16691 fixes the same edge in TensorRT-LLM's disaggregated
first-token handoff.  The reference's D counts P's first token against the
budget (it decodes while ``1 + decoded < max_new_tokens``); this mutant's
guard leaves it out.  Family: push.  Caught as ``decode-continuity`` (a
decode produces token 2 of at most ``max_new_tokens = 1``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/pull/7147",
    "https://github.com/sgl-project/sglang/pull/7598",
    "https://github.com/NVIDIA/TensorRT-LLM/pull/16691",
)
FAMILY = "push"
FAULTS = ()
EXPECTED = "decode-continuity"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, max_new_tokens=1)


def may_decode(m, s, r, q):
    return q.ndec < m.max_new  # BUG: P's first token is not counted


class DecodePastMaxNewTokens(HandoffModel):
    name = "decode_past_max_new_tokens"
    rules = REFERENCE.replace("decode", guard=may_decode)


def build(config: ModelConfig) -> HandoffModel:
    return DecodePastMaxNewTokens(config)
