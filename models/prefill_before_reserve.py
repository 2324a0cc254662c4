"""Push mode prefills before D capacity is reserved.

Violates the seed's reserve-first rule (section 07: "Reserve D-side capacity
first, so that P never finishes a prefill with nowhere to hand it to"): P
starts prefill as soon as the request is queued.  Caught as
``reserve-before-prefill``.
Family: push.  https://github.com/sgl-project/sglang/issues/6351
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, Phase

EXPECTED = "reserve-before-prefill"
PROJECT = "sglang"
LINKS = ("https://github.com/sgl-project/sglang/issues/6351",)
FAMILY = "push"
FAULTS = ()
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)


class PrefillBeforeReserve(HandoffModel):
    name = "prefill_before_reserve"
    rules = REFERENCE.replace(
        "prefill_start", phases=(Phase.QUEUED, Phase.RESERVED)
    )  # BUG: no reservation needed


def build(config: ModelConfig) -> HandoffModel:
    return PrefillBeforeReserve(config)
