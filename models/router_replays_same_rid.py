"""The router retries a PD request under the same request id as the attempt it replays.
Caveat: caught by construction: stale-generation rejects the replay's own
submit (it reuses the generation it replays); the orphaned first attempt and
the duplicate bootstrap entry that hurt SGLang are not what the model checks.

Reproduces sgl-project/sglang#34570 ("[router] PD: never auto-replay a
request that may already be dispatched"): PD dispatch is not idempotent, yet
the router auto-retried after a connection reset or a cancellation race and
replayed the same RID, so the same request could be dispatched twice: the
replay created a duplicate bootstrap entry and the first attempt became an
orphan inside the disaggregated pipeline (the fix retries only before any
upstream was contacted and otherwise surfaces the error).  The reference's
retry submits a new generation (gen + 1) with fresh tickets and transfer
ids; this mutant's retry submits the request again under the generation it
replays.  Family: push (SGLang: D pre-allocates, P writes).  Caught as
``stale-generation`` (a submit whose gen is not greater than every earlier
one).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, Phase, Req
from pdproto.spec import Submit

PROJECT = "sglang"
LINKS = ("https://github.com/sgl-project/sglang/pull/34570",)
FAMILY = "push"
FAULTS = ("timeout", "retry")
CAVEAT = (
    "Caught by construction: stale-generation rejects the replay's own submit (it reuses the generation "
    "it replays); the orphaned first attempt and the duplicate bootstrap entry that hurt SGLang are not "
    "what the model checks."
)
EXPECTED = "stale-generation"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"timeout": 1, "retry": 1})


def replay_same_rid(m, s, r, q, ev):
    # BUG: the replay carries the id of the attempt it replays (no new generation)
    ev.append(Submit(m.rname[r], q.gen, m.prompt_len, m.max_new))
    return m.set_req(s, r, Req(gen=q.gen, ph=Phase.QUEUED, p=q.p, d=q.d))


class RouterReplaysSameRid(HandoffModel):
    name = "router_replays_same_rid"
    rules = REFERENCE.replace("retry", effect=replay_same_rid)


def build(config: ModelConfig) -> HandoffModel:
    return RouterReplaysSameRid(config)
