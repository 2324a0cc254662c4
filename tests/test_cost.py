"""The handoff cost model and ``pdproto cost``: the seed's numbers, exactly."""

from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET

import attrs
import pytest

from pdproto._cli import main
from pdproto.cost import (
    DTYPE_BYTES,
    GIB,
    MIB,
    PRESETS,
    CostModel,
    KVShape,
    Link,
    Timing,
    estimate,
    format_bytes,
)
from pdproto._errors import UsageError
from pdproto.cost import timeline_svg, write_plot

TEACHING = KVShape.gqa(32, 8, 128, "bf16")


def seed(**changes: object) -> CostModel:
    """The seed's worked example, with ``changes`` applied to its timing."""
    model = CostModel.seed_example()
    return attrs.evolve(model, timing=attrs.evolve(model.timing, **changes))


class TestKVSize:
    def test_seed_teaching_model_is_512_mib(self) -> None:
        """32 layers x 8 KV heads x 128 x 2 B x 4096 tokens, K and V = 512 MiB."""
        assert TEACHING.kv_bytes(4096) == 32 * 2 * 8 * 128 * 2 * 4096 == 512 * MIB

    def test_teaching_preset_is_the_seed_model(self) -> None:
        """The teaching preset is the seed's shape in bf16."""
        assert KVShape.from_preset("teaching-gqa") == TEACHING
        assert KVShape.from_preset("Teaching-GQA") == TEACHING

    def test_counts_kv_heads_not_attention_heads(self) -> None:
        """GQA: halving the KV heads halves the bytes, whatever the query heads."""
        assert KVShape.gqa(32, 4, 128).kv_bytes(4096) == 256 * MIB

    @pytest.mark.parametrize(("dtype", "nbytes"), sorted(DTYPE_BYTES.items()))
    def test_dtype_names(self, dtype: str, nbytes: int) -> None:
        """Each dtype name sets the bytes per element."""
        assert KVShape.gqa(32, 8, 128, dtype).kv_bytes(4096) == 256 * MIB * nbytes

    def test_dtype_as_bytes(self) -> None:
        """A dtype may also be given as a number of bytes."""
        assert KVShape.gqa(1, 1, 1, 3).bytes_per_element == 3
        assert KVShape.gqa(1, 1, 1, "4").bytes_per_element == 4

    def test_mla_latent_is_counted_once(self) -> None:
        """MLA stores one latent (512 + 64 rope) per token per layer, no separate V."""
        shape = KVShape.from_preset("deepseek-v3")
        assert shape.is_mla
        assert shape.bytes_per_token == 61 * 576 * 2
        assert shape.kv_bytes(4096) == 61 * 576 * 2 * 4096

    @pytest.mark.parametrize(
        ("name", "layers", "kv_heads", "head_dim"),
        [
            ("llama-3-8b", 32, 8, 128),
            ("llama-3-70b", 80, 8, 128),
            ("qwen2.5-7b", 28, 4, 128),
            ("qwen2.5-72b", 80, 8, 128),
        ],
    )
    def test_public_presets(self, name: str, layers: int, kv_heads: int, head_dim: int) -> None:
        """Presets carry the published config values."""
        assert PRESETS[name] == KVShape.gqa(layers, kv_heads, head_dim, "bf16")

    def test_repr_is_valid_python(self) -> None:
        """reprs evaluate back to an equal value."""
        model = CostModel.seed_example()
        assert (
            eval(repr(model), {"CostModel": CostModel, "KVShape": KVShape, "Link": Link, "Timing": Timing})
            == model
        )


class TestTensorParallel:
    @pytest.mark.parametrize(
        ("tp", "per_rank", "replicas"), [(1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1), (16, 1, 2), (32, 1, 4)]
    )
    def test_heads_split_then_replicate(self, tp: int, per_rank: int, replicas: int) -> None:
        """Heads split over TP until TP exceeds the KV head count; then they are replicated."""
        assert TEACHING.heads_per_rank(tp) == per_rank
        assert TEACHING.replicas(tp) == replicas
        assert TEACHING.rank_bytes(4096, tp) == 512 * MIB * per_rank // 8

    def test_rank_bytes_stop_shrinking_past_kv_heads(self) -> None:
        """TP 16 over 8 KV heads holds as much per rank as TP 8."""
        assert TEACHING.rank_bytes(4096, 16) == TEACHING.rank_bytes(4096, 8) == 64 * MIB

    def test_mla_latent_is_replicated(self) -> None:
        """Every rank holds the whole MLA latent."""
        shape = PRESETS["deepseek-v3"]
        assert shape.rank_bytes(4096, 8) == shape.kv_bytes(4096)
        assert shape.replicas(8) == 8

    def test_tp_must_fit_the_heads(self) -> None:
        """A TP that neither divides nor is a multiple of the KV heads is refused."""
        with pytest.raises(UsageError) as info:
            TEACHING.heads_per_rank(3)
        assert info.value.what == "tp" and info.value.value == 3
        assert "8" in info.value.allowed

    def test_shared_egress_does_not_shorten_the_bound(self) -> None:
        """Split over 4 ranks, one shared link: still bytes / total bandwidth."""
        one = attrs.evolve(CostModel.seed_example())
        shared = attrs.evolve(one, tp=4, links=1)
        assert shared.transfer_ms == one.transfer_ms == 20.0

    def test_independent_links_shorten_the_critical_path(self) -> None:
        """One link per rank: the critical path is one rank's bytes; two links: half the ranks each."""
        model = attrs.evolve(CostModel.seed_example(), tp=4, links=4)
        assert model.critical_bytes == 128 * MIB
        assert model.transfer_ms == 5.0
        assert attrs.evolve(model, links=2).transfer_ms == 10.0
        assert attrs.evolve(model, links=64).transfer_ms == 5.0


class TestTransfer:
    def test_seed_bounds(self) -> None:
        """512 MiB: 20 ms at 25 GiB/s, 62.5 ms at 8 GiB/s."""
        assert Link(25).transfer_ms(512 * MIB) == 20.0
        assert Link(8).transfer_ms(512 * MIB) == 62.5

    def test_latency_adds(self) -> None:
        """latency + bytes / bandwidth."""
        assert Link(1, latency_ms=1.5).transfer_ms(GIB) == 1001.5

    def test_default_latency_is_zero(self) -> None:
        """The seed ignores latency; so does the default."""
        assert Link(25).latency_ms == 0


class TestTimeline:
    def test_seed_colocated(self) -> None:
        """Colocated with J = 30: first token 70 ms, second 74 ms."""
        co = estimate(CostModel.seed_example()).colocated
        assert (co.ttft_ms, co.second_token_ms, co.first_gap_ms) == (70.0, 74.0, 4.0)
        assert co.token_ms == (70.0, 74.0, 78.0, 82.0)

    def test_seed_disaggregated(self) -> None:
        """Disaggregated: first token 40 ms, second 66 ms, first gap 26 ms."""
        dis = estimate(CostModel.seed_example()).disaggregated
        assert (dis.ttft_ms, dis.second_token_ms, dis.first_gap_ms) == (40.0, 66.0, 26.0)
        assert (dis.handoff_start_ms, dis.transfer_start_ms, dis.transfer_end_ms) == (40.0, 42.0, 62.0)
        assert dis.token_ms == (40.0, 66.0, 70.0, 74.0)

    def test_seed_without_wait(self) -> None:
        """With J = 0 the colocated second token comes at 44 ms; disaggregated stays at 66."""
        report = estimate(seed(wait_ms=0.0))
        assert report.colocated.second_token_ms == 44.0
        assert report.disaggregated.second_token_ms == 66.0

    def test_seed_break_even(self) -> None:
        """Break-even J is 22 ms: coordination 2 + transfer 20."""
        model = CostModel.seed_example()
        assert model.break_even_wait_ms == 22.0
        even = estimate(seed(wait_ms=22.0))
        assert even.colocated.second_token_ms == even.disaggregated.second_token_ms == 66.0

    def test_break_even_bandwidth(self) -> None:
        """For J = 30 the handoff fits at 0.5 GiB / 28 ms; at that bandwidth the second tokens meet."""
        model = CostModel.seed_example()
        bw = model.break_even_bandwidth_gibps()
        assert bw == pytest.approx(0.5 * 1000 / 28)
        at = estimate(attrs.evolve(model, link=Link(bw)))
        assert at.disaggregated.second_token_ms == pytest.approx(at.colocated.second_token_ms)

    def test_no_bandwidth_beats_a_tiny_wait(self) -> None:
        """If coordination alone exceeds J, no bandwidth breaks even."""
        assert CostModel.seed_example().break_even_bandwidth_gibps(1.0) is None

    def test_first_k_tokens(self) -> None:
        """Asking for K tokens times K tokens, one decode step apart."""
        dis = CostModel.seed_example().disaggregated(first_tokens=6)
        assert dis.token_ms == (40.0, 66.0, 70.0, 74.0, 78.0, 82.0)

    def test_spans_cover_the_request(self) -> None:
        """The colocated worker goes wait -> prefill -> decode; disaggregated P -> link -> D."""
        report = estimate(CostModel.seed_example(), first_tokens=2)
        assert [(s.kind, s.lane, s.start_ms, s.end_ms) for s in report.colocated.spans] == [
            ("wait", "worker", 0.0, 30.0),
            ("prefill", "worker", 30.0, 70.0),
            ("decode", "worker", 70.0, 74.0),
        ]
        assert [(s.kind, s.lane, s.start_ms, s.end_ms) for s in report.disaggregated.spans] == [
            ("prefill", "P", 0.0, 40.0),
            ("coordination", "link", 40.0, 42.0),
            ("transfer", "link", 42.0, 62.0),
            ("decode", "D", 62.0, 66.0),
        ]


class TestBadValues:
    @pytest.mark.parametrize(
        ("build", "what", "value"),
        [
            (lambda: KVShape.gqa(-1, 8, 128), "layers", -1),
            (lambda: KVShape.gqa(32, 0, 128), "kv_heads", 0),
            (lambda: KVShape.gqa(32, 8, 128, "fp4"), "dtype", "fp4"),
            (lambda: KVShape.from_preset("gpt-5"), "preset", "gpt-5"),
            (lambda: Link(0), "bandwidth_gibps", 0),
            (lambda: Link(float("nan")), "bandwidth_gibps", None),
            (lambda: Link(25, latency_ms=-1), "latency_ms", -1),
            (lambda: Timing(-40, 4), "prefill_ms", -40),
            (lambda: TEACHING.kv_bytes(0), "tokens", 0),
            (lambda: CostModel.seed_example().colocated(1), "first_tokens", 1),
        ],
    )
    def test_usage_error_names_the_value(self, build, what: str, value: object) -> None:
        """Each bad value raises UsageError carrying the field and the value."""
        with pytest.raises(UsageError) as info:
            build()
        assert info.value.what == what
        if value is not None:
            assert info.value.value == value
        assert info.value.allowed

    def test_usage_error_is_a_value_error(self) -> None:
        """Callers can catch ValueError."""
        with pytest.raises(ValueError):
            Link(-2)

    def test_mixed_gqa_and_mla_refused(self) -> None:
        """A shape is GQA or MLA, not both."""
        with pytest.raises(UsageError):
            KVShape(32, kv_heads=8, head_dim=128, latent_dim=512)
        with pytest.raises(UsageError):
            KVShape(32, kv_heads=8)


def test_format_bytes() -> None:
    """Binary units."""
    assert format_bytes(512 * MIB) == "512 MiB"
    assert format_bytes(3 * GIB // 2) == "1.5 GiB"
    assert format_bytes(128 * 1024) == "128 KiB"
    assert format_bytes(7) == "7 B"


# -- the command line --------------------------------------------------------


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["cost", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


class TestCli:
    def test_default_is_the_seed(self, capsys: pytest.CaptureFixture[str]) -> None:
        """No flags: the seed's worked example, as JSON."""
        data = run_json(capsys)
        assert data["kv_bytes"] == 512 * MIB
        assert data["kv_mib"] == 512
        assert data["transfer_ms"] == 20
        assert {k: data["colocated"][k] for k in ("ttft_ms", "second_token_ms", "first_gap_ms")} == {
            "ttft_ms": 70,
            "second_token_ms": 74,
            "first_gap_ms": 4,
        }
        assert {k: data["disaggregated"][k] for k in ("ttft_ms", "second_token_ms", "first_gap_ms")} == {
            "ttft_ms": 40,
            "second_token_ms": 66,
            "first_gap_ms": 26,
        }
        assert data["disaggregated"]["transfer_start_ms"] == 42
        assert data["disaggregated"]["transfer_end_ms"] == 62
        assert data["break_even_wait_ms"] == 22
        assert data["preset"] == "teaching-gqa"

    def test_explicit_shape_matches_the_preset(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--layers/--kv-heads/--head-dim/--dtype give the same 512 MiB."""
        data = run_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16")
        assert data["kv_bytes"] == 512 * MIB

    def test_slow_link_and_no_wait(self, capsys: pytest.CaptureFixture[str]) -> None:
        """8 GiB/s gives 62.5 ms; J = 0 gives the colocated second token at 44 ms."""
        assert run_json(capsys, "--bandwidth", "8")["transfer_ms"] == 62.5
        assert run_json(capsys, "--wait-ms", "0")["colocated"]["second_token_ms"] == 44

    def test_preset_with_dtype_override(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--dtype overrides a preset's element size."""
        data = run_json(capsys, "--preset", "llama-3-70b", "--dtype", "fp8", "--tokens", "1024")
        assert data["kv_bytes"] == 80 * 2 * 8 * 128 * 1 * 1024
        assert data["preset"] == "llama-3-70b (modified)"

    def test_tp_over_links(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--tp 16 over 8 KV heads: 64 MiB per rank; with 16 links, 2.5 ms."""
        data = run_json(capsys, "--tp", "16", "--links", "16")
        assert data["rank_bytes"] == 64 * MIB
        assert data["replicas"] == 2
        assert data["transfer_ms"] == 2.5

    def test_rich_report(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The text report shows sizes in binary units, both timelines and the break-even."""
        assert main(["cost"]) == 0
        out = capsys.readouterr().out
        for needle in (
            "512 MiB",
            "20 ms",
            "colocated",
            "disaggregated",
            "token 1 (TTFT)",
            "first generated gap",
            "42 → 62",
            "J = 22 ms",
            "17.857 GiB/s",
        ):
            assert needle in out, needle

    @pytest.mark.parametrize(
        ("argv", "needle"),
        [
            (["--layers", "-1"], "--layers: -1"),
            (["--tokens", "0"], "--tokens: 0"),
            (["--bandwidth", "0"], "--bandwidth: 0.0"),
            (["--latency-ms", "-3"], "--latency-ms: -3.0"),
            (["--wait-ms", "-1"], "--wait-ms: -1.0"),
            (["--preset", "gpt-9"], "--preset: 'gpt-9'"),
            (["--dtype", "fp4"], "--dtype: 'fp4'"),
            (["--tp", "3"], "--tp: 3"),
            (["--latent-dim", "512", "--kv-heads", "8"], "--latent-dim"),
            (["--plot", "timeline.gif"], "--plot: 'timeline.gif'"),
        ],
    )
    def test_bad_values_exit_2(
        self, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
    ) -> None:
        """Bad values give one clear error line naming the value, and exit 2."""
        assert main(["cost", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        err = " ".join(captured.err.split())
        assert err.startswith("pdproto cost: error:")
        assert needle in err
        assert "Traceback" not in err

    def test_unknown_flag_exits_2(self, capsys: pytest.CaptureFixture[str]) -> None:
        """argparse refuses unknown flags with exit 2."""
        assert main(["cost", "--bogus"]) == 2
        assert "--bogus" in capsys.readouterr().err


class TestPlot:
    def test_svg_shows_both_timelines(
        self, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--plot FILE.svg writes a well-formed SVG with both schemes and labelled events."""
        path = tmp_path / "timeline.svg"
        assert main(["cost", "--plot", str(path)]) == 0
        root = ET.parse(path).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
        for label in (
            "colocated: TTFT 70 ms, 2nd token 74 ms",
            "disaggregated: TTFT 40 ms, 2nd token 66 ms",
            "wait J 30 ms",
            "prefill 40 ms",
            "coord 2 ms",
            "KV transfer 20 ms",
            "token 1 (TTFT)",
            "first gap 26 ms",
            "decode 4 ms/step",
            "break-even J = 22 ms",
        ):
            assert label in text, label
        assert "wrote" in capsys.readouterr().out

    def test_svg_marks_every_token(self) -> None:
        """One numbered marker per token per scheme."""
        svg = timeline_svg(estimate(CostModel.seed_example(), first_tokens=3))
        root = ET.fromstring(svg)
        assert len(list(root.iter("{http://www.w3.org/2000/svg}circle"))) == 2 * 3 + 1  # + legend

    def test_png(self, tmp_path: pathlib.Path) -> None:
        """With matplotlib, .png writes a PNG image."""
        pytest.importorskip("matplotlib")
        path = write_plot(estimate(CostModel.seed_example()), tmp_path / "t.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_png_without_matplotlib(self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without matplotlib, .png is a UsageError pointing at the plot extra or .svg."""
        import builtins

        real_import = builtins.__import__

        def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
            if name.startswith("matplotlib"):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_matplotlib)
        with pytest.raises(UsageError) as info:
            write_plot(estimate(CostModel.seed_example()), tmp_path / "t.png")
        assert "pdproto[plot]" in info.value.allowed and ".svg" in info.value.allowed
        assert not (tmp_path / "t.png").exists()
