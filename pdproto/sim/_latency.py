"""Batch step times for the simulator: a roofline and a piecewise-linear fit.

A *latency model* answers one question: how long does one engine step take
that prefills some tokens and decodes some sequences?  :meth:`step` takes

- ``prefill_tokens``: prompt tokens computed in the step (whole prompts or
  chunks), and ``prefill_sq``: the sum of the squares of the prefill lengths
  (causal attention grows with it; Vidur's sqrt(sum p_i^2) trick);
- ``decode_seqs``: sequences decoding one token each, and ``decode_ctx``: the
  sum of their context lengths (KV read per step);

and returns seconds.  Two models ship:

:class:`Roofline` (the default): compute and memory bounds of the step from
a model's parameter count and KV shape (the cost model's presets) and a
device spec (peak FLOP/s, HBM bandwidth), each derated by an efficiency,
plus a fixed per-step overhead.  Tensor parallelism divides both bounds and
adds a per-step collective cost.

:class:`PiecewiseLinear` (SplitwiseSim's form): step time interpolated
linearly in a table of (tokens, ms) points, one table for prefill (by
prefill tokens in the batch) and one for decode (by decoding sequences),
extrapolated along the last segment; a mixed step costs the sum.  Load one
from a CSV with :meth:`PiecewiseLinear.from_csv` (columns ``phase,tokens,ms``).
"""

from __future__ import annotations

import bisect
import csv
import os
from collections.abc import Mapping, Sequence

import attrs

from .._errors import UsageError
from ..cost import PRESETS, KVShape

__all__ = [
    "DeviceSpec",
    "ModelSpec",
    "DEVICES",
    "MODELS",
    "Roofline",
    "PiecewiseLinear",
    "model_spec",
    "device_spec",
]


def _positive(_i: object, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(attr.name, value, "a positive number")


def _fraction(_i: object, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UsageError(attr.name, value, "a number in (0, 1]")


def _non_negative(_i: object, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UsageError(attr.name, value, "a number >= 0")


@attrs.frozen
class DeviceSpec:
    """One accelerator: dense bf16 peak (TFLOP/s), HBM bandwidth (GB/s, 1e9
    B/s) and memory (GiB).  Numbers are the vendors' datasheet peaks."""

    name: str
    tflops: float = attrs.field(validator=_positive)
    hbm_gbps: float = attrs.field(validator=_positive)
    memory_gib: float = attrs.field(validator=_positive)


#: Datasheet peaks (dense bf16, no sparsity).
DEVICES: Mapping[str, DeviceSpec] = {
    "a100-80g": DeviceSpec("a100-80g", 312.0, 2039.0, 80.0),
    "h100-sxm": DeviceSpec("h100-sxm", 989.0, 3350.0, 80.0),
    "h200": DeviceSpec("h200", 989.0, 4800.0, 141.0),
}


@attrs.frozen
class ModelSpec:
    """What a step's cost needs of a model: active parameters (FLOPs per
    token), total parameters (weight bytes), hidden size (attention FLOPs)
    and the KV shape (KV bytes per token)."""

    name: str
    params: float = attrs.field(validator=_positive)  # active parameters per token
    hidden: int = attrs.field(validator=_positive)
    shape: KVShape
    total_params: float | None = None  # weights held (MoE: all experts); None = params
    weight_bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> float:
        return (self.total_params or self.params) * self.weight_bytes_per_param


#: The cost model's presets with their published parameter counts and hidden sizes.
MODELS: Mapping[str, ModelSpec] = {
    "teaching-gqa": ModelSpec("teaching-gqa", 8.0e9, 4096, PRESETS["teaching-gqa"]),
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 4096, PRESETS["llama-3-8b"]),
    "llama-3-70b": ModelSpec("llama-3-70b", 70.6e9, 8192, PRESETS["llama-3-70b"]),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.6e9, 3584, PRESETS["qwen2.5-7b"]),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 72.7e9, 8192, PRESETS["qwen2.5-72b"]),
    "deepseek-v3": ModelSpec(
        "deepseek-v3", 37e9, 7168, PRESETS["deepseek-v3"], total_params=671e9, weight_bytes_per_param=1
    ),
}


def model_spec(name: str) -> ModelSpec:
    """The :data:`MODELS` entry ``name`` (case-insensitive); UsageError otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise UsageError("model", name, f"one of {', '.join(MODELS)}")
    return MODELS[key]


def device_spec(name: str) -> DeviceSpec:
    """The :data:`DEVICES` entry ``name`` (case-insensitive); UsageError otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DEVICES:
        raise UsageError("device", name, f"one of {', '.join(DEVICES)}")
    return DEVICES[key]


@attrs.frozen
class Roofline:
    """Step time = max(FLOPs / (tp * peak * mfu), bytes / (tp * bw * mbu))
    + overhead + (tp > 1) * tp_comm per step.

    FLOPs: 2 * params per token computed, plus attention: 2 * layers * hidden
    * sum(p^2) for causal prefill and 4 * layers * hidden * sum(ctx) for
    decode.  Bytes: the weights once per step (sharded over tp), plus the KV
    every decoding sequence reads and every computed token writes.
    """

    model: ModelSpec
    device: DeviceSpec
    tp: int = attrs.field(default=1, kw_only=True)
    mfu: float = attrs.field(default=0.5, kw_only=True, validator=_fraction)
    mbu: float = attrs.field(default=0.7, kw_only=True, validator=_fraction)
    overhead_ms: float = attrs.field(default=0.5, kw_only=True, validator=_non_negative)
    tp_comm_ms: float = attrs.field(default=0.2, kw_only=True, validator=_non_negative)
    _flop_s: float = attrs.field(init=False, repr=False, eq=False)
    _byte_s: float = attrs.field(init=False, repr=False, eq=False)
    _fixed: float = attrs.field(init=False, repr=False, eq=False)
    _attn: float = attrs.field(init=False, repr=False, eq=False)
    _kv_tok: float = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if type(self.tp) is not int or self.tp < 1:
            raise UsageError("tp", self.tp, "an integer >= 1")
        weights_gib = self.model.weight_bytes / self.tp / 2**30
        if weights_gib >= self.device.memory_gib:
            raise UsageError(
                "tp",
                self.tp,
                f"a TP large enough for {self.model.name}'s {weights_gib * self.tp:.0f} GiB of "
                "weights to fit "
                f"{self.device.name}'s {self.device.memory_gib:g} GiB per device",
            )
        m = self.model
        object.__setattr__(self, "_flop_s", 1.0 / (self.tp * self.device.tflops * 1e12 * self.mfu))
        object.__setattr__(self, "_byte_s", 1.0 / (self.tp * self.device.hbm_gbps * 1e9 * self.mbu))
        object.__setattr__(
            self, "_fixed", (self.overhead_ms + (self.tp_comm_ms if self.tp > 1 else 0.0)) / 1e3
        )
        object.__setattr__(self, "_attn", 2.0 * m.shape.layers * m.hidden)
        object.__setattr__(self, "_kv_tok", float(m.shape.bytes_per_token))

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit beside the weights on ``tp`` devices using
        ``memory_fraction`` of their memory."""
        free = self.tp * self.device.memory_gib * 2**30 * memory_fraction - self.model.weight_bytes
        return max(0, int(free // self.model.shape.bytes_per_token))

    def step(self, prefill_tokens: int, prefill_sq: int, decode_seqs: int, decode_ctx: int) -> float:
        """Seconds one step takes (see the class docstring)."""
        tokens = prefill_tokens + decode_seqs
        flops = 2.0 * self.model.params * tokens + self._attn * (prefill_sq + 2 * decode_ctx)
        nbytes = self.model.weight_bytes + self._kv_tok * (decode_ctx + tokens)
        return max(flops * self._flop_s, nbytes * self._byte_s) + self._fixed

    def decode_ends(self, seqs: int, ctx: int, k: int, start: float) -> list[float]:
        """End times of ``k`` consecutive decode steps of ``seqs`` sequences
        from ``start``, the context growing by ``seqs`` each step: exactly
        what summing :meth:`step` gives (the same arithmetic), in one pass."""
        fs, bs, fixed, attn, kv = self._flop_s, self._byte_s, self._fixed, self._attn, self._kv_tok
        dense = 2.0 * self.model.params * seqs
        weights = self.model.weight_bytes
        out = []
        t = start
        for i in range(k):
            c = ctx + i * seqs
            x = (dense + attn * (0 + 2 * c)) * fs
            y = (weights + kv * (c + seqs)) * bs
            t += (x if x > y else y) + fixed
            out.append(t)
        return out


def _points(pts: Sequence[tuple[float, float]], what: str) -> tuple[tuple[float, float], ...]:
    out = sorted((float(x), float(y)) for x, y in pts)
    if not out:
        raise UsageError(what, pts, "at least one (tokens, ms) point")
    for x, y in out:
        if not (x >= 0 and y >= 0) or x != x or y != y:
            raise UsageError(what, (x, y), "points with tokens >= 0 and ms >= 0")
    for (x0, _), (x1, _) in zip(out, out[1:]):
        if x0 == x1:
            raise UsageError(what, x0, "distinct token counts (one point per count)")
    return tuple(out)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear interpolation in sorted ``xs``; extrapolates along the end segments."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = 0 if i < 0 else (len(xs) - 2 if i >= len(xs) - 1 else i)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@attrs.frozen
class PiecewiseLinear:
    """SplitwiseSim's form: ms = interp(prefill points, prefill tokens)
    + interp(decode points, decoding sequences) + decode_ctx_ms * sum(ctx)
    (``decode_ctx_ms``: ms per context token a decoding sequence reads).

    A phase with nothing to do costs nothing.  A single point (x, y) is the
    line through the origin.  Negative interpolated values clamp at 0.
    """

    prefill: tuple[tuple[float, float], ...] = attrs.field(converter=lambda p: _points(p, "prefill"))
    decode: tuple[tuple[float, float], ...] = attrs.field(converter=lambda p: _points(p, "decode"))
    decode_ctx_ms: float = attrs.field(default=0.0, kw_only=True, validator=_non_negative)
    _prefill_x: list = attrs.field(init=False, repr=False, eq=False)
    _prefill_y: list = attrs.field(init=False, repr=False, eq=False)
    _decode_x: list = attrs.field(init=False, repr=False, eq=False)
    _decode_y: list = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("prefill", "decode"):
            pts = getattr(self, name)
            object.__setattr__(self, f"_{name}_x", [p[0] for p in pts])
            object.__setattr__(self, f"_{name}_y", [p[1] for p in pts])

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> PiecewiseLinear:
        """Read a table with a header ``phase,tokens,ms`` (phase ``prefill`` or
        ``decode``; for decode, tokens = sequences in the batch) and optionally
        one row ``decode_ctx,TOKENS,MS`` (MS per TOKENS context tokens read)."""
        pts: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": [], "decode_ctx": []}
        try:
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError("latency table", str(path), f"a readable CSV file ({exc})") from None
        if not rows or [c.strip() for c in rows[0]] != ["phase", "tokens", "ms"]:
            raise UsageError("latency table", f"{path}:1", "a header line 'phase,tokens,ms'")
        for n, row in enumerate(rows[1:], start=2):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 3 or row[0].strip() not in pts:
                raise UsageError(
                    "latency table",
                    f"{path}:{n}: {','.join(row)}",
                    "a row 'prefill|decode|decode_ctx,TOKENS,MS'",
                )
            try:
                x, y = float(row[1]), float(row[2])
            except ValueError:
                raise UsageError(
                    "latency table", f"{path}:{n}: {','.join(row)}", "numbers in tokens and ms"
                ) from None
            pts[row[0].strip()].append((x, y))
        ctx = 0.0
        if pts["decode_ctx"]:
            if len(pts["decode_ctx"]) > 1 or pts["decode_ctx"][0][0] <= 0:
                raise UsageError(
                    "latency table",
                    f"{path}: {len(pts['decode_ctx'])} decode_ctx row(s)",
                    "at most one row 'decode_ctx,TOKENS,MS' with TOKENS > 0",
                )
            tokens, ms = pts["decode_ctx"][0]
            ctx = ms / tokens  # ms per context token read
        return cls(pts["prefill"], pts["decode"], decode_ctx_ms=ctx)

    def step(self, prefill_tokens: int, prefill_sq: int, decode_seqs: int, decode_ctx: int) -> float:
        ms = 0.0
        if prefill_tokens:
            ms += max(0.0, _interp(self._prefill_x, self._prefill_y, prefill_tokens))
        if decode_seqs:
            ms += max(0.0, _interp(self._decode_x, self._decode_y, decode_seqs))
            ms += self.decode_ctx_ms * decode_ctx
        return ms / 1e3

    def decode_ends(self, seqs: int, ctx: int, k: int, start: float) -> list[float]:
        """End times of ``k`` consecutive decode steps (see :meth:`Roofline.decode_ends`)."""
        out = []
        t = start
        for i in range(k):
            t += self.step(0, 0, seqs, ctx + i * seqs)
            out.append(t)
        return out
