"""P frees its source blocks when a timer expires while D is still reading them.

Reproduces vllm-project/vllm#21570: in pull mode the prefill side frees the
KV blocks of a finished prefill after a fixed abort timeout even though the
decode side's read is still in flight.  The reference only lets P's source
lease expire after D committed (the read is over); this mutant arms the timer
as soon as the read starts.  Caught as ``early-source-free``.
Family: pull.  https://github.com/vllm-project/vllm/issues/21570
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, Phase

EXPECTED = "early-source-free"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/issues/21570",)
FAMILY = "pull"
FAULTS = ("timeout",)
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"timeout": 1})


def source_lease_over(m, s, r, q):
    return bool(q.src)  # BUG: the timer ignores the read in flight


class PFreesSourceOnTimer(HandoffModel):
    name = "p_frees_source_on_timer"
    rules = REFERENCE.replace(
        "p_lease", guard=source_lease_over, phases=(Phase.TRANSFERRING, Phase.COMMITTED)
    )


def build(config: ModelConfig) -> HandoffModel:
    return PFreesSourceOnTimer(config)
