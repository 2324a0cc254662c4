"""P sends its KV-landed notification to D twice; D commits on the first and ignores the second.

A legal variation, no bug: an extra notification is idempotent because D
commits only a generation that awaits its KV (live, transferring, transfer
done); the copy finds it committed (or ended) and is dropped.  Senders that
re-send a notification until acknowledged (at-least-once delivery) look like
this.  Family: push.  The monitor must report it clean (no
``double-commit``).
"""

from pdproto.protocol import HandoffModel, ModelConfig, MsgKind, REFERENCE

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "push"
FAULTS = ("loss", "reorder", "cancel")
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"loss": 1, "reorder": 1, "cancel": 1})

_ON_DONE = REFERENCE["push"].on_xfer_done.effect


def notify_twice(m, s, x, q, ev):
    s = _ON_DONE(m, s, x, q, ev)
    if s.msgs and s.msgs[-1].kind is MsgKind.NOTIFY and s.msgs[-1].r == x.r:
        s = m.send(s, MsgKind.NOTIFY, x.r, q.gen, q.p, q.d)  # the same notification again
    return s


class BenignDuplicateNotify(HandoffModel):
    name = "benign_duplicate_notify"
    rules = REFERENCE.replace("on_xfer_done", effect=notify_twice)


def build(config: ModelConfig) -> HandoffModel:
    return BenignDuplicateNotify(config)
