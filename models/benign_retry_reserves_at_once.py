"""The router's retry submits a fresh generation and reserves its D blocks in the same step.

A legal variation, no bug: the retry is a new generation with a new ticket
(``t:r:gen+1``) and new transfer ids; reserving at once (when D has room)
only skips the queue.  Nothing of the failed attempt is reused, so a late
message or completion of the old generation is dropped.  Family: push.  The
monitor must report it clean (no ``stale-generation``, ``id-reuse`` or
``ticket-mismatch``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "push"
FAULTS = ("timeout", "retry", "transfer_fail")
DEFAULT_CONFIG = ModelConfig(
    policy="push", requests=1, blocks=1, faults={"timeout": 1, "retry": 2, "transfer_fail": 1}
)


def retry_and_reserve(m, s, r, q, ev):
    table = REFERENCE[m.policy]
    s = table.retry.effect(m, s, r, q, ev)
    q = s.reqs[r]
    if m.policy == "push" and table.reserve.guard(m, s, r, q):  # (pull: D reserves when P is ready)
        return table.reserve.effect(m, s, r, q, ev)
    return s


class BenignRetryReservesAtOnce(HandoffModel):
    name = "benign_retry_reserves_at_once"
    rules = REFERENCE.replace("retry", effect=retry_and_reserve)


def build(config: ModelConfig) -> HandoffModel:
    return BenignRetryReservesAtOnce(config)
