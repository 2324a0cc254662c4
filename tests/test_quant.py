"""fp8 KV quantization (pdproto.backends._quant): round trips within the
format's own precision, saturation, scale shapes, and what `close` catches."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from pdproto import UsageError  # noqa: E402
from pdproto.backends import _quant as Q  # noqa: E402

FP8 = ("float8_e4m3fn", "float8_e5m2")
POOL = (6, 4, 2, 2, 4, 8)  # blocks, block_size, layers, K/V, heads, head_dim (slot-major)
AXES = dict(block_axis=0, head_axis=4, keep_axes=(2, 3))


def _engine_values(shape, seed=0):
    """The replay engine's synthetic range: codes 1..125 in the first four
    head dims, hashed (k - 125) / 64 for k in 0..250 in the rest."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, 251, shape, generator=g).float() - 125) / 64
    x[..., :4] = torch.randint(1, 126, shape[:-1] + (4,), generator=g).float()
    return x


def test_formats_match_torch():
    e4, e5 = Q.FP8_FORMATS["float8_e4m3fn"], Q.FP8_FORMATS["float8_e5m2"]
    assert (e4.dtype, e4.max, e4.mantissa_bits, e4.min_normal, e4.min_subnormal) == (
        torch.float8_e4m3fn, 448.0, 3, 2.0**-6, 2.0**-9)
    assert (e5.dtype, e5.max, e5.mantissa_bits, e5.min_normal, e5.min_subnormal) == (
        torch.float8_e5m2, 57344.0, 2, 2.0**-14, 2.0**-16)
    assert Q.fp8_format(torch.float8_e5m2) is e5
    assert Q.tolerance("float8_e4m3fn") == 2.0**-4 and Q.tolerance("float8_e5m2") == 2.0**-3
    assert Q.tolerance("bfloat16") == 2.0**-8
    assert Q.grid("float8_e4m3fn")[-1] == 448 and Q.grid("float8_e5m2")[-1] == 57344
    for name in FP8:  # the poison byte is NaN in both formats
        assert torch.isnan(torch.tensor([Q.NAN_BYTE], dtype=torch.uint8).view(Q.FP8_FORMATS[name].dtype).float()).all()


def test_unknown_names_are_usage_errors():
    with pytest.raises(UsageError):
        Q.fp8_format("float8_e3m4")
    with pytest.raises(UsageError):
        Q.quantize(torch.ones(3), "float8_e4m3fn", "per-row")
    with pytest.raises(UsageError):
        Q.quantize(torch.ones(3, 2), "float8_e4m3fn", "per-block")  # no block axis named
    with pytest.raises(UsageError):
        Q.quantize(torch.ones(3, 2), "float8_e4m3fn", "per-head", head_axis=2)
    with pytest.raises(UsageError):
        Q.quantize(torch.ones(3, dtype=torch.int32), "float8_e4m3fn")


@pytest.mark.parametrize("name", FP8)
def test_grid_round_trips_exactly(name):
    g = Q.grid(name)
    q, s = Q.quantize(g, name, scale=1.0)
    assert torch.equal(Q.dequantize(q, s), g)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("granularity", Q.GRANULARITIES)
def test_random_round_trip_within_tolerance(name, granularity):
    g = torch.Generator().manual_seed(1)
    # magnitudes over many binades, so normals and subnormals both occur
    x = torch.randn(POOL, generator=g) * torch.exp2(torch.randint(-12, 12, POOL, generator=g).float())
    q, s = Q.quantize(x, name, granularity, **AXES)
    assert q.dtype == Q.FP8_FORMATS[name].dtype and q.shape == x.shape
    y = Q.dequantize(q, s)
    assert y.dtype == torch.float32
    assert Q.close(y, x, name, s).all()
    # the bound is tight: the worst relative error of normal values exceeds half of it
    normal = x.abs() >= Q.FP8_FORMATS[name].min_normal * s
    rel = ((y - x).abs() / x.abs())[normal].max().item()
    assert Q.tolerance(name) / 2 < rel <= Q.tolerance(name) * (1 + 2**-20)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("granularity", Q.GRANULARITIES)
def test_engine_value_range_round_trips(name, granularity):
    x = _engine_values(POOL).to(torch.bfloat16)  # the engine's values are exact in bf16
    q, s = Q.quantize(x, name, granularity, **AXES)
    y = Q.dequantize(q, s)
    assert Q.close(y, x, name, s).all()
    assert not torch.isnan(y).any() and torch.isfinite(y).all()
    assert y.abs().max() == x.float().abs().max()  # amax maps to fmax and back exactly


def test_scale_shapes():
    assert Q.scale_shape(POOL, "per-tensor", **AXES) == (1, 1, 2, 2, 1, 1)
    assert Q.scale_shape(POOL, "per-block", **AXES) == (6, 1, 2, 2, 1, 1)
    assert Q.scale_shape(POOL, "per-head", **AXES) == (1, 1, 2, 2, 4, 1)
    assert Q.scale_shape(POOL, "per-tensor") == (1,) * 6
    assert Q.scale_shape((3, 5), "per-block", block_axis=-2) == (3, 1)
    x = _engine_values(POOL)
    for gran in Q.GRANULARITIES:
        q, s = Q.quantize(x, "float8_e4m3fn", gran, **AXES)
        assert tuple(s.shape) == Q.scale_shape(POOL, gran, **AXES) and s.dtype == torch.float32


def test_per_block_scales_follow_each_block():
    x = torch.ones(3, 4)
    x[1] *= 1000.0
    x[2] *= 0.001
    q, s = Q.quantize(x, "float8_e4m3fn", "per-block", block_axis=0)
    assert torch.allclose(s.flatten(), torch.tensor([1.0, 1000.0, 0.001]) / 448)
    assert torch.equal(q.float(), torch.full((3, 4), 448.0))
    # per-tensor, the small block falls below the format's range and is lost
    q, s = Q.quantize(x, "float8_e4m3fn", "per-tensor")
    assert (Q.dequantize(q, s)[2] == 0).all()


def test_per_head_scales_follow_each_head():
    x = torch.ones(2, 3, 4)
    x[:, 1] = -7.0
    q, s = Q.quantize(x, "float8_e5m2", "per-head", head_axis=1)
    assert s.shape == (1, 3, 1) and torch.allclose(s.flatten(), torch.tensor([1.0, 7.0, 1.0]) / 57344)
    assert torch.equal(Q.dequantize(q, s), x)


@pytest.mark.parametrize("name", FP8)
def test_saturation_gives_no_inf_or_nan(name):
    fmax = Q.FP8_FORMATS[name].max
    x = torch.tensor([1.0, 3.0, -1e30, float("inf"), float("-inf"), 0.0])
    q, s = Q.quantize(x, name, scale=1.0 / fmax)  # static scale for |x| <= 1
    y = Q.dequantize(q, s)
    assert torch.isfinite(y).all()
    assert y.tolist() == [1.0, 1.0, -1.0, 1.0, -1.0, 0.0]
    assert Q.close(y, x, name, s).tolist() == [True, False, False, False, False, True]
    # amax scaling ignores the infinities and saturates them too
    q, s = Q.quantize(x, name)
    assert s.item() == pytest.approx(1e30 / fmax) and torch.isfinite(Q.dequantize(q, s)).all()


@pytest.mark.parametrize("name", FP8)
def test_nan_stays_nan_and_is_never_close(name):
    x = torch.tensor([1.0, float("nan"), 2.0])
    q, s = Q.quantize(x, name)
    y = Q.dequantize(q, s)
    assert torch.isnan(y[1]) and s.item() == pytest.approx(2.0 / Q.FP8_FORMATS[name].max)
    assert Q.close(y, torch.tensor([1.0, 1.0, 2.0]), name, s).tolist() == [True, False, True]


def test_all_zero_group_gets_scale_one():
    q, s = Q.quantize(torch.zeros(2, 3), "float8_e4m3fn", "per-block", block_axis=0)
    assert s.flatten().tolist() == [1.0, 1.0] and (Q.dequantize(q, s) == 0).all()


@pytest.mark.parametrize("name", FP8)
def test_a_wrong_scale_is_detected(name):
    x = _engine_values(POOL)
    q, s = Q.quantize(x, name, "per-block", **AXES)
    assert Q.close(Q.dequantize(q, s), x, name, s).all()
    # another block's scale, or a scale off by 2 or by 1.25, misreads the data
    wrong = s.roll(1, dims=0)
    assert not Q.close(Q.dequantize(q, wrong), x, name, wrong).all()
    for factor in (2.0, 1.25):
        assert not Q.close(Q.dequantize(q, s * factor), x, name, s * factor).all()
    # a static scale too small saturates, and that is caught too
    q2, s2 = Q.quantize(x, name, scale=s / 2)
    assert not Q.close(Q.dequantize(q2, s2), x, name, s2).all()


def test_e4m3_is_finer_than_e5m2():
    x = torch.linspace(1.0, 2.0, 1001)
    err = {}
    for name in FP8:
        y = Q.round_trip(x, name, scale=1.0)
        err[name] = ((y - x).abs() / x).max().item()
    # the worst case is half a step above 1: u / (1 + u) with u = 2**-(mantissa bits + 1)
    assert err["float8_e4m3fn"] == pytest.approx(2.0**-4 / (1 + 2.0**-4), rel=0.01)
    assert err["float8_e5m2"] == pytest.approx(2.0**-3 / (1 + 2.0**-3), rel=0.01)
    # within e5m2's tolerance, not within e4m3's
    y5 = Q.round_trip(x, "float8_e5m2", scale=1.0)
    assert Q.close(y5, x, "float8_e5m2").all() and not Q.close(y5, x, "float8_e4m3fn").all()


@pytest.mark.parametrize("name", FP8)
def test_subnormals_need_the_absolute_slack(name):
    fmt = Q.FP8_FORMATS[name]
    x = torch.tensor([fmt.min_subnormal * 0.6, fmt.min_subnormal * 2.4])  # round to 1 and 2 subnormals
    y = Q.round_trip(x, name, scale=1.0)
    assert y.tolist() == [fmt.min_subnormal, 2 * fmt.min_subnormal]
    assert Q.close(y, x, name).all()
    assert ((y - x).abs() > Q.tolerance(name) * x.abs()).all()  # relative bound alone would fail


def test_fp8_pools_on_the_cpu_take_byte_copies():
    q, _ = Q.quantize(_engine_values((4, 8)), "float8_e4m3fn")
    pool = torch.zeros(6, 8, dtype=torch.float8_e4m3fn)
    pool.view(torch.uint8).index_copy_(0, torch.tensor([1, 4, 2, 0]), q.view(torch.uint8))
    assert torch.equal(pool[torch.tensor([1, 4, 2, 0])].view(torch.uint8), q.view(torch.uint8))
    pool.view(torch.uint8).index_fill_(0, torch.tensor([3]), Q.NAN_BYTE)
    assert torch.isnan(pool[3].float()).all()


def test_import_pdproto_does_not_import_torch():
    code = "import sys, pdproto, pdproto.backends; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
