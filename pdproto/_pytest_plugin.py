"""pdproto's pytest plugin (registered through the ``pytest11`` entry point).

- Registers the Hypothesis settings profiles ``pdproto-quick`` and
  ``pdproto-ci`` (select one with ``--hypothesis-profile``, or with this
  plugin's ``--pdproto-profile quick|ci``).
- Offers the ``pdproto_fuzz`` fixture: ``pdproto_fuzz(model)`` fuzzes a model
  under the active profile and fails the test with the monitor's violation,
  the step table and the path of the failing history (under ``tmp_path``).

Under pytest-xdist (``pytest -n N``) each xdist worker loads the plugin and
its profiles (``--pdproto-profile`` reaches every worker), each test fuzzes
in the worker that runs it, its history goes to that test's own
``tmp_path``, and the workers share Hypothesis's example database (a
directory, safe for several processes), so a failure one worker saved is
replayed first by whichever worker runs that test next
(tests/test_parallel_fuzz.py runs this under ``-n 2``).
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pdproto", "pdproto handoff fuzzing")
    group.addoption(
        "--pdproto-profile",
        choices=("quick", "ci"),
        default=None,
        help="load the Hypothesis settings profile pdproto-quick or pdproto-ci",
    )


def pytest_configure(config: pytest.Config) -> None:
    from .testing import register_profiles

    register_profiles()
    choice = config.getoption("--pdproto-profile", default=None)
    if choice:
        from hypothesis import settings

        settings.load_profile(f"pdproto-{choice}")


@pytest.fixture
def pdproto_fuzz(tmp_path: Any) -> Any:
    """``fuzz(model, *, examples=None, steps=None, out=None, explain=False) -> FuzzStats``.

    Runs the model's Hypothesis state machine with the active settings
    profile (``examples``/``steps`` override it; Hypothesis's explain phase
    runs only with ``explain=True``).  On a violation the test fails with a
    :class:`pdproto.testing.HandoffFailure`; its history is written to
    ``out`` (default ``tmp_path / "failure.jsonl"``).
    """
    from hypothesis import Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from .testing import handoff_machine

    def fuzz(
        model: Any,
        *,
        examples: int | None = None,
        steps: int | None = None,
        out: Any = None,
        explain: bool = False,
    ) -> Any:
        path = out if out is not None else tmp_path / "failure.jsonl"
        machine = handoff_machine(model, out=path)
        phases = [p for p in settings().phases if explain or p is not Phase.explain]
        if explain and Phase.explain not in phases:
            phases.append(Phase.explain)
        overrides: dict[str, Any] = {"deadline": None, "phases": phases, "report_multiple_bugs": False}
        if examples is not None:
            overrides["max_examples"] = examples
        if steps is not None:
            overrides["stateful_step_count"] = steps
        run_state_machine_as_test(machine, settings=settings(settings(), **overrides))
        return machine.stats

    return fuzz
