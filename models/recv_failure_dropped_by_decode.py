"""D only logs the error of a failed KV read: the request waits for its KV forever, holding D's blocks.

Reproduces vllm-project/vllm#35943 (MooncakeConnector, pull; the same hang
is vllm-project/vllm#50719, fixed by vllm-project/vllm#50984): when D's pull
from P fails (P timeout, P crash, network interruption), the error response
is only logged in ``receive_kv_from_single_worker``; a request leaves
``WAITING_FOR_REMOTE_KVS`` only through ``finished_recving``, and D has no
deadline on that wait (``PullReqMeta.expire_time`` is never set), so the
request and its blocks stay there for good, while P's side recovers (its
``SendBlockMeta.expire_time`` releases the source after 480 s).  Unlike
transfer_failure_kept_local (SGLang: the initiator's failure handler keeps
the failure to itself, and D's 300 s waiting timeout ends the wait), here
the data plane's error reaches P, which lets the source go, and is dropped
on D's receive path: this mutant's ``xfer_fault`` (a transfer the data
plane fails) frees P's source and never runs D's failure handler, so D's
record still shows the read in flight.  Family: pull.  Caught at a quiet
state as ``stuck``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig, XferState
from pdproto.spec import Free, TransferFailed

PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/issues/35943",
    "https://github.com/vllm-project/vllm/issues/50719",
    "https://github.com/vllm-project/vllm/pull/50984",
)
FAMILY = "pull"
FAULTS = ("transfer_fail",)
EXPECTED = "stuck"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"transfer_fail": 1})


def error_response_only_logged(m, s, i, x, ev):
    q = s.reqs[x.r]
    if q.gen != x.gen or q.end is not End.LIVE or q.xs is not XferState.IN_FLIGHT:
        return REFERENCE[m.policy].xfer_fault.effect(m, s, i, x, ev)
    ev.append(TransferFailed(m.tid(x.r, x.gen, x.chunk)))
    s = s._replace(xfers=s.xfers[:i] + s.xfers[i + 1 :])
    if q.src:  # P's side ends: its send-side expiry releases the source
        ev.append(Free(m.wname[q.p], q.src, m.rname[x.r], q.gen))
        q = q._replace(src=())
    # BUG: D's receive path only logs the error response: no finished_recving, no failure, no deadline
    return m.set_req(s, x.r, q)


class RecvFailureDroppedByDecode(HandoffModel):
    name = "recv_failure_dropped_by_decode"
    rules = REFERENCE.replace("xfer_fault", effect=error_response_only_logged)


def build(config: ModelConfig) -> HandoffModel:
    return RecvFailureDroppedByDecode(config)
