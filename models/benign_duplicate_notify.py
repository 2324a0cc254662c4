"""P sends its KV-landed notification to D twice; D commits on the first and ignores the second.

A legal variation, no bug: an extra notification is idempotent because D
commits only a generation that awaits its KV (live, transferring, transfer
done); the copy finds it committed (or ended) and is dropped.  Senders that
re-send a notification until acknowledged (at-least-once delivery) look like
this.  Family: push.  The monitor must report it clean (no
``double-commit``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, MsgKind

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "push"
FAULTS = ("loss", "reorder", "cancel")
DEFAULT_CONFIG = ModelConfig(
    policy="push", requests=1, blocks=1, faults={"loss": 1, "reorder": 1, "cancel": 1}
)


def sent_twice(kind):
    """The family's ``on_xfer_done``, then a second copy of the ``kind`` message it just sent."""

    def twice(m, s, x, q, ev):
        s = REFERENCE[m.policy].on_xfer_done.effect(m, s, x, q, ev)
        last = s.msgs[-1] if s.msgs else None
        if last is not None and last.kind is kind and last.r == x.r:
            s = m.send(s, kind, x.r, last.gen, last.frm, last.to)  # the same message again
        return s

    return twice


class BenignDuplicateNotify(HandoffModel):
    name = "benign_duplicate_notify"
    rules = REFERENCE.replace("on_xfer_done", effect=sent_twice(MsgKind.NOTIFY))


def build(config: ModelConfig) -> HandoffModel:
    return BenignDuplicateNotify(config)
