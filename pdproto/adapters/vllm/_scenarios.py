"""Scripted runs of the vLLM adapter: the known behaviours, reproduced.

Each scenario is a family and a list of steps ``(kind, actor, args)``; the
run resets the adapter, applies the steps (each matched against what the
adapter offers, so a step the real engine does not allow fails loudly),
then drains to quiescence as the fuzzer does.  The histories they produce
are docs/examples/vllm-*.jsonl (:func:`write_examples` regenerates them;
tests/test_vllm_adapter.py checks they are up to date and judged as their
headers say).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from ...drivers import run_actions
from ...protocol import Action
from ...spec import INVARIANTS, Event, Monitor, write_history

__all__ = ["SCENARIOS", "Scenario", "run_scenario", "write_examples"]

Step = tuple[str, str, tuple]


def _p() -> Step:
    return ("step", "P0", ("P0",))


def _d() -> Step:
    return ("step", "D0", ("D0",))


SUBMIT: Step = ("submit", "client", ("r1",))
ABORT: Step = ("abort", "client", ("r1",))
COMPLETE: Step = ("complete", "net", ("r1", 0))
EXPIRE_LOST: Step = ("expire", "clock", ("heartbeats-lost",))


class Scenario:
    """A scripted run: ``family``, ``steps``, the header's ``description``,
    and how many ``requests`` the run offers (the drain submits those not
    submitted yet)."""

    def __init__(self, family: str, description: str, steps: Sequence[Step], requests: int = 1) -> None:
        self.family = family
        self.description = description
        self.steps = tuple(steps)
        self.requests = requests


#: name (the example's file stem) -> scenario
SCENARIOS: dict[str, Scenario] = {
    "vllm-clean-pull": Scenario(
        "pull",
        "vLLM's real scheduler and NIXL pull connector: one clean handoff (P prefills and keeps its "
        "blocks, D reserves and READs, finished_recving lets D decode, D's done notification frees P).",
        [SUBMIT],
    ),
    "vllm-clean-push": Scenario(
        "push",
        "vLLM's real scheduler and NIXL push connector: one clean handoff (D registers its blocks "
        "first, P prefills and WRITEs them, finished_sending frees P, finished_recving lets D decode).",
        [SUBMIT],
    ),
    "vllm-failed-read-fails-request": Scenario(
        "pull",
        "vLLM pull: D's READ fails. The worker reports failed_recving and the blocks as invalid; under "
        "kv_load_failure_policy 'fail' the scheduler fails the request and frees D's blocks; P, never "
        "told, frees its blocks when the lease runs out. Clean: no commit on the failed load (compare "
        "vllm-project/vllm#52234).",
        [SUBMIT, _p(), _p(), _d(), ("fail_transfer", "net", ("r1", 0))],
    ),
    "vllm-cancel-waiting-late-recving": Scenario(
        "pull",
        "vLLM pull: the client aborts while D waits in WAITING_FOR_REMOTE_KVS. D keeps its blocks "
        "(the READ may still write them) until the late finished_recving, then frees them: clean "
        "(compare vllm-project/vllm#32255, where an abort freed blocks of a load in flight).",
        [SUBMIT, _p(), _p(), _d(), ABORT, COMPLETE, _d(), _p()],
    ),
    "vllm-cancel-waiting-leak": Scenario(
        "pull",
        "vLLM pull: the client aborts while D waits in WAITING_FOR_REMOTE_KVS, and the READ's "
        "completion report (finished_recving) never comes: D holds the aborted request's blocks "
        "forever (leak).",
        [SUBMIT, _p(), _p(), _d(), ABORT, COMPLETE, ("lose", "net", ("D0", "read", "r1", 0))],
    ),
    "vllm-lease-early-source-free": Scenario(
        "pull",
        "vLLM pull: P's KV lease (kv_lease_duration) runs out while D's READ is still in flight "
        "(D stalled, heartbeats lost): P's worker reports finished_sending and the scheduler frees "
        "the source blocks D is reading (early-source-free; compare vllm-project/vllm#21570). The next "
        "request's prefill takes those blocks while the READ still runs.",
        [SUBMIT, _p(), _p(), _d(), EXPIRE_LOST, _p()],
        requests=2,
    ),
    "vllm-lease-before-read-foreign-block-access": Scenario(
        "pull",
        "vLLM pull: P's KV lease runs out before D's READ started (D stalled, heartbeats lost): P frees "
        "the blocks, and D's scheduler still READs remote_block_ids from them (foreign-block-access); "
        "P only logs 'Potentially invalid KV blocks for unrecognized request'.",
        [SUBMIT, _p(), _p(), EXPIRE_LOST, _p(), _d()],
    ),
    "vllm-lost-read-report-stuck": Scenario(
        "pull",
        "vLLM pull: the READ completes but its report to the scheduler is lost. D has no deadline of "
        "its own for a remote load, so the request waits in WAITING_FOR_REMOTE_KVS forever (stuck).",
        [SUBMIT, _p(), _p(), _d(), COMPLETE, ("lose", "net", ("D0", "read", "r1", 0))],
    ),
    "vllm-push-cancel-before-prefill-leak": Scenario(
        "push",
        "vLLM push: D registered its blocks and waits in WAITING_FOR_REMOTE_KVS; the client aborts "
        "before P prefilled. P never WRITEs, so no finished_recving ever comes and D holds the "
        "aborted request's blocks forever (leak).",
        [SUBMIT, _d(), ABORT],
    ),
    "vllm-push-cancel-resurrection": Scenario(
        "push",
        "vLLM push: the client aborts after P prefilled, while D waits. Nothing tells P's worker: it "
        "still matches D's registration and WRITEs the cancelled generation's KV into D's held "
        "blocks (resurrection), then both sides free.",
        [SUBMIT, _d(), _p(), ABORT, _p()],
    ),
    "vllm-push-write-failed-stuck": Scenario(
        "push",
        "vLLM push: P's WRITE fails. P keeps its blocks until the lease runs out; D hears nothing and "
        "has no deadline of its own, so the request waits in WAITING_FOR_REMOTE_KVS forever (stuck).",
        [SUBMIT, _d(), _p(), _p(), ("fail_transfer", "net", ("r1", 0))],
    ),
}


def _script(steps: Sequence[Step]):
    todo = list(steps)

    def choose(offered: Sequence[Action]) -> Action | None:
        if not todo:
            return None
        kind, actor, args = todo.pop(0)
        for action in offered:
            if (action.kind, action.actor, action.args) == (kind, actor, tuple(args)):
                return action
        raise ValueError(
            f"step {kind}{tuple(args)} by {actor} is not offered; offered: "
            + ", ".join(f"{a.kind}{a.args}" for a in offered)
        )

    return choose


def run_scenario(adapter: Any, name: str) -> tuple[Event, ...]:
    """Run scenario ``name`` on ``adapter`` (of the scenario's family) and
    return the events it produced, drain included."""
    scenario = SCENARIOS[name]
    if adapter.family != scenario.family:
        raise ValueError(f"scenario {name} needs a {scenario.family} adapter, not {adapter.family}")
    offered = adapter.requests
    adapter.requests = tuple(f"r{i + 1}" for i in range(scenario.requests))
    try:
        run = run_actions(adapter, _script(scenario.steps), ignore=frozenset(INVARIANTS))
    finally:
        adapter.requests = offered
    if not run.complete:
        raise RuntimeError(f"scenario {name} did not reach quiescence: {run.violation}")
    return tuple(run.events)


def expected(adapter: Any, events: Sequence[Event]) -> list[dict[str, Any]]:
    """The header's ``expect``: what the monitor reports on ``events``
    (``invariant``, ``line``, ``witness``; the header is line 1)."""
    monitor = Monitor.from_header(adapter.header, complete=True)
    for line, event in enumerate(events, start=2):
        monitor.feed(event, line)
    monitor.finish()
    return [
        {"invariant": v.invariant, "line": v.line, "witness": list(v.witness)} for v in monitor.violations
    ]


def history(adapter: Any, name: str, replay_expect: list | None = None) -> tuple[Any, tuple[Event, ...]]:
    """The header and events of scenario ``name``'s example."""

    events = run_scenario(adapter, name)
    extra = {
        "description": SCENARIOS[name].description,
        "expect": expected(adapter, events),
        "replay_expect": list(replay_expect or []),
    }
    return attrs.evolve(adapter.header, extra=extra), events


def write_examples(directory: str, adapters: dict[str, Any]) -> list[str]:
    """Write every scenario's history to ``directory``/NAME.jsonl with the
    adapter of its family (``adapters``: family -> adapter).  The header's
    ``expect`` is the monitor's verdict; ``replay_expect`` is what
    ``pdproto replay`` adds (its kv-corruption lines), computed when torch
    is there, else kept from the file being replaced."""
    import json

    paths = []
    for name, scenario in SCENARIOS.items():
        adapter = adapters[scenario.family]
        path = os.path.join(directory, f"{name}.jsonl")
        kept: list = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                kept = json.loads(fh.readline()).get("replay_expect", [])
        header, events = history(adapter, name, kept)
        write_history(path, events, header)
        try:
            from ...drivers import replay

            result = replay(path)
        except ImportError:
            paths.append(path)
            continue
        data = [
            {"invariant": "kv-corruption", "line": v.line}
            for v in result.violations
            if v.invariant == "kv-corruption"
        ]
        if data != kept:  # the header only changes: the scenario need not run again
            header = attrs.evolve(header, extra={**header.extra, "replay_expect": data})
            write_history(path, events, header)
        paths.append(path)
    return paths


if __name__ == "__main__":  # python -m pdproto.adapters.vllm._scenarios [DIR]
    import sys

    from ._adapter import VllmAdapter

    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "examples")
    pull = VllmAdapter("pull")
    push = VllmAdapter("push")
    try:
        for written in write_examples(target, {"pull": pull, "push": push}):
            print(written)
    finally:
        pull.close()
        push.close()
