"""Cleanup frees D's target blocks before P's source blocks (the reference frees the source first).

A legal variation, no bug: the order in which an ended generation's blocks
go back to their pools does not matter, since each worker frees only what
the generation holds there and only once no transfer of it is in flight.
Family: push.  The monitor must report it clean (no ``bad-free``, no
``early-source-free`` or ``early-target-reuse``, no ``leak``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "push"
FAULTS = ("cancel", "timeout", "transfer_fail")
DEFAULT_CONFIG = ModelConfig(
    policy="push", requests=2, blocks=1, faults={"cancel": 1, "timeout": 1, "transfer_fail": 1}
)

_CLEANUP = REFERENCE["push"].cleanup.effect


def cleanup_target_first(m, s, r, ev):
    q = s.reqs[r]
    if not q.src or m.xfer_of(s, r) >= 0:
        return _CLEANUP(m, s, r, ev)  # nothing to reorder: one free at most, or none yet
    q = m.table.free_target.effect(m, s, r, q, ev) if q.dst else q  # the target first
    s = m.set_req(s, r, q)
    return _CLEANUP(m, s, r, ev)  # then the source


class BenignTargetFreedFirst(HandoffModel):
    name = "benign_target_freed_first"
    rules = REFERENCE.replace("cleanup", effect=cleanup_target_first)


def build(config: ModelConfig) -> HandoffModel:
    return BenignTargetFreedFirst(config)
