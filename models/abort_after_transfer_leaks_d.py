"""An abort of a request whose KV already landed on D, before D scheduled it, never frees D's blocks.

Project SGLang, https://github.com/sgl-project/sglang/pull/9817 (also
https://github.com/sgl-project/sglang/pull/8587).  Mechanism: on the decode
side a request that was pre-allocated and whose KV transfer completed waits
in a queue to join the running batch; the abort path for that queue assumed,
as on a prefill or unified engine, that a waiting request owns no resources,
so it dropped the request without releasing its KV pages.  In the model the
KV has landed and P's completion notification is still on its way to D when
the client cancels; the reference's cleanup frees D's target, and this
mutant's ``free_target`` skips a generation whose transfer had already
completed but that D had not yet committed.
Family: push.  Caught as ``leak``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, Phase, XferState

EXPECTED = "leak"
PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/pull/9817",
    "https://github.com/sgl-project/sglang/pull/8587",
)
FAMILY = "push"
FAULTS = ("cancel",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"cancel": 1})


def d_frees_target(m, s, r, q, xi):
    # BUG: the transferred-but-not-yet-running queue is taken to own nothing
    return xi < 0 and not (q.ph is Phase.TRANSFERRING and q.xs is XferState.DONE)


class AbortAfterTransferLeaksD(HandoffModel):
    name = "abort_after_transfer_leaks_d"
    rules = REFERENCE.replace("free_target", guard=d_frees_target)


def build(config: ModelConfig) -> HandoffModel:
    return AbortAfterTransferLeaksD(config)
