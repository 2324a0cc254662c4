"""The cleanup of a timed-out handoff runs only when P can schedule new work, so a full pool never recovers.

Project TensorRT-LLM, https://github.com/NVIDIA/TensorRT-LLM/pull/12313.
Mechanism: the ``kv_transfer_timeout_ms`` cleanup of cancelled or timed-out
context transfers ran only inside ``_send_kv_async``, that is only when a new
context request was scheduled; once leaked blocks had exhausted the KV pool
no context request could be scheduled, so the cleanup never ran again and
the server hung with ``/health`` still 200 (the fix runs the check every
executor iteration).  In the model the timeout fails the generation during
its transfer, and the cleanup frees P's source once the aborted transfer has
ended; this mutant's ``free_source``, for a generation whose transfer was
started, runs only when P has a free block to schedule a new prefill with,
so with one block per worker the timed-out generation keeps its block for
good (no new context request can be scheduled to run the cleanup).
Family: pull (TensorRT-LLM prefills on the context server first, then the
generation server takes the KV).  Caught as ``leak``.
"""

from pdproto.protocol import REFERENCE, HandoffModel, ModelConfig, XferState

EXPECTED = "leak"
PROJECT = "tensorrt-llm"
LINKS = ("https://github.com/NVIDIA/TensorRT-LLM/pull/12313",)
FAMILY = "pull"
FAULTS = ("timeout",)
PHASE = "transferring"
DEFAULT_CONFIG = ModelConfig(policy="pull", requests=1, blocks=1, faults={"timeout": 1})


def idle_and_p_schedules(m, s, r, q, xi):
    # BUG: the timeout cleanup sits on the path that schedules a new context request
    return xi < 0 and (q.xs is XferState.NONE or len(m.free_blocks(s, q.p)) > 0)


class TimeoutCleanupNeedsFreeBlock(HandoffModel):
    name = "timeout_cleanup_needs_free_block"
    rules = REFERENCE.replace("free_source", guard=idle_and_p_schedules)


def build(config: ModelConfig) -> HandoffModel:
    return TimeoutCleanupNeedsFreeBlock(config)
