"""A completion notification of an old generation commits the retry.

Reproduces volcano-sh/kthena#1424 and sgl-project/sglang#17259: the decode
side matches a KV-transfer completion by request id only, so after a timeout
and a retry the late completion of the first attempt commits the new attempt
(whose own KV has not arrived).  The reference drops a message of another
generation.  Caught as ``ticket-mismatch`` (the commit names the old
generation's ticket).
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "ticket-mismatch"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1, faults={"timeout": 1, "retry": 1})


class StaleCompletionCommitsRetry(HandoffModel):
    name = "stale_completion_commits_retry"

    def _recv_notify(self, s, m, q, ev):
        # BUG: matched by request only; no generation or transfer check
        if q.end == "" and q.ph in ("R", "P", "X") and q.dst and m.to == q.d:
            return self._commit(s, m.r, q, ev, self.ticket(m.r, m.gen))
        return s


def build(config: ModelConfig) -> HandoffModel:
    return StaleCompletionCommitsRetry(config)
