"""The vLLM adapter (docs/adapters/vllm.md): vLLM's real P and D schedulers
and NIXL connector (pull or push), driven by pdproto's actions, with fake
workers.  Importing it needs vLLM in the supported range
(:data:`~pdproto.adapters.vllm._support.SUPPORTED`); otherwise one clear
error."""

from ._support import SUPPORTED as SUPPORTED
from ._support import require_vllm as require_vllm

require_vllm()

from ._adapter import KNOWN as KNOWN  # noqa: E402
from ._adapter import VllmAdapter as VllmAdapter  # noqa: E402
from ._harness import VllmHarness as VllmHarness  # noqa: E402
from ._scenarios import SCENARIOS as SCENARIOS  # noqa: E402
from ._scenarios import expected as expected  # noqa: E402
from ._scenarios import run_scenario as run_scenario  # noqa: E402

__all__ = [
    "SCENARIOS",
    "expected",
    "run_scenario",
    "VllmAdapter",
    "VllmHarness",
    "KNOWN",
    "SUPPORTED",
    "require_vllm",
]
