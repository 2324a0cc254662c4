"""A duplicated completion notification commits twice.

Reproduces vllm-project/vllm#46240: the decode side handles every delivery of
a KV-ready notification, so a duplicate commits (and schedules) the same
request generation a second time.  The reference commits only from the
awaiting phase.  Caught as ``double-commit``.
Family: push.  https://github.com/vllm-project/vllm/issues/46240
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, XferState

EXPECTED = "double-commit"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/46240",)
FAMILY = "push"
FAULTS = ("dup",)
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"dup": 1})


def notify_awaited(m, s, msg, q):
    # BUG: no "already committed" check (the reference commits only while awaiting the KV)
    return (
        q.gen == msg.gen
        and q.end is End.LIVE
        and q.xs is XferState.DONE
        and bool(q.dst)
        and q.dinc == s.inc[q.d]
        and msg.to == q.d
    )


class DuplicateCompletionDoubleCommit(HandoffModel):
    name = "duplicate_completion_double_commit"
    rules = REFERENCE.replace("recv_notify", guard=notify_awaited)


def build(config: ModelConfig) -> HandoffModel:
    return DuplicateCompletionDoubleCommit(config)
