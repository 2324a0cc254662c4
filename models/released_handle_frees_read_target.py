"""The initiator takes the release of an in-flight transfer handle as its end and frees its buffers.

Project NIXL, https://github.com/ai-dynamo/nixl/issues/2067 (and
https://github.com/ai-dynamo/nixl/issues/1955).  Mechanism: releasing a
transfer request handle while the transfer is still in progress returned
success without quiescing it (NIXL has no real cancellation or invalidation
of in-flight requests), so the caller went on to free or deregister the
buffers that the outstanding I/O still used (use-after-free; late reads and
writes land in reused memory).  In the model D initiates the read (the pull
family); on a cancel the reference aborts the read and frees D's target only
when the data plane says the transfer ended, and this mutant's ``cleanup``
treats the abort (the release) as that end and frees the initiator's own
blocks at once while the read can still write them.
Family: pull.  Caught as ``early-target-reuse``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "early-target-reuse"
PROJECT = "nixl"
LINKS = (
    "https://github.com/ai-dynamo/nixl/issues/2067",
    "https://github.com/ai-dynamo/nixl/issues/1955",
)
FAMILY = "pull"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"cancel": 1})

_cleanup = REFERENCE["pull"].cleanup.effect


def release_is_end(m, s, r, ev):
    s = _cleanup(m, s, r, ev)  # aborts (releases) the transfer in flight, frees what is idle
    q = s.reqs[r]
    if m.xfer_of(s, r) >= 0:
        # BUG: the release returned, so the initiator frees its own buffers; the I/O is still live
        if m.policy == "pull" and q.dst:
            q = m.table.free_target.effect(m, s, r, q, ev)
        elif m.policy == "push" and q.src:
            q = m.table.free_source.effect(m, s, r, q, ev)
        s = m.set_req(s, r, q)
    return s


class ReleasedHandleFreesReadTarget(HandoffModel):
    name = "released_handle_frees_read_target"
    rules = REFERENCE.replace("cleanup", effect=release_is_end)


def build(config: ModelConfig) -> HandoffModel:
    return ReleasedHandleFreesReadTarget(config)
