"""The cost of one P->D KV handoff: bytes moved, a time lower bound, a timeline.

Three small frozen values hold the inputs: :class:`KVShape` (what one token's
KV weighs, GQA or MLA), :class:`Link` (an effective path: bandwidth and
latency) and :class:`Timing` (prefill, one decode step, handoff coordination
and the colocated extra wait J).  :class:`CostModel` joins them with a token
count and a tensor-parallel split, and :func:`estimate` turns a model into a
:class:`CostReport`: the KV size, the transfer bound, one :class:`Timeline`
per scheme (colocated and disaggregated) and the break-even values.

Conventions follow section 05 of the seed: P returns the first token; the
whole KV is handed over after prefill (no layer-wise pipelining); the handoff
is coordination then bytes; the colocated J happens before P starts; the
disaggregated side has no extra queueing.  Units are binary: MiB = 2**20
bytes, GiB/s = 2**30 bytes per second; times are milliseconds.

Everything here is a byte *lower bound*: compression, protocol overhead,
queueing, layout conversion and contention are left out (docs/cost-model.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .._errors import UsageError

__all__ = [
    "DTYPE_BYTES",
    "GIB",
    "MAX_SIZE",
    "MAX_TOKENS",
    "MAX_MS",
    "MIN_BANDWIDTH_GIBPS",
    "MAX_FIRST_TOKENS",
    "MIB",
    "PRESETS",
    "CostModel",
    "CostReport",
    "KVShape",
    "Link",
    "Span",
    "Timeline",
    "Timing",
    "estimate",
    "format_bytes",
]

#: One mebibyte, 2**20 bytes.
MIB = 2**20
#: One gibibyte, 2**30 bytes; bandwidths are in GiB/s.
GIB = 2**30

#: Bytes per element of the KV cache for each dtype name accepted.
DTYPE_BYTES: Mapping[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

# Bounds.  Far beyond any real model, they keep every product of sizes and
# every time a finite float, so no input can make the arithmetic overflow
# or turn to NaN.
#: The largest layer, head, dimension, byte, TP and link count.
MAX_SIZE = 2**20
#: The most tokens one handoff may carry.
MAX_TOKENS = 2**40
#: The longest time, in ms (about 31 years).
MAX_MS = 1e12
#: The smallest bandwidth, GiB/s (about 1 byte/s), and the largest.
MIN_BANDWIDTH_GIBPS = 1e-9
MAX_BANDWIDTH_GIBPS = 1e12
#: The most tokens one timeline reports.
MAX_FIRST_TOKENS = 10_000


# -- validators -------------------------------------------------------------
# They raise UsageError (a ValueError) naming the field, the value and what
# fits, so the command line can print one line and exit 2.


def _positive_int(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 1:
        raise UsageError(attr.name, _shown(value), "a positive integer")
    if value > MAX_SIZE:
        raise UsageError(attr.name, _shown(value), f"a positive integer <= {MAX_SIZE:,}")


def _shown(value: object) -> object:
    """``value`` for a message: a huge integer shortened."""
    if type(value) is int and abs(value) >= 10**30:
        return f"~10**{len(str(abs(value))) - 1}"
    return value


def _optional_positive_int(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_int(_inst, attr, value)


def _number(
    low: float, high: float, low_inclusive: bool
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    allowed = f"a finite number {'>=' if low_inclusive else '>'} {low:g} and <= {high:g}"
    if low == MIN_BANDWIDTH_GIBPS:
        allowed = f"a number from {low:g} to {high:g}"

    def check(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
        ok = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
        if ok and (value >= low if low_inclusive else value > low) and value <= high:  # type: ignore[operator]
            return
        raise UsageError(attr.name, _shown(value), allowed)

    return check


_bandwidth = _number(MIN_BANDWIDTH_GIBPS, MAX_BANDWIDTH_GIBPS, low_inclusive=True)
_non_negative = _number(0.0, MAX_MS, low_inclusive=True)


def _bytes_per_element(dtype: str | int) -> int:
    """Bytes per element for a dtype name or a positive integer."""
    if type(dtype) is int:
        if dtype >= 1:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in DTYPE_BYTES:
            return DTYPE_BYTES[key]
        if key.isascii() and key.isdigit() and len(key) < 10 and int(key) >= 1:
            return int(key)
    raise UsageError("dtype", dtype, f"one of {', '.join(DTYPE_BYTES)} or a positive number of bytes")


# -- the shape of the KV ----------------------------------------------------


@attrs.frozen
class KVShape:
    """What the KV cache of one model holds per token.

    Either GQA/MHA style (``kv_heads`` and ``head_dim`` set; K and V are both
    stored, so one token weighs ``layers * 2 * kv_heads * head_dim`` elements)
    or MLA style (``latent_dim`` set; one compressed latent per token per
    layer, the decoupled RoPE key included, ``layers * latent_dim`` elements).
    Count KV heads, not attention heads: GQA shares each KV head between
    several query heads.

    Use :meth:`gqa`, :meth:`mla` or :meth:`from_preset` rather than the
    constructor.

    Raises:
        UsageError: a size that is not a positive integer, or a mix of the
            GQA and MLA fields.
    """

    layers: int = attrs.field(validator=_positive_int)
    kv_heads: int | None = attrs.field(default=None, validator=_optional_positive_int)
    head_dim: int | None = attrs.field(default=None, validator=_optional_positive_int)
    latent_dim: int | None = attrs.field(default=None, validator=_optional_positive_int)
    bytes_per_element: int = attrs.field(default=2, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        gqa = self.kv_heads is not None and self.head_dim is not None
        only_one = (self.kv_heads is None) != (self.head_dim is None)
        if only_one or gqa == (self.latent_dim is not None):
            raise UsageError(
                "KV shape",
                {"kv_heads": self.kv_heads, "head_dim": self.head_dim, "latent_dim": self.latent_dim},
                "kv_heads and head_dim (GQA), or latent_dim alone (MLA)",
            )

    @classmethod
    def gqa(cls, layers: int, kv_heads: int, head_dim: int, dtype: str | int = "bf16") -> KVShape:
        """A GQA/MHA shape; ``dtype`` is a name from :data:`DTYPE_BYTES` or bytes per element."""
        return cls(layers, kv_heads=kv_heads, head_dim=head_dim, bytes_per_element=_bytes_per_element(dtype))

    @classmethod
    def mla(cls, layers: int, latent_dim: int, dtype: str | int = "bf16") -> KVShape:
        """An MLA shape: ``latent_dim`` elements per token per layer (latent + RoPE key)."""
        return cls(layers, latent_dim=latent_dim, bytes_per_element=_bytes_per_element(dtype))

    @classmethod
    def from_preset(cls, name: str) -> KVShape:
        """The shape of a named preset (see :data:`PRESETS`), case-insensitive.

        Raises:
            UsageError: ``name`` is not a preset.
        """
        key = name.strip().lower() if isinstance(name, str) else name
        try:
            return PRESETS[key]
        except (KeyError, TypeError):
            raise UsageError("preset", name, f"one of {', '.join(PRESETS)}") from None

    def with_dtype(self, dtype: str | int) -> KVShape:
        """The same shape stored in another dtype."""
        return attrs.evolve(self, bytes_per_element=_bytes_per_element(dtype))

    @property
    def is_mla(self) -> bool:
        """True for an MLA (latent) shape."""
        return self.latent_dim is not None

    @property
    def elements_per_token(self) -> int:
        """KV elements stored per token, all layers, K and V (or the latent)."""
        if self.latent_dim is not None:
            return self.layers * self.latent_dim
        assert self.kv_heads is not None and self.head_dim is not None
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token."""
        return self.elements_per_token * self.bytes_per_element

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the full KV of ``tokens`` positions (one copy, no replicas)."""
        _check_tokens(tokens)
        return self.bytes_per_token * tokens

    def heads_per_rank(self, tp: int) -> int:
        """KV heads each rank holds under tensor parallelism ``tp``.

        Heads are split when ``tp`` divides the KV head count; when ``tp``
        exceeds it, each head is replicated over ``tp // kv_heads`` ranks and
        every rank still holds one whole head.  An MLA latent is not split by
        head: every rank holds all of it (returned as 1).

        Raises:
            UsageError: ``tp`` neither divides nor is a multiple of the KV head count.
        """
        _check_tp(tp)
        if self.kv_heads is None:
            return 1
        if self.kv_heads % tp == 0:
            return self.kv_heads // tp
        if tp % self.kv_heads == 0:
            return 1
        raise UsageError("tp", tp, f"a divisor or a multiple of the KV head count {self.kv_heads}")

    def replicas(self, tp: int) -> int:
        """How many ranks hold each KV head (or the MLA latent) under ``tp``."""
        per_rank = self.heads_per_rank(tp)
        if self.kv_heads is None:
            return tp
        return tp * per_rank // self.kv_heads

    def rank_bytes(self, tokens: int, tp: int = 1) -> int:
        """KV bytes each of ``tp`` ranks holds; stops shrinking once ``tp`` > KV heads."""
        if self.kv_heads is None:
            _check_tp(tp)
            return self.kv_bytes(tokens)
        return self.kv_bytes(tokens) * self.heads_per_rank(tp) // self.kv_heads


def _check_tokens(tokens: object) -> None:
    if type(tokens) is not int or not 1 <= tokens <= MAX_TOKENS:
        raise UsageError("tokens", _shown(tokens), f"a positive integer <= {MAX_TOKENS:,}")


def _check_tp(tp: object) -> None:
    if type(tp) is not int or not 1 <= tp <= MAX_SIZE:
        raise UsageError("tp", _shown(tp), f"a positive integer <= {MAX_SIZE:,}")


#: Named shapes.  The public ones are the values in each model's published
#: config.json (num_hidden_layers, num_key_value_heads, head_dim or
#: hidden_size / num_attention_heads; for DeepSeek-V3, kv_lora_rank 512 +
#: qk_rope_head_dim 64); see docs/cost-model.md.  All in bf16.
PRESETS: Mapping[str, KVShape] = {
    "teaching-gqa": KVShape.gqa(32, 8, 128, "bf16"),
    "llama-3-8b": KVShape.gqa(32, 8, 128, "bf16"),
    "llama-3-70b": KVShape.gqa(80, 8, 128, "bf16"),
    "qwen2.5-7b": KVShape.gqa(28, 4, 128, "bf16"),
    "qwen2.5-72b": KVShape.gqa(80, 8, 128, "bf16"),
    "deepseek-v3": KVShape.mla(61, 512 + 64, "bf16"),
}


# -- link and timing --------------------------------------------------------


@attrs.frozen
class Link:
    """One effective path: ``bandwidth_gibps`` GiB/s after a fixed ``latency_ms``.

    Raises:
        UsageError: a bandwidth outside [MIN_BANDWIDTH_GIBPS, 1e12] GiB/s, or a latency
            outside [0, MAX_MS] ms.
    """

    bandwidth_gibps: float = attrs.field(validator=_bandwidth)
    latency_ms: float = attrs.field(default=0.0, kw_only=True, validator=_non_negative)

    def transfer_ms(self, nbytes: int) -> float:
        """``latency_ms + nbytes / bandwidth``, in milliseconds."""
        if type(nbytes) is not int or nbytes < 0:
            raise UsageError("nbytes", nbytes, "an integer >= 0")
        return self.latency_ms + nbytes * 1000 / (self.bandwidth_gibps * GIB)

    def bandwidth_for(self, nbytes: int, budget_ms: float) -> float | None:
        """GiB/s needed to move ``nbytes`` within ``budget_ms`` (None: latency alone exceeds it)."""
        room = budget_ms - self.latency_ms
        if room <= 0:
            return None
        return nbytes * 1000 / (room * GIB)


@attrs.frozen
class Timing:
    """Compute and coordination times of one request, in milliseconds.

    Args:
        prefill_ms: P's prefill compute; P returns the first token at its end.
        decode_ms: one decode step; each step yields one more token.
        coord_ms: handoff coordination (reserve D slots, confirm readable),
            disaggregated only.
        wait_ms: the colocated extra queueing/interference wait J, before
            prefill starts; the disaggregated side has none.

    Raises:
        UsageError: a negative or non-finite time.
    """

    prefill_ms: float = attrs.field(validator=_non_negative)
    decode_ms: float = attrs.field(validator=_non_negative)
    coord_ms: float = attrs.field(default=0.0, kw_only=True, validator=_non_negative)
    wait_ms: float = attrs.field(default=0.0, kw_only=True, validator=_non_negative)

    @classmethod
    def seed_example(cls) -> Timing:
        """The seed's teaching timing: P 40 ms, D 4 ms/step, coordination 2 ms, J 30 ms."""
        return cls(40.0, 4.0, coord_ms=2.0, wait_ms=30.0)


# -- timelines --------------------------------------------------------------


@attrs.frozen
class Span:
    """One interval of a timeline: ``kind`` on ``lane`` from ``start_ms`` to ``end_ms``.

    ``kind`` is one of ``"wait"``, ``"prefill"``, ``"coordination"``,
    ``"transfer"``, ``"decode"``; ``lane`` names the resource (``"worker"``
    when colocated; ``"P"``, ``"link"``, ``"D"`` when disaggregated).
    """

    kind: str
    lane: str
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """``end_ms - start_ms``."""
        return self.end_ms - self.start_ms


@attrs.frozen
class Timeline:
    """One request under one scheme: the spans and the times tokens are emitted.

    ``token_ms[k]`` is when token ``k + 1`` is emitted.  For the
    disaggregated scheme ``handoff_start_ms`` is when prefill ends and the
    handoff begins, ``transfer_start_ms``/``transfer_end_ms`` bracket the
    bytes (after coordination); all three are None when colocated.
    """

    scheme: str
    spans: tuple[Span, ...]
    token_ms: tuple[float, ...]
    handoff_start_ms: float | None = None
    transfer_start_ms: float | None = None
    transfer_end_ms: float | None = None

    @property
    def ttft_ms(self) -> float:
        """Time to the first token."""
        return self.token_ms[0]

    @property
    def second_token_ms(self) -> float:
        """Time to the second token."""
        return self.token_ms[1]

    @property
    def first_gap_ms(self) -> float:
        """The first generated gap: second token minus first token."""
        return self.token_ms[1] - self.token_ms[0]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out: dict[str, Any] = {
            "ttft_ms": self.ttft_ms,
            "second_token_ms": self.second_token_ms,
            "first_gap_ms": self.first_gap_ms,
            "token_ms": list(self.token_ms),
        }
        if self.handoff_start_ms is not None:
            out["handoff_start_ms"] = self.handoff_start_ms
            out["transfer_start_ms"] = self.transfer_start_ms
            out["transfer_end_ms"] = self.transfer_end_ms
        out["spans"] = [attrs.asdict(s) for s in self.spans]
        return out


def _decode_spans(
    lane: str, first_token_at: float, decode_start: float, step: float, count: int
) -> tuple[list[Span], list[float]]:
    tokens = [first_token_at]
    spans = []
    for k in range(count - 1):
        start = decode_start + k * step
        spans.append(Span("decode", lane, start, start + step))
        tokens.append(start + step)
    return spans, tokens


# -- the model --------------------------------------------------------------


@attrs.frozen
class CostModel:
    """Everything needed to cost one handoff and time one request.

    Args:
        shape: the KV shape.
        tokens: positions in the handed-over KV (the prompt length).
        link: one effective path (per link).
        timing: compute, coordination and the colocated wait J.
        tp: ranks the KV heads are split over (P and D alike; no re-sharding).
        links: independent links the ranks send over.  1 is a shared egress:
            the bound is all rank bytes over one link's bandwidth.  With
            ``links`` >= ``tp`` every rank has its own link and the critical
            path is one rank's bytes.  In between, ranks share links evenly.

    Raises:
        UsageError: any value out of range (see the field types).
    """

    shape: KVShape = attrs.field(validator=attrs.validators.instance_of(KVShape))
    tokens: int = attrs.field(validator=lambda _i, _a, v: _check_tokens(v))
    link: Link = attrs.field(validator=attrs.validators.instance_of(Link))
    timing: Timing = attrs.field(validator=attrs.validators.instance_of(Timing))
    tp: int = attrs.field(default=1, kw_only=True, validator=_positive_int)
    links: int = attrs.field(default=1, kw_only=True, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        self.shape.heads_per_rank(self.tp)  # reject a tp that cannot split the heads

    @classmethod
    def seed_example(cls, *, wait_ms: float = 30.0, bandwidth_gibps: float = 25.0) -> CostModel:
        """The seed's worked example: teaching GQA model, 4096 tokens, 25 GiB/s, P 40, D 4, coord 2, J 30."""
        return cls(
            KVShape.from_preset("teaching-gqa"),
            4096,
            Link(bandwidth_gibps),
            attrs.evolve(Timing.seed_example(), wait_ms=wait_ms),
        )

    @property
    def kv_bytes(self) -> int:
        """Bytes of one full KV copy."""
        return self.shape.kv_bytes(self.tokens)

    @property
    def rank_bytes(self) -> int:
        """Bytes each TP rank holds and sends."""
        return self.shape.rank_bytes(self.tokens, self.tp)

    @property
    def critical_bytes(self) -> int:
        """Bytes on the busiest link: ``ceil(tp / links)`` ranks' shares."""
        return self.rank_bytes * -(-self.tp // self.links)

    @property
    def transfer_ms(self) -> float:
        """The transfer lower bound: latency + critical bytes / bandwidth."""
        return self.link.transfer_ms(self.critical_bytes)

    @property
    def handoff_ms(self) -> float:
        """Coordination plus transfer: what disaggregation adds before D can start."""
        return self.timing.coord_ms + self.transfer_ms

    def colocated(self, first_tokens: int = 4) -> Timeline:
        """The colocated timeline: wait J, prefill, then decode on the same worker."""
        _check_first_tokens(first_tokens)
        t = self.timing
        ttft = t.wait_ms + t.prefill_ms
        spans = [Span("wait", "worker", 0.0, t.wait_ms), Span("prefill", "worker", t.wait_ms, ttft)]
        decode, tokens = _decode_spans("worker", ttft, ttft, t.decode_ms, first_tokens)
        return Timeline("colocated", tuple(spans + decode), tuple(tokens))

    def disaggregated(self, first_tokens: int = 4) -> Timeline:
        """The disaggregated timeline: prefill on P, coordination and transfer, decode on D."""
        _check_first_tokens(first_tokens)
        t = self.timing
        p = t.prefill_ms
        start = p + t.coord_ms
        end = start + self.transfer_ms
        spans = [
            Span("prefill", "P", 0.0, p),
            Span("coordination", "link", p, start),
            Span("transfer", "link", start, end),
        ]
        decode, tokens = _decode_spans("D", p, end, t.decode_ms, first_tokens)
        return Timeline("disaggregated", tuple(spans + decode), tuple(tokens), p, start, end)

    @property
    def break_even_wait_ms(self) -> float:
        """The colocated wait J at which both second tokens come at the same time.

        Below it colocation gives the earlier second token; above it
        disaggregation does.  Equal to coordination + transfer.
        """
        return self.handoff_ms

    def break_even_bandwidth_gibps(self, wait_ms: float | None = None) -> float | None:
        """Per-link GiB/s at which disaggregation stops losing on the second token.

        For the colocated wait ``wait_ms`` (default: the model's J), the
        bandwidth that makes coordination + transfer equal J.  None when
        coordination and latency alone already exceed J: no bandwidth helps.
        """
        wait = self.timing.wait_ms if wait_ms is None else wait_ms
        return self.link.bandwidth_for(self.critical_bytes, wait - self.timing.coord_ms)


def _check_first_tokens(count: object) -> None:
    if type(count) is not int or not 2 <= count <= MAX_FIRST_TOKENS:
        raise UsageError("first_tokens", _shown(count), f"an integer from 2 to {MAX_FIRST_TOKENS:,}")


# -- the report -------------------------------------------------------------


@attrs.frozen
class CostReport:
    """What :func:`estimate` returns: the model and every derived number."""

    model: CostModel
    colocated: Timeline
    disaggregated: Timeline

    @property
    def kv_bytes(self) -> int:
        """Bytes of one full KV copy."""
        return self.model.kv_bytes

    @property
    def kv_mib(self) -> float:
        """``kv_bytes`` in MiB."""
        return self.model.kv_bytes / MIB

    @property
    def transfer_ms(self) -> float:
        """The transfer lower bound in ms."""
        return self.model.transfer_ms

    @property
    def break_even_wait_ms(self) -> float:
        """J at which both second tokens are equal."""
        return self.model.break_even_wait_ms

    @property
    def break_even_bandwidth_gibps(self) -> float | None:
        """Per-link GiB/s at which disaggregation stops losing for the model's J."""
        return self.model.break_even_bandwidth_gibps()

    @property
    def second_token_saving_ms(self) -> float:
        """Colocated minus disaggregated second token: > 0 when disaggregation wins."""
        return self.colocated.second_token_ms - self.disaggregated.second_token_ms

    def to_dict(self) -> dict[str, Any]:
        """One JSON-ready object with inputs, sizes, the bound, both timelines and break-even."""
        m = self.model
        shape: dict[str, Any] = {"layers": m.shape.layers}
        if m.shape.is_mla:
            shape["latent_dim"] = m.shape.latent_dim
        else:
            shape["kv_heads"] = m.shape.kv_heads
            shape["head_dim"] = m.shape.head_dim
        shape["bytes_per_element"] = m.shape.bytes_per_element
        return {
            "shape": shape,
            "tokens": m.tokens,
            "bytes_per_token": m.shape.bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "kv_mib": self.kv_mib,
            "tp": m.tp,
            "links": m.links,
            "heads_per_rank": m.shape.heads_per_rank(m.tp),
            "replicas": m.shape.replicas(m.tp),
            "rank_bytes": m.rank_bytes,
            "sent_bytes": m.rank_bytes * m.tp,
            "critical_bytes": m.critical_bytes,
            "bandwidth_gibps": m.link.bandwidth_gibps,
            "latency_ms": m.link.latency_ms,
            "transfer_ms": self.transfer_ms,
            "timing": attrs.asdict(m.timing),
            "colocated": self.colocated.to_dict(),
            "disaggregated": self.disaggregated.to_dict(),
            "second_token_saving_ms": self.second_token_saving_ms,
            "break_even_wait_ms": self.break_even_wait_ms,
            "break_even_bandwidth_gibps": self.break_even_bandwidth_gibps,
        }


def estimate(model: CostModel, *, first_tokens: int = 4) -> CostReport:
    """Cost one handoff and time one request under both schemes.

    Args:
        model: the inputs.
        first_tokens: how many tokens each timeline reports (>= 2).

    Returns:
        A :class:`CostReport`; ``model`` is not changed (it is frozen).

    Raises:
        UsageError: ``first_tokens`` < 2.
    """
    return CostReport(model, model.colocated(first_tokens), model.disaggregated(first_tokens))


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in binary units: ``"512 MiB"``, ``"1.5 GiB"``, ``"72 KiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
