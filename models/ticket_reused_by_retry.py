"""A retry reuses the ticket and transfer id of the failed attempt.

Reproduces vllm-project/vllm#49796: transfer ids derived from the request id
alone are reused when the request is retried, so completions and
reservations of two attempts become indistinguishable.  The reference makes
every ticket and transfer id unique per generation.  Caught as ``id-reuse``.
Family: push.  https://github.com/vllm-project/vllm/issues/49796
"""

from pdproto.protocol import HandoffModel, ModelConfig

EXPECTED = "id-reuse"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/49796",)
FAMILY = "push"
FAULTS = ("timeout", "retry")
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"timeout": 1, "retry": 1})


class TicketReusedByRetry(HandoffModel):
    """Breaks the ``retry`` rule's "fresh ticket and transfer ids": the ids a
    generation's rules use are named after the request alone."""

    name = "ticket_reused_by_retry"

    def ticket(self, r, gen):
        return f"t:{self.rname[r]}"  # BUG: no generation

    def transfer_id(self, r, gen):
        return f"x:{self.rname[r]}"  # BUG: no generation


def build(config: ModelConfig) -> HandoffModel:
    return TicketReusedByRetry(config)
