"""A duplicated completion notification commits twice.

Reproduces vllm-project/vllm#46240: the decode side handles every delivery of
a KV-ready notification, so a duplicate commits (and schedules) the same
request generation a second time.  The reference commits only from the
awaiting phase.  Caught as ``double-commit``.
"""

from pdproto.protocol._config import ModelConfig
from pdproto.protocol._reference import HandoffModel

EXPECTED = "double-commit"
DEFAULT_CONFIG = ModelConfig(mode="push", requests=1, blocks=1, faults={"dup": 1})


class DuplicateCompletionDoubleCommit(HandoffModel):
    name = "duplicate_completion_double_commit"

    def _recv_notify(self, s, m, q, ev):
        # BUG: no "already committed" check
        if q.gen == m.gen and q.end == "" and q.xs == 2 and q.dst and q.dinc == s.inc[q.d] and m.to == q.d:
            return self._commit(s, m.r, q, ev, self.ticket(m.r, q.gen))
        return s


def build(config: ModelConfig) -> HandoffModel:
    return DuplicateCompletionDoubleCommit(config)
