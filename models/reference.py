"""The reference P->D handoff protocol (push and pull), with every fault kind.

Push: D reserves target blocks under a ticket, P prefills and writes into
them, P frees its source once the transfer read it and notifies D, D commits
and decodes from the first token at position prompt_len.  Pull (``--mode
pull``): P prefills and tells D, D reserves and reads from P, commits and
releases P's source.  Generations, tickets, incarnations, aborts that wait
for the data plane, and deadlines keep it clean under cancel, duplicate,
lost and reordered messages, restarts, timeouts, transfer failures and
retries.  See docs/protocol.md.
"""

from pdproto.protocol import HandoffModel, ModelConfig

EXPECTED = None
PROJECT = "pdproto"
LINKS = ()
FAMILY = "push"
#: checked in both families (the catalogue has a row for each)
FAMILIES = ("push", "pull")
FAULTS = ("cancel", "dup", "loss", "reorder", "restart", "timeout", "transfer_fail", "retry")
DEFAULT_CONFIG = ModelConfig.all_faults(
    1, policy="push", requests=2, blocks=1, block_size=4, prompt_len=3, max_new_tokens=2
)


def build(config: ModelConfig) -> HandoffModel:
    return HandoffModel(config)
