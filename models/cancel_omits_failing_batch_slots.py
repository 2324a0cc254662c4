"""On a failed write P's cancel names only the chunks already sent: D's slots of the failing chunk leak.

Reproduces the leak found in review of LMCache/LMCache#3038 (the fully async
PD backend): the sender recorded a batch's keys as sent only after
``async_batched_write`` returned, but the receiver had allocated the slots
for the batch when it processed the ``AllocRequest``; when the write raised,
the ``CancelNotif`` listed only the keys of earlier, completed batches, and
the failing batch's receiver slots were never released (fixed in the PR by
tracking the keys before the write).  With ``chunks`` the handoff is several
writes under one ticket; the reference's failure handler fails the
generation and D frees every target block it reserved.  This mutant's
failure handler tells D to release only the blocks of the chunks before the
failing one.  Family: push (the sender writes into the receiver's slots).
Caught at a quiet state as ``leak``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

PROJECT = "lmcache"
LINKS = ("https://github.com/LMCache/LMCache/pull/3038",)
FAMILY = "push"
FAULTS = ("transfer_fail",)
EXPECTED = "leak"
DEFAULT_CONFIG = ModelConfig(
    policy="push",
    requests=1,
    blocks=2,
    block_size=2,
    prompt_len=4,
    max_new_tokens=1,
    chunks=2,
    faults={"transfer_fail": 1},
)

_on_xfer_failed = REFERENCE["push"].on_xfer_failed.effect


def cancel_names_sent_chunks(m, s, x, q, ev):
    lo = m.chunk_ranges[x.chunk][0]
    sent = q.dst[: lo // m.bs]  # the blocks of the chunks that landed before this one
    # BUG: the failing chunk's keys were not tracked yet: its target blocks drop out of the cancel
    return _on_xfer_failed(m, s, x, q._replace(dst=sent), ev)


class CancelOmitsFailingBatchSlots(HandoffModel):
    name = "cancel_omits_failing_batch_slots"
    # The blocks dropped from the cancel look free to this model but are owned
    # to the monitor: blocks are not interchangeable (no block renaming).
    SYMMETRIC_BLOCKS = False
    rules = REFERENCE.replace("on_xfer_failed", effect=cancel_names_sent_chunks)


def build(config: ModelConfig) -> HandoffModel:
    return CancelOmitsFailingBatchSlots(config)
