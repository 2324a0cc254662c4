"""Push mode prefills before D capacity is reserved.

Violates the seed's reserve-first rule (section 07: "Reserve D-side capacity
first, so that P never finishes a prefill with nowhere to hand it to"): P
starts prefill as soon as the request is queued.  Caught as
``reserve-before-prefill``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "reserve-before-prefill"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1)


class PrefillBeforeReserve(HandoffModel):
    name = "prefill_before_reserve"

    def _can_prefill_start(self, s, q):
        # BUG: no reservation needed
        return q.ph in ("Q", "R") and len(self.free_blocks(s, q.p)) >= self.nsrc


def build(config: ModelConfig) -> HandoffModel:
    return PrefillBeforeReserve(config)
