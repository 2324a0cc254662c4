"""P's abort path frees a shared prefix block as if the aborted generation owned it alone.

Reproduces the prefix-cache refcount bugs of InternLM/lmdeploy#1450 (review:
a dead sequence's blocks were returned to the free list on erase, "if prefix
cache enabled, blocks will be shared by sequences, cannot be freed
immediately") and Avarok-Cybersecurity/atlas#373 (a reference dropped for
the wrong owner: "block returned to the free list while in use, handed to a
second and third owner"); the dual of LMCache/LMCache#2847 (a reference
taken twice and dropped once: a leak).  With ``prefix_cache`` the prompt's
prefix blocks on P are shared by every generation that hit the cache; the
reference drops only the ended generation's reference (the block goes back
to the pool when its last owner frees it).  This mutant's cleanup frees the
blocks outright: the other owners' references are forgotten, the block is
evicted and the next prefill allocates it while a live generation still
holds it.  Caught as ``double-allocation``.
Family: pull.  https://github.com/InternLM/lmdeploy/issues/1450
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

EXPECTED = "double-allocation"
PROJECT = "lmdeploy"
LINKS = (
    "https://github.com/InternLM/lmdeploy/issues/1450",
    "https://github.com/LMCache/LMCache/issues/2847",
)
FAMILY = "pull"
FAULTS = ("timeout",)
# a third request's prefill takes the evicted prefix block while the second still holds it
DEFAULT_CONFIG = ModelConfig(
    policy="pull", requests=3, blocks=3, block_size=2, prompt_len=3, prefix_cache=True, faults={"timeout": 1}
)

_cleanup = REFERENCE["push"].cleanup.effect


def cleanup_frees_prefix_outright(m, s, r, ev):
    q = s.reqs[r]
    s = _cleanup(m, s, r, ev)
    if q.pfx and q.src and not s.reqs[r].src:
        # BUG: the shared prefix went back to the pool, whoever else holds it:
        # P forgets the other owners' references and evicts the cached prefix
        prefix = q.src[: m.prefix_blocks]
        for j, o in enumerate(s.reqs):
            if j != r and o.p == q.p and o.pfx and o.src[: m.prefix_blocks] == prefix:
                s = m.set_req(s, j, o._replace(src=o.src[m.prefix_blocks :], pfx=0))
    return s


class AbortFreesSharedPrefix(HandoffModel):
    name = "abort_frees_shared_prefix"
    rules = REFERENCE.replace("cleanup", effect=cleanup_frees_prefix_outright)


def build(config: ModelConfig) -> HandoffModel:
    return AbortFreesSharedPrefix(config)
