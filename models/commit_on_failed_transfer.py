"""A failed transfer is reported as complete, and D commits on it.

Reproduces vllm-project/vllm#52234 and sgl-project/sglang#30233: a transfer
that failed (or finished only partly) is reported to the decode side as done,
which then decodes from KV that never fully arrived.  The reference fails the
generation when the data plane fails the transfer.  Caught as
``commit-before-ready``.
Family: push.  https://github.com/vllm-project/vllm/issues/52234
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, XferState

EXPECTED = "commit-before-ready"
PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/issues/52234",
    "https://github.com/sgl-project/sglang/issues/30233",
)
FAMILY = "push"
FAULTS = ("transfer_fail",)
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"transfer_fail": 1})


def handle_failure(m, s, x, q, ev):
    if q.end is not End.LIVE:
        return REFERENCE["push"].on_xfer_failed.effect(m, s, x, q, ev)
    # BUG: the failure handler is the success handler
    return m.table.on_xfer_done.effect(m, s, x, q._replace(xs=XferState.DONE), ev)


class CommitOnFailedTransfer(HandoffModel):
    name = "commit_on_failed_transfer"
    rules = REFERENCE.replace("on_xfer_failed", effect=handle_failure)


def build(config: ModelConfig) -> HandoffModel:
    return CommitOnFailedTransfer(config)
