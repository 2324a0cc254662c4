"""Randomised stateful testing of handoff models with Hypothesis.

Exhaustive checking (``pdproto check``) covers small configurations; this
module drives any model that follows the model interface (``actions`` /
``step``, see docs/modeling.md) through Hypothesis's stateful testing, over
configurations too large to enumerate, and feeds every step's events to the
:class:`~pdproto.Monitor`.

.. code-block:: python

    from pdproto.testing import handoff_machine
    from pdproto import HandoffModel, ModelConfig

    TestReference = handoff_machine(HandoffModel(ModelConfig(requests=4))).TestCase

Each example:

1. starts from the model's first initial state with a fresh monitor;
2. draws a *swarm* (which fault kinds are on in this example, and how eager
   it is to inject them) so that different examples stress different faults;
3. takes steps toward states no example has visited yet, backing up (no
   model step) and routing when none is next to it; a step's recorded
   choice can also name an enabled action outright (what Hypothesis
   shrinks);
4. after every step, the invariant asks the monitor (and the model's own
   state invariants, if any);
5. at teardown drives the system to quiescence with progress actions only
   (deliver, time out, finish) and applies the end-of-history checks, so
   leaks and stuck requests are found too.

A failure is shrunk exactly (its steps replayed with runs of them left out)
before it is raised.  Hypothesis's explain phase is off in the machines'
settings and in :data:`PROFILES`.

A failure raises :class:`HandoffFailure` (an AssertionError) whose message is
the monitor's violation and a numbered step table; the history is written
where ``out`` says, so ``pdproto audit`` and ``pdproto replay`` take it.

Importing this module imports Hypothesis; ``import pdproto`` does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from .drivers import HandoffFailure as HandoffFailure
from .drivers import handoff_machine as handoff_machine
from .drivers import uniform_machine as uniform_machine
from .protocol import FAULT_KINDS, ModelConfig
from .spec import POLICIES

__all__ = [
    "HandoffFailure",
    "handoff_machine",
    "uniform_machine",
    "configs",
    "fault_budgets",
    "PROFILES",
    "register_profiles",
]


# -- strategies ------------------------------------------------------------------


def fault_budgets(max_budget: int = 2) -> st.SearchStrategy[dict[str, int]]:
    """Fault budgets: each kind of :data:`~pdproto.FAULT_KINDS` 0..max_budget."""
    return st.fixed_dictionaries({kind: st.integers(0, max_budget) for kind in FAULT_KINDS})


def configs(
    *,
    modes: Iterable[str] = POLICIES,
    max_requests: int = 4,
    max_workers: int = 2,
    max_blocks: int = 4,
    max_budget: int = 2,
) -> st.SearchStrategy[ModelConfig]:
    """Model configurations, from tiny to larger than the explorer enumerates."""
    return st.builds(
        ModelConfig,
        mode=st.sampled_from(tuple(modes)),
        requests=st.integers(1, max_requests),
        prefill_workers=st.integers(1, max_workers),
        decode_workers=st.integers(1, max_workers),
        blocks=st.integers(1, max_blocks),
        faults=fault_budgets(max_budget),
    )


# -- settings profiles -----------------------------------------------------------

#: every Hypothesis phase but explain (which re-runs a shrunk failure many
#: times to say which parts of it matter: about 95% of the time of a run
#: that found a bug, for the same shrunk history)
_NO_EXPLAIN = tuple(p for p in Phase if p is not Phase.explain)

#: Hypothesis settings profiles pdproto registers: a quick default and a deeper
#: one for CI, both without the explain phase.  Select with
#: ``pytest --hypothesis-profile=pdproto-ci``.
PROFILES: dict[str, dict[str, Any]] = {
    "pdproto-quick": dict(max_examples=100, stateful_step_count=50, deadline=None, phases=_NO_EXPLAIN),
    "pdproto-ci": dict(max_examples=1000, stateful_step_count=100, deadline=None, phases=_NO_EXPLAIN),
}


def register_profiles() -> None:
    """Register :data:`PROFILES` with Hypothesis (idempotent)."""
    for name, kwargs in PROFILES.items():
        settings.register_profile(
            name, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **kwargs
        )
