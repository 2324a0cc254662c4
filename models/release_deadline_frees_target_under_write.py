"""After an abort, D's release deadline frees its pages while P's write can still land on them.

Project SGLang, https://github.com/sgl-project/sglang/pull/38961 (about the
deferred decode-side release of sgl-project/sglang#35049).  Mechanism: on an
abort, D holds the request's KV pages until P acknowledges that its writes
have drained, or until a timeout; P's scheduler clears the room, and with it
the ACK target, while its transfer worker is still writing, so no ACK is
ever sent, D waits out the timeout and releases the pages anyway: the
fallback is the common path, and a use-after-free window whenever the write
is slower than the timeout.  In the model the reference frees D's target
only when the aborted transfer has ended, with no deadline; this mutant's
``timeout`` also fires for a cancelled generation whose write is still in
flight, and releases D's target.
Family: push.  Caught as ``early-target-reuse``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

EXPECTED = "early-target-reuse"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/pull/38961",
    "https://github.com/sgl-project/sglang/pull/35049",
)
FAMILY = "push"
FAULTS = ("cancel", "timeout")
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1, "timeout": 1})

_timeout = REFERENCE["push"].timeout.effect


def live_or_release_pending(m, s, r, q):
    return q.end is End.LIVE or (bool(q.dst) and m.xfer_of(s, r) >= 0)


def deadline(m, s, r, q, ev):
    if q.end is End.LIVE:
        return _timeout(m, s, r, q, ev)
    # BUG: the release deadline frees the pages although the drain was never acknowledged
    return m.set_req(s, r, m.table.free_target.effect(m, s, r, q, ev))


class ReleaseDeadlineFreesTargetUnderWrite(HandoffModel):
    name = "release_deadline_frees_target_under_write"
    rules = REFERENCE.replace(
        "timeout", guard=live_or_release_pending, effect=deadline, ends=(End.LIVE, End.CANCELLED)
    )


def build(config: ModelConfig) -> HandoffModel:
    return ReleaseDeadlineFreesTargetUnderWrite(config)
