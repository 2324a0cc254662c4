"""D sends the release of P's source twice; P frees on the first and ignores the second.

A legal variation, no bug: P frees the source only while it still holds it
for that generation and no transfer reads it, so a second release finds
nothing to free.  Connectors that repeat a "done reading" notification per
layer group or per retry look like this.  Family: pull.  The monitor must
report it clean (no ``bad-free``).
"""

from pdproto.models.benign_duplicate_notify import sent_twice
from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, MsgKind

EXPECTED = None
BENIGN = True
PROJECT = "pdproto"
LINKS = ()
FAMILY = "pull"
FAULTS = ("loss", "reorder", "timeout")
DEFAULT_CONFIG = ModelConfig(
    policy="pull", requests=2, blocks=1, faults={"loss": 1, "reorder": 1, "timeout": 1}
)


class BenignDuplicateRelease(HandoffModel):
    name = "benign_duplicate_release"
    rules = REFERENCE.replace("on_xfer_done", effect=sent_twice(MsgKind.RELEASE))


def build(config: ModelConfig) -> HandoffModel:
    return BenignDuplicateRelease(config)
