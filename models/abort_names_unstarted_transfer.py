"""A cancel while the request is still queued makes the initiator abort a transfer that never started.

Reproduces sgl-project/sglang#30352 (D's new ABORT control message reached
the P side for a room whose transfer was never set up; P's bootstrap thread
asserted on it and died) and the "ABORT for an unknown room" path of
sgl-project/sglang#35360.  The reference aborts the generation's transfer
only when one is in flight; this mutant's cleanup always aborts the
transfer id derived from the request, so a cancel before any transfer names
a transfer the data plane never saw.  Family: push.  Caught as
``unknown-transfer`` (the abort names a transfer that never started).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import TransferAbort

EXPECTED = "unknown-transfer"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/issues/30352",
    "https://github.com/sgl-project/sglang/issues/35360",
)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "queued"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})

_CLEANUP = REFERENCE["push"].cleanup.effect


def cleanup_always_aborts(m, s, r, ev):
    q = s.reqs[r]
    if m.xfer_of(s, r) < 0 and q.xs == 0:  # BUG: no transfer ever started; abort its id anyway
        ev.append(TransferAbort(m.tid(r, q.gen)))
    return _CLEANUP(m, s, r, ev)


class AbortNamesUnstartedTransfer(HandoffModel):
    name = "abort_names_unstarted_transfer"
    rules = REFERENCE.replace("cleanup", effect=cleanup_always_aborts)


def build(config: ModelConfig) -> HandoffModel:
    return AbortNamesUnstartedTransfer(config)
