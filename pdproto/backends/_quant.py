"""fp8 KV quantization for the torch replay backend (imports torch).

Loaded lazily, like :mod:`pdproto.backends._torch`: ``import pdproto`` does
not import this module.

Formats (format v1.1 header ``kv.dtype``): ``"float8_e4m3fn"`` (3 mantissa
bits, largest finite value 448, no infinities) and ``"float8_e5m2"`` (2
mantissa bits, largest finite value 57344).  :data:`FP8_FORMATS` describes
them.

Scaling is amax scaling: ``scale = amax(|x|) / fmax`` over the elements that
share a scale, ``q = fp8(clamp(x / scale, -fmax, fmax))`` (round to nearest
even), and ``dequantize(q, scale) = float32(q) * scale``.  So the largest
element of each group lands on the format's largest finite value, and a value
past it (a static scale that is too small, or ``±inf``) *saturates* to
``±fmax * scale`` instead of becoming ``inf`` or ``nan``.  A ``nan`` in ``x``
stays ``nan`` (poison survives quantization).

Granularity (header ``kv.scale``, :data:`GRANULARITIES`) says which elements
share a scale.  The caller names the axes of ``x``:

- ``"per-tensor"``: one scale for all of ``x`` (except ``keep_axes``);
- ``"per-block"``: one scale per index of ``block_axis`` (a paged block);
- ``"per-head"``: one scale per index of ``head_axis`` (a KV head);

and ``keep_axes`` are axes that always get their own scale, whatever the
granularity (for example the layer axis and the K/V axis of a pool, since an
engine keeps each layer's K and V cache as separate tensors).  The scale has
``x.ndim`` dimensions: the size of ``x`` along the axes it varies on, 1
elsewhere, so ``q.float() * scale`` broadcasts.  :func:`scale_shape` gives
that shape before any data exists (to allocate scales next to a pool).

For the replay backend's slot-major pool ``[blocks, block_size, layers, 2,
heads, head_dim]``::

    axes = dict(block_axis=0, head_axis=4, keep_axes=(2, 3))
    q, s = quantize(x, "float8_e4m3fn", "per-block", **axes)   # s: [blocks, 1, layers, 2, 1, 1]
    q, s = quantize(x, "float8_e4m3fn", "per-head", **axes)    # s: [1, 1, layers, 2, heads, 1]
    ok = close(dequantize(q, s), x, "float8_e4m3fn", s)        # elementwise bool

CPU notes (torch 2.13): casts to and from both fp8 dtypes work, and so do
``copy_``, slicing, ``index_select``, ``clone``, ``==`` and ``isnan``;
``index_copy_`` and ``index_fill_`` are not implemented for fp8 on CPU:
use them on ``q.view(torch.uint8)`` (a byte copy is exact).  The byte
:data:`NAN_BYTE` (0x7F) is a NaN in both formats (poison).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from .._errors import UsageError

__all__ = [
    "FP8_FORMATS",
    "GRANULARITIES",
    "NAN_BYTE",
    "Fp8Format",
    "fp8_format",
    "scale_axes",
    "scale_shape",
    "scale_for",
    "quantize",
    "dequantize",
    "round_trip",
    "tolerance",
    "abs_slack",
    "close",
    "grid",
]

#: Scale granularities, the names of the header's ``kv.scale``.
GRANULARITIES = ("per-tensor", "per-block", "per-head")

#: A byte that is NaN in both fp8 formats (write it through ``view(torch.uint8)``).
NAN_BYTE = 0x7F

#: float32 arithmetic in ``x / scale`` and ``q * scale`` adds at most a few
#: units of 2**-24 relative error on top of the fp8 rounding.
_F32_SLACK = 2.0**-21


@attrs.frozen
class Fp8Format:
    """One fp8 format: its canonical ``name``, torch ``dtype``, ``max`` (the
    largest finite value), ``mantissa_bits``, ``min_normal`` (the smallest
    positive normal value) and ``min_subnormal`` (the smallest positive
    value, the spacing of the subnormals)."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal: float
    min_subnormal: float

    @property
    def tolerance(self) -> float:
        """Relative error bound of one round-to-nearest: ``2**-(mantissa_bits+1)``."""
        return 2.0 ** -(self.mantissa_bits + 1)


def _format(name: str, dtype: torch.dtype) -> Fp8Format:
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    return Fp8Format(
        name, dtype, float(info.max), mantissa, float(info.tiny), float(info.tiny) * float(info.eps)
    )


#: Canonical fp8 dtype name -> :class:`Fp8Format`.
FP8_FORMATS: Mapping[str, Fp8Format] = {
    "float8_e4m3fn": _format("float8_e4m3fn", torch.float8_e4m3fn),
    "float8_e5m2": _format("float8_e5m2", torch.float8_e5m2),
}

#: The precision of the non-fp8 KV dtypes (2**-(mantissa bits + 1)), for
#: :func:`tolerance` and :func:`close` on a pool that is not quantized.
_WIDE = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
_WIDE_TINY = {"bfloat16": 2.0**-133, "float16": 2.0**-24, "float32": 2.0**-149, "float64": 0.0}


def fp8_format(dtype: str | torch.dtype | Fp8Format) -> Fp8Format:
    """The :class:`Fp8Format` of a canonical name, a torch fp8 dtype, or a
    format; a :class:`~pdproto.UsageError` for anything else."""
    if isinstance(dtype, Fp8Format):
        return dtype
    if isinstance(dtype, str) and dtype in FP8_FORMATS:
        return FP8_FORMATS[dtype]
    for fmt in FP8_FORMATS.values():
        if dtype is fmt.dtype:
            return fmt
    raise UsageError("fp8 dtype", dtype, "one of " + ", ".join(FP8_FORMATS))


def _axes(ndim: int, axes: Iterable[int], what: str) -> set[int]:
    out = set()
    for a in axes:
        if type(a) is not int or not -ndim <= a < ndim:
            raise UsageError(what, a, f"an axis in [{-ndim}, {ndim})")
        out.add(a % ndim)
    return out


def scale_axes(
    ndim: int,
    granularity: str,
    *,
    block_axis: int | None = None,
    head_axis: int | None = None,
    keep_axes: Iterable[int] = (),
) -> tuple[int, ...]:
    """The axes (non-negative, sorted) of an ``ndim``-dimensional tensor along
    which the scale varies: ``keep_axes``, plus ``block_axis`` for
    ``"per-block"`` or ``head_axis`` for ``"per-head"`` (required then)."""
    if granularity not in GRANULARITIES:
        raise UsageError("scale", granularity, "one of " + ", ".join(GRANULARITIES))
    kept = _axes(ndim, keep_axes, "keep_axes")
    if granularity == "per-block":
        if block_axis is None:
            raise UsageError("block_axis", None, "the axis of the blocks (per-block scales)")
        kept |= _axes(ndim, (block_axis,), "block_axis")
    elif granularity == "per-head":
        if head_axis is None:
            raise UsageError("head_axis", None, "the axis of the KV heads (per-head scales)")
        kept |= _axes(ndim, (head_axis,), "head_axis")
    return tuple(sorted(kept))


def scale_shape(
    shape: Iterable[int],
    granularity: str,
    *,
    block_axis: int | None = None,
    head_axis: int | None = None,
    keep_axes: Iterable[int] = (),
) -> tuple[int, ...]:
    """The shape of the scale of a tensor of ``shape`` (see :func:`scale_axes`):
    its size along the axes the scale varies on, 1 elsewhere.  E.g. a pool
    ``[blocks, bs, layers, 2, heads, hd]`` per-block with ``block_axis=0,
    keep_axes=(2, 3)``: ``[blocks, 1, layers, 2, 1, 1]``."""
    shape = tuple(shape)
    kept = scale_axes(
        len(shape), granularity, block_axis=block_axis, head_axis=head_axis, keep_axes=keep_axes
    )
    return tuple(n if i in kept else 1 for i, n in enumerate(shape))


def scale_for(amax: torch.Tensor | float, dtype: str | torch.dtype) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto the format's largest finite
    value (``amax / fmax``); 1.0 where ``amax`` is 0 or not finite.  For static
    scales: ``scale_for(largest value that will ever be stored, dtype)``."""
    fmt = fp8_format(dtype)
    a = torch.as_tensor(amax, dtype=torch.float32)
    s = a / fmt.max
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


def quantize(
    x: torch.Tensor,
    dtype: str | torch.dtype,
    granularity: str = "per-tensor",
    *,
    block_axis: int | None = None,
    head_axis: int | None = None,
    keep_axes: Iterable[int] = (),
    scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the float tensor ``x`` to fp8: returns ``(q, scale)``.

    ``q`` has ``x``'s shape and the fp8 ``dtype`` (a name of
    :data:`FP8_FORMATS` or the torch dtype); ``scale`` is float32 with
    ``x.ndim`` dimensions, shaped by ``granularity`` and the axes (see
    :func:`scale_shape`), on ``x``'s device.  With ``scale=None`` the scale is
    computed (amax of the finite values of each group / fmax); a given
    ``scale`` (anything that broadcasts against ``x``, e.g. a static or a
    deliberately wrong one) is used as it is, and the axes are then only used
    to check nothing.  Values beyond ``±fmax * scale`` saturate; ``nan``
    stays ``nan``.
    """
    fmt = fp8_format(dtype)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise UsageError(
            "x", type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype, "a floating-point tensor"
        )
    xf = x.float()
    if scale is None:
        kept = scale_axes(
            xf.ndim, granularity, block_axis=block_axis, head_axis=head_axis, keep_axes=keep_axes
        )
        reduce = [i for i in range(xf.ndim) if i not in kept]
        mag = xf.abs().nan_to_num_(nan=0.0, posinf=0.0)  # amax of the finite values
        amax = mag.amax(dim=reduce, keepdim=True) if reduce else mag
        s = scale_for(amax, fmt)
    else:
        s = torch.as_tensor(scale, dtype=torch.float32, device=xf.device)
        if s.ndim < xf.ndim:
            s = s.reshape((1,) * (xf.ndim - s.ndim) + tuple(s.shape))
    q = (xf / s).clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``float32(q) * scale`` (``scale`` broadcasts against ``q``)."""
    return q.float() * torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def round_trip(
    x: torch.Tensor, dtype: str | torch.dtype, granularity: str = "per-tensor", **axes: Any
) -> torch.Tensor:
    """``dequantize(*quantize(x, dtype, granularity, **axes))``: what reading
    ``x`` back from an fp8 pool gives."""
    return dequantize(*quantize(x, dtype, granularity, **axes))


def tolerance(dtype: str | torch.dtype) -> float:
    """The relative precision of one round-to-nearest in ``dtype``:
    ``2**-(mantissa bits + 1)``.  ``float8_e4m3fn``: 2**-4; ``float8_e5m2``:
    2**-3.  Also answers for ``bfloat16`` (2**-8), ``float16`` (2**-11),
    ``float32`` and ``float64``."""
    if isinstance(dtype, str) and dtype in _WIDE:
        return _WIDE[dtype]
    return fp8_format(dtype).tolerance


def abs_slack(dtype: str | torch.dtype) -> float:
    """The absolute error bound (before scaling) of one rounding near zero:
    half the smallest subnormal (``float8_e4m3fn``: 2**-10, ``float8_e5m2``:
    2**-17)."""
    if isinstance(dtype, str) and dtype in _WIDE_TINY:
        return _WIDE_TINY[dtype] / 2
    return fp8_format(dtype).min_subnormal / 2


def close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: str | torch.dtype,
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Elementwise: is the dequantized ``actual`` what one rounding of
    ``expected`` in ``dtype`` with ``scale`` can give?

    ``|actual - expected| <= tolerance(dtype) * |expected| + abs_slack(dtype) *
    scale`` (plus float32 slack).  ``nan`` is never close, nor is anything to
    an infinite ``expected`` (fp8 KV saturates); a value that
    saturated, or that was dequantized with another scale than it was
    quantized with, is not close.  Returns a bool tensor of the broadcast
    shape; ``bool(close(...).all())`` for one answer.
    """
    a = actual.float()
    e = expected.to(device=a.device, dtype=torch.float32)
    s = torch.as_tensor(scale, dtype=torch.float32, device=a.device).abs()
    bound = e.abs().mul_(tolerance(dtype) + _F32_SLACK).add_(s * (abs_slack(dtype) * (1 + _F32_SLACK)))
    bound.nan_to_num_(nan=-1.0, posinf=-1.0)  # nothing is close to an infinite or nan expected
    return torch.sub(a, e).abs_() <= bound  # a nan in actual compares False


def grid(dtype: str | torch.dtype) -> torch.Tensor:
    """Every non-negative finite value of the fp8 format, ascending, as
    float32 (values on it round-trip exactly with scale 1)."""
    fmt = fp8_format(dtype)
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)]
    return torch.unique(vals)  # sorted; +0 and -0 are one
