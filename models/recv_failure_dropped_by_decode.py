"""D drops the error of a failed KV read: the request waits for its KV forever.

Reproduces vllm-project/vllm#35943 (MooncakeConnector, pull): when D's pull
from P fails (P timeout, P crash, network interruption), the error response
is only logged in ``receive_kv_from_single_worker`` and D has no timeout on
``WAITING_FOR_REMOTE_KVS`` (``PullReqMeta.expire_time`` is never set), so the
request stays there for good and its blocks can neither be freed nor
preempted (the same hang is reported as vllm-project/vllm#50719).  In pull
the reference's initiator (D) fails the generation when the read fails; this
mutant's D only logs it, so the generation never ends.  Family: pull.
Caught at a quiet state as ``stuck``.
"""

from pdproto.models.transfer_failure_kept_local import failure_logged_locally
from pdproto.protocol import HandoffModel, ModelConfig, REFERENCE

PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/35943", "https://github.com/vllm-project/vllm/issues/50719")
FAMILY = "pull"
FAULTS = ("transfer_fail",)
EXPECTED = "stuck"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"transfer_fail": 1})


class RecvFailureDroppedByDecode(HandoffModel):
    name = "recv_failure_dropped_by_decode"
    # BUG: the failed read is only logged (the same hole as the push-side
    # transfer_failure_kept_local, here on the reading side)
    rules = REFERENCE.replace("on_xfer_failed", effect=failure_logged_locally)


def build(config: ModelConfig) -> HandoffModel:
    return RecvFailureDroppedByDecode(config)
