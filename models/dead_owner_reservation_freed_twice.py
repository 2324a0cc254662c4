"""The cleanup of a dead owner's incomplete reservation releases blocks that its death already released.

Project Mooncake (Store), https://github.com/kvcache-ai/Mooncake/pull/3254
(regression test mooncake-store/tests/master_service_processing_key_double_erase_test.cpp).
Mechanism: a client's ``PutStart`` without ``PutEnd`` leaves the key in
``processing_keys``; when the client's segment expires and is unmounted, the
next operation on the key builds a ``MetadataAccessorRW`` whose cleanup
erases the now-invalid object (which already drops the processing key) and
then erases the processing key again through a stale iterator, a
double-erase that crashed the master every few minutes.  In the model the
reservation is P's source for a prefill under way, the owner's death is P's
restart (the restart releases the dead worker's blocks with it), and the
cleanup of the generation the restart failed is the second release: this
mutant's ``restart`` leaves the record still naming the dead worker's
blocks, so the cleanup frees them again.  (In Mooncake both erases sit in
the accessor's cleanup; here the first is the restart's.)
Family: pull (Mooncake's store: P puts, D gets).  Caught as ``bad-free``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

EXPECTED = "bad-free"
PROJECT = "mooncake"
LINKS = ("https://github.com/kvcache-ai/Mooncake/pull/3254",)
FAMILY = "pull"
FAULTS = ("restart",)
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"restart": 1})

_restart = REFERENCE["pull"].restart.effect


def restart_keeps_stale_record(m, s, w, ev):
    stale = {r: q.src for r, q in enumerate(s.reqs) if q.p == w and q.src}
    s = _restart(m, s, w, ev)  # the dead worker's blocks are gone with it
    for r, src in stale.items():
        # BUG: the record of the incomplete reservation still names them, and its cleanup
        # releases them a second time
        s = m.set_req(s, r, s.reqs[r]._replace(src=src))
        if s.reqs[r].end is not End.LIVE:
            s = m.cleanup(s, r, ev)
    return s


class DeadOwnerReservationFreedTwice(HandoffModel):
    name = "dead_owner_reservation_freed_twice"
    rules = REFERENCE.replace("restart", effect=restart_keeps_stale_record)


def build(config: ModelConfig) -> HandoffModel:
    return DeadOwnerReservationFreedTwice(config)
