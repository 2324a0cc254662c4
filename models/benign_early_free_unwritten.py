"""On abort, D frees at once the target blocks the transfer never writes (those reserved for decode).

A legal variation, no bug: D reserves room for the prompt and every decoded
position, but the transfer writes only the prompt's blocks.  The reference
keeps all of them until the aborted transfer ended; freeing the blocks no
transfer targets early is safe, and only the blocks still being written
wait for the data plane.  Family: pull.  The monitor must report it clean
(no ``early-target-reuse``, no ``bad-free``).
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import Free

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "pull"
FAULTS = ("cancel", "timeout")
# prompt_len 4 with block_size 4: the prompt fills one block, D reserves two
DEFAULT_CONFIG = ModelConfig(
    policy="pull", requests=2, blocks=2, prompt_len=4, faults={"cancel": 1, "timeout": 1}
)

_FREE_TARGET = REFERENCE["pull"].free_target.effect


def free_unwritten(m, s, r, q, ev):
    xi = m.xfer_of(s, r)
    if xi < 0:
        return _FREE_TARGET(m, s, r, q, ev)
    written = s.xfers[xi].dst
    spare = tuple(b for b in q.dst if b not in written)
    if spare:
        ev.append(Free(m.wname[q.d], spare, m.rname[r], q.gen))
        q = q._replace(dst=tuple(b for b in q.dst if b in written))
    return q


def holds_target(m, s, r, q, xi):
    return True  # always asked; the effect frees what no transfer writes


class BenignEarlyFreeUnwritten(HandoffModel):
    name = "benign_early_free_unwritten"
    rules = REFERENCE.replace("free_target", guard=holds_target, effect=free_unwritten)


def build(config: ModelConfig) -> HandoffModel:
    return BenignEarlyFreeUnwritten(config)
