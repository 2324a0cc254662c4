"""P's fixed source TTL fires while the request still waits in D's queue, and D then reads freed blocks.

Reproduces vllm-project/vllm#21570 (the queue case: "the request waits in
D's queue longer than the TTL"; P frees its blocks, D later READs them),
fixed by the heartbeat-renewed lease of vllm-project/vllm#41383.  With the
``heartbeat`` extension P's source of a prefilled generation is held under a
lease that D's heartbeats renew: it may expire only once D stopped
(restarted), and then the router fails the generation.  This mutant's timer
ignores the heartbeats and P's pool takes the source back while D is alive
and still holds the advertised block ids, so D later reads blocks P no
longer holds.  Family: pull.  Caught as ``foreign-block-access`` (the read
names blocks its generation does not own on P).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import Free

EXPECTED = "foreign-block-access"
PROJECT = "vllm"
LINKS = (
    "https://github.com/vllm-project/vllm/issues/21570",
    "https://github.com/vllm-project/vllm/pull/41383",
)
FAMILY = "pull"
FAULTS = ("timeout",)
PHASE = "prefilled"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, heartbeat=True, faults={"timeout": 1})


def ttl_over(m, s, r, q):
    return bool(q.src)  # BUG: a fixed TTL; D's heartbeats are ignored


def free_in_pool(m, s, r, q, ev):
    ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
    return s  # BUG: P's pool takes the blocks back; nobody tells the router or D, whose read names them


class SourceTtlExpiresWhileQueuedAtD(HandoffModel):
    name = "source_ttl_expires_while_queued_at_d"
    rules = REFERENCE.replace("lease_expire", guard=ttl_over, effect=free_in_pool)


def build(config: ModelConfig) -> HandoffModel:
    return SourceTtlExpiresWhileQueuedAtD(config)
