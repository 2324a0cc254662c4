"""A send deadline releases P's source blocks while the write task that reads them can still run.

Project vLLM (MoRI-IO connector, WRITE mode),
https://github.com/vllm-project/vllm/pull/57705 (the reviewer's finding in
that PR).  Mechanism: the scheduler's deferred-send deadline expires and
releases the producer's blocks, while the worker keeps the deferred WRITE task
alive; the write then runs from released (and possibly reused) source blocks,
because no terminal state is shared between the deadline and the task (the fix
marks the task terminal, and tells the consumer, before the source is
released).  In the model the deadline is the ``timeout`` fault during the
write; the reference fails the generation and lets P free its source only once
the aborted write has ended, and this mutant's ``timeout`` releases the source
first.
Family: push.  Caught as ``early-source-free``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig
from pdproto.spec import Free

EXPECTED = "early-source-free"
PROJECT = "vllm"
LINKS = ("https://github.com/vllm-project/vllm/pull/57705",)
FAMILY = "push"
FAULTS = ("timeout",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="push", requests=1, blocks=1, faults={"timeout": 1})

_timeout = REFERENCE["push"].timeout.effect


def release_then_fail(m, s, r, q, ev):
    if q.src:
        # BUG: the deadline releases the producer blocks; the write task is not made terminal first
        ev.append(Free(m.wname[q.p], q.src, m.rname[r], q.gen))
        q = q._replace(src=())
        s = m.set_req(s, r, q)
    return _timeout(m, s, r, q, ev)


class DeadlineFreesSourceUnderWrite(HandoffModel):
    name = "deadline_frees_source_under_write"
    rules = REFERENCE.replace("timeout", effect=release_then_fail)


def build(config: ModelConfig) -> HandoffModel:
    return DeadlineFreesSourceUnderWrite(config)
