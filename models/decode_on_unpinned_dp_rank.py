"""D's engine decodes the request on a round-robin DP rank, not the rank whose KV pool received it.

Reproduces ROCm/ATOM#1505 ("fix: dpa kv transfer error on spur"): in ATOM's
disaggregated serving with data-parallel attention every DP rank has its
own KV pool, and the KV of a request is transferred into the pool of the
decode rank the router paired with the prefill rank; but the engine ignored
the request's pinned ``data_parallel_rank`` and scheduled it round-robin, so
the request could run on a rank that never received its KV (the fix honours
the pinned rank and aligns the prefill and decode ranks).  The model's D
workers stand for the decode DP ranks; the reference decodes on the worker
that committed the handoff.  This mutant's decode step runs on the rank the
engine's round robin picks for the request (arrival order modulo the rank
count).  Family: push (prefill ranks write into decode buffers).  Caught as
``decode-before-commit`` (a decode on a worker where that generation never
committed).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig

PROJECT = "atom"
LINKS = ("https://github.com/ROCm/ATOM/pull/1505",)
FAMILY = "push"
FAULTS = ()
EXPECTED = "decode-before-commit"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, decode_workers=2, blocks=1)

_decode = REFERENCE["push"].decode.effect


def decode_on_round_robin_rank(m, s, r, q, ev):
    rank = m.np + r % m.nd  # BUG: the engine's own round robin, not the pinned rank q.d
    s = _decode(m, s, r, q._replace(d=rank), ev)
    return m.set_req(s, r, s.reqs[r]._replace(d=q.d))  # the request stays paired with its pinned rank


class DecodeOnUnpinnedDpRank(HandoffModel):
    name = "decode_on_unpinned_dp_rank"
    # The round robin makes the first decode rank special: no worker permutation.
    SYMMETRIC_WORKERS = False
    rules = REFERENCE.replace("decode", effect=decode_on_round_robin_rank)


def build(config: ModelConfig) -> HandoffModel:
    return DecodeOnUnpinnedDpRank(config)
