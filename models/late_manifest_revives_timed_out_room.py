"""D's late reservation for a request that already timed out is accepted, and D holds its slot.

Reproduces the TokenSpeed PD runtime bug analysed in smg-project/smg#2463
(the runtime's fix attempt: lightseekorg/tokenspeed#1427): on P's bootstrap
timeout ``poll()`` only recorded a failure and the room's state was then
dropped entirely, so D's late pre-allocation manifest for that room found no
``Failed`` record, was stored, and raised the room to ``Bootstrapped``
although no sender existed; D held the slot and its KV for the full 300 s
waiting timeout.  The reference keeps the ended generation's end as a
tombstone that every worker checks before acting for it; this mutant's D
reserves for a request whose generation already failed by timeout.  Family:
push (D reserves first, P writes).  Caught as ``resurrection`` (a reserve for
a terminal generation).
"""

from pdproto.protocol import REFERENCE, End, HandoffModel, ModelConfig

PROJECT = "tokenspeed"
LINKS = (
    "https://github.com/smg-project/smg/pull/2463",
    "https://github.com/lightseekorg/tokenspeed/pull/1427",
)
FAMILY = "push"
FAULTS = ("timeout",)
PHASE = "queued"
EXPECTED = "resurrection"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"timeout": 1})


class LateManifestRevivesTimedOutRoom(HandoffModel):
    name = "late_manifest_revives_timed_out_room"
    # BUG: no tombstone: D's reservation (the manifest) is taken for a request that failed by timeout
    rules = REFERENCE.replace("reserve", ends=(End.LIVE, End.FAILED))


def build(config: ModelConfig) -> HandoffModel:
    return LateManifestRevivesTimedOutRoom(config)
