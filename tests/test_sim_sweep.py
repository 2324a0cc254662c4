"""The P:D picker's library side: max_rate keeps the section 06 signals of its
answer, and splits enumerates every configuration of a budget."""

from __future__ import annotations

import pytest

from pdproto.sim import SimConfig
from pdproto.sim import SLO
from pdproto.sim import SweepRow, max_rate
from pdproto.sim import WorkloadSpec

SLOW_LINK = SimConfig(arm="pd", n_p=1, n_d=1, devices=2, bandwidth_gibps=1.0)
SPEC = WorkloadSpec.poisson(1.0, 2000, 20)


def test_max_rate_keeps_the_signals_of_the_probe_it_returns() -> None:
    row = max_rate(SPEC, SLOW_LINK, SLO.parse("ttft:500,tpot:50"), n=40, span=3.0)
    assert row.max_rate > 0
    assert [s["signal"] for s in row.signals] == [
        "p-queue-growing-d-idle", "d-kv-full-p-accepting", "transfer-queueing-growing", "pools-take-turns-idling"]
    fired = {s["signal"] for s in row.signals if s["fired"]}
    assert fired == {"transfer-queueing-growing"}  # 1 GiB/s for 2,000-token prompts
    assert row.to_dict()["signals"] == list(row.signals)


def test_colocated_rows_and_old_callers_have_no_signals() -> None:
    import attrs

    row = max_rate(SPEC, attrs.evolve(SLOW_LINK, arm="colocated"), SLO.parse("ttft:500"), n=40, span=3.0)
    assert row.signals == () and row.to_dict()["signals"] == []
    assert SweepRow(SLOW_LINK, 1.0, 1.0, 2).signals == ()  # the field has a default


def test_no_rate_meeting_the_target_keeps_no_signals() -> None:
    row = max_rate(SPEC, SLOW_LINK, SLO.parse("ttft:1"), n=20, span=1.0, max_probes=3)
    assert row.max_rate == 0 and row.signals == ()


def test_the_ratio_plot_draws_a_line_for_each_reference_arm(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from pdproto.sim import _plot

    figures = []
    monkeypatch.setattr(_plot, "_save", lambda plt, fig, path: figures.append(fig) or path)
    _plot.plot_goodput_vs_ratio([("pd 1P1D", 2.5), ("pd 2P1D", 3.3)], tmp_path / "r.png",
                                baselines=[("colocated 3x tp1", 2.0), ("chunked 3x tp1", 3.6)])
    _plot.plot_goodput_vs_ratio([("pd 1P1D", 2.5)], tmp_path / "r.png", baseline=("colocated 2x tp1", 2.0))
    lines = [[(line.get_label(), line.get_ydata()[0]) for line in fig.axes[0].get_lines()] for fig in figures]
    assert lines == [[("colocated 3x tp1", 2.0), ("chunked 3x tp1", 3.6)], [("colocated 2x tp1", 2.0)]]
    assert figures[0].axes[0].get_ylim()[1] >= 3.6  # a reference above every bar is in view


@pytest.mark.parametrize("budget", range(1, 9))
def test_splits_lists_every_configuration_of_the_budget_with_tp_per_role(budget: int) -> None:
    from pdproto.sim import splits

    tps = (1, 2)
    got = [(c.arm, c.tp) if c.arm != "pd" else ("pd", c.n_p, c.n_d, c.tp_p, c.tp_d)
           for c in splits(budget, SimConfig(), tps)]
    want = {(arm, tp) for arm in ("colocated", "chunked") for tp in tps if budget % tp == 0}
    want |= {("pd", n_p, n_d, tp_p, tp_d) for tp_p in tps for tp_d in tps
             for n_p in range(1, budget + 1) for n_d in range(1, budget + 1) if n_p * tp_p + n_d * tp_d == budget}
    assert len(got) == len(set(got)) and set(got) == want
    for c in splits(budget, SimConfig(), tps):
        assert c.devices == budget and c.used_devices == budget
    if budget == 5:  # the mixed splits are there: 1x2 + 3x1, 2x2 + 1x1, 1x1 + 2x2, 3x1 + 1x2
        assert {("pd", 1, 3, 2, 1), ("pd", 2, 1, 2, 1), ("pd", 1, 2, 1, 2), ("pd", 3, 1, 1, 2)} <= set(got)
