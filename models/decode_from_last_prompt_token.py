"""D feeds the last prompt token at position prompt_len - 1 instead of the first token.

Reproduces vllm-project/vllm#50558: the decode side re-feeds the last prompt
token at position prompt_len - 1 (duplicating it in the KV) instead of
feeding the first token sampled by P at position prompt_len.  Caught as
``first-token-boundary``.
Family: push.  https://github.com/vllm-project/vllm/issues/50558
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "first-token-boundary"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/50558",)
FAMILY = "push"
FAULTS = ()
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)


LAST_PROMPT_TOKEN = 7


def decode(m, s, r, q, ev):
    # BUG: off by one at the boundary: step 0 re-feeds the last prompt token at prompt_len - 1
    token = m.first_token(r, q.gen) + q.ndec if q.ndec else LAST_PROMPT_TOKEN
    return m.decode_at(s, r, q, ev, m.prompt_len - 1 + q.ndec, token)


class DecodeFromLastPromptToken(HandoffModel):
    name = "decode_from_last_prompt_token"
    rules = REFERENCE.replace("decode", effect=decode)


def build(config: ModelConfig) -> HandoffModel:
    return DecodeFromLastPromptToken(config)
