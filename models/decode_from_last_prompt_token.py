"""D feeds the last prompt token at position prompt_len - 1 instead of the first token.

Reproduces vllm-project/vllm#50558: the decode side re-feeds the last prompt
token at position prompt_len - 1 (duplicating it in the KV) instead of
feeding the first token sampled by P at position prompt_len.  Caught as
``first-token-boundary``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "first-token-boundary"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1)


class DecodeFromLastPromptToken(HandoffModel):
    name = "decode_from_last_prompt_token"

    LAST_PROMPT_TOKEN = 7

    def _decode_input(self, r, q):
        if q.ndec == 0:
            # BUG: off by one at the boundary
            return self.prompt_len - 1, self.LAST_PROMPT_TOKEN
        return self.prompt_len - 1 + q.ndec, self.first_token(r, q.gen) + q.ndec


def build(config: ModelConfig) -> HandoffModel:
    return DecodeFromLastPromptToken(config)
