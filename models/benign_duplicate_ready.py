"""P tells D twice that its prefill is ready; D reserves and reads once.

A legal variation, no bug: D acts on a ready message only for a generation
that is prefilled and not yet reserved or queued at D, so the copy is
dropped.  Family: pull.  The monitor must report it clean (no
``double-allocation``, ``id-reuse`` or ``ticket-mismatch``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, MsgKind

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "pull"
FAULTS = ("reorder", "cancel")
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=2, blocks=1, faults={"reorder": 1, "cancel": 1})


def ready_twice(m, s, r, q, ev):
    s = REFERENCE[m.policy].prefill_done.effect(m, s, r, q, ev)
    if m.policy != "pull":  # (push sends no ready)
        return s
    return m.send(s, MsgKind.READY, r, q.gen, q.p, q.d)  # the same ready again


class BenignDuplicateReady(HandoffModel):
    name = "benign_duplicate_ready"
    rules = REFERENCE.replace("prefill_done", effect=ready_twice)


def build(config: ModelConfig) -> HandoffModel:
    return BenignDuplicateReady(config)
