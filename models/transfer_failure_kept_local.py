"""P records a failed KV write only locally: D is never told and waits for the KV forever.
Caveat: stuck only because the model has no D-side waiting timeout: SGLang's D
gives up after 300 s (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), and a run with a
timeout fault (the router's deadline) ends the generation cleanly.

Reproduces sgl-project/sglang#36108 (fixes sgl-project/sglang#36033): the
NIXL prefill-side transfer worker recorded transfer errors only in its own
state, so the decode side waited for KV that would never come (until the
300 s ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``); the fix sends a
``NIXL_TRANSFER_FAILURE`` to every decode endpoint.  vLLM's NixlPush had the
same hole (vllm-project/vllm#50754: a write that failed to post was only
logged, and D, counting notifications, never reached the count).  The
reference's failure handler fails the live generation, which every worker
sees; this mutant's P only logs it, so the generation is never ended.  With
no timeout fault in the run, D waits for good.  Family: push.  Caught at a
quiet state as ``stuck``.
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/pull/36108",
    "https://github.com/vllm-project/vllm/pull/50754",
)
FAMILY = "push"
FAULTS = ("transfer_fail",)
CAVEAT = (
    "Stuck only because the model has no D-side waiting timeout: SGLang's D gives up after 300 s "
    "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT), and a run with a timeout fault (the router's deadline) ends "
    "the generation cleanly."
)
EXPECTED = "stuck"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"transfer_fail": 1})

_on_xfer_failed = REFERENCE["push"].on_xfer_failed.effect


def failure_logged_locally(m, s, x, q, ev):
    if q.end is not End.LIVE:
        return _on_xfer_failed(m, s, x, q, ev)
    return m.set_req(s, x.r, q)  # BUG: the failure stays in P's own bookkeeping; nobody ends the generation


class TransferFailureKeptLocal(HandoffModel):
    name = "transfer_failure_kept_local"
    rules = REFERENCE.replace("on_xfer_failed", effect=failure_logged_locally)


def build(config: ModelConfig) -> HandoffModel:
    return TransferFailureKeptLocal(config)
