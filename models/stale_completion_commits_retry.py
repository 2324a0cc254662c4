"""A completion notification of an old generation commits the retry.

Reproduces volcano-sh/kthena#1424 and sgl-project/sglang#17259: the decode
side matches a KV-transfer completion by request id only, so after a timeout
and a retry the late completion of the first attempt commits the new attempt
(whose own KV has not arrived).  The reference drops a message of another
generation.  Caught as ``ticket-mismatch`` (the commit names the old
generation's ticket).
Family: push.  https://github.com/volcano-sh/kthena/issues/1424
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, Phase

EXPECTED = "ticket-mismatch"
PROJECT = "kthena"
LINKS = (
    "https://github.com/volcano-sh/kthena/issues/1424",
    "https://github.com/sgl-project/sglang/issues/17259",
)
FAMILY = "push"
FAULTS = ("timeout", "retry")
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"timeout": 1, "retry": 1})


def notify_for_request(m, s, msg, q):
    # BUG: matched by request only; no generation or transfer check
    awaiting = (Phase.RESERVED, Phase.PREFILLING, Phase.TRANSFERRING)
    return q.end is End.LIVE and q.ph in awaiting and bool(q.dst) and msg.to == q.d


def commit(m, s, msg, q, ev):
    return m.commit(s, msg.r, q, ev, m.ticket(msg.r, msg.gen))  # the ticket the message names


class StaleCompletionCommitsRetry(HandoffModel):
    name = "stale_completion_commits_retry"
    rules = REFERENCE.replace("recv_notify", guard=notify_for_request, effect=commit)


def build(config: ModelConfig) -> HandoffModel:
    return StaleCompletionCommitsRetry(config)
