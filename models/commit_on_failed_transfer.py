"""A failed transfer is reported as complete, and D commits on it.

Reproduces vllm-project/vllm#52234 and sgl-project/sglang#30233: a transfer
that failed (or finished only partly) is reported to the decode side as done,
which then decodes from KV that never fully arrived.  The reference fails the
generation when the data plane fails the transfer.  Caught as
``commit-before-ready``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "commit-before-ready"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1, faults={"transfer_fail": 1})


class CommitOnFailedTransfer(HandoffModel):
    name = "commit_on_failed_transfer"

    def _on_xfer_failed(self, s, x, q, ev):
        if q.end == "":
            # BUG: the failure handler is the success handler
            return self._on_xfer_done(s, x, q._replace(xs=2), ev)
        return super()._on_xfer_failed(s, x, q, ev)


def build(config: ModelConfig) -> HandoffModel:
    return CommitOnFailedTransfer(config)
