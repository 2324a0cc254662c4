"""With heterogeneous TP, P's source descriptors address past the registered KV region.
Caveat: capacity only because P's pool has one block: with a larger pool the
descriptor lands in another block of the pool, and the read is caught as
foreign-block-access instead.

Reproduces sgl-project/sglang#31968 (fixes sgl-project/sglang#31295): with
prefill attention-TP 1 and decode TP 4 on a model with 2 KV heads, D
replicates heads (ranks 0 and 1 hold head 0, ranks 2 and 3 head 1), but P
built the source descriptor list with ``num_groups = decode_tp / prefill_tp
= 4`` head slices per block instead of the 2 unique ones, so the descriptors
for the upper ranks address past the registered region (NIXL_ERR_NOT_FOUND
on the first request).  The model has no heads: a block id stands for the
memory a descriptor names, so a descriptor at head-slice index ``b * 4 + g``
of a region holding 2 slices per block lands in block ``(b * 4 + g) // 2``.
The reference reads exactly the generation's source blocks.  Family: push
(SGLang's P writes into D).  Caught as ``capacity`` (a block outside P's
declared pool).
"""

import attrs

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import TransferStart

PROJECT = "sglang"
LINKS = (
    "https://github.com/sgl-project/sglang/pull/31968",
    "https://github.com/sgl-project/sglang/issues/31295",
)
FAMILY = "push"
FAULTS = ()
CAVEAT = (
    "Capacity only because P's pool has one block: with a larger pool the descriptor lands in another "
    "block of the pool, and the read is caught as foreign-block-access instead."
)
EXPECTED = "capacity"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1)

PREFILL_TP, DECODE_TP, KV_HEADS = 1, 4, 2
UNIQUE_SLICES = KV_HEADS // PREFILL_TP  # head slices a P block really holds
DECODE_RANK = DECODE_TP - 1  # the D rank this handoff writes to (it holds the last head)


def descriptor_block(b):
    groups = DECODE_TP // PREFILL_TP  # BUG: should be UNIQUE_SLICES (replicated heads share a slice)
    return (b * groups + DECODE_RANK % groups) // UNIQUE_SLICES


def prefill_done_wrong_head_map(m, s, r, q, ev):
    first = len(ev)
    s = REFERENCE[m.policy].prefill_done.effect(m, s, r, q, ev)  # pull: P starts no write here
    ev[first:] = [
        attrs.evolve(e, src_blocks=tuple(descriptor_block(b) for b in e.src_blocks))
        if type(e) is TransferStart
        else e
        for e in ev[first:]
    ]
    return s


class HeadSlicesPastRegisteredRegion(HandoffModel):
    name = "head_slices_past_registered_region"
    rules = REFERENCE.replace("prefill_done", effect=prefill_done_wrong_head_map)


def build(config: ModelConfig) -> HandoffModel:
    return HeadSlicesPastRegisteredRegion(config)
