"""What a simulated run measured, as vLLM's benchmark client defines it.

The engine hands one :class:`RequestRecord` per request to a :class:`Metrics`
(``add``), and reports its pools and devices through the same object
(``gauge``, ``busy``, ``transfer``, ``count``); ``summary`` turns it all into
one JSON-ready dict.  Memory is bounded: a few floats per request; every
inter-token gap while there are at most ``itl_exact_limit`` (250,000 by
default, 2 MB), then a uniform sample of at most that many (so the ITL percentiles
of a longer run are estimates, marked ``"approx": true``; ITL count, mean
and max stay exact); gauges folded into running integrals plus at most
``series_points`` samples for plots.

Definitions (vLLM ``vllm bench serve``, ``calculate_metrics``), all from the
client's side, a request counted only when it *completed*:

* **TTFT** = first token - arrival.
* **TPOT** = (E2E - TTFT) / (n - 1) for the n >= 2 output tokens of a
  request; requests with one output token have no TPOT (they are left out
  of the TPOT statistics, and count as TPOT 0 for goodput, as vLLM does).
  The first token is excluded: TPOT is the mean gap *after* it.
* **ITL** = every gap between two successive output tokens, pooled over all
  requests, then its statistics (so a long request weighs more).
* **E2E** = last token - arrival (vLLM's E2EL).
* **first gap** = second token - first token (the seed's §05 "first
  generated gap", SplitwiseSim's nth_token_overhead at the P->D boundary).
* percentiles interpolate linearly between order statistics (numpy's
  default); the median is p50.
* **throughput** = completed requests / duration; output (total) token
  throughput counts completed requests' output (prompt + output) tokens.
* **goodput** = completed requests meeting *every* given :class:`SLO`
  (``value <= bound``) / duration.  Rejected and failed requests are never
  good.  ``attainment`` = good / (requests - client cancels): a client cancel
  asked for no answer, so it neither counts for nor against the server.
* **duration**: first arrival to the last thing any record shows (a token,
  a finish, an arrival), unless the caller passes its own.
* **concurrency** = ΣE2E / duration (SGLang; Little's law L = λW).

All times in records are seconds; the summary gives latencies in ms.
"""

from __future__ import annotations

import math
import operator
import random
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import UsageError

__all__ = [
    "PERCENTILES",
    "SLO",
    "SLO_KEYS",
    "Gauge",
    "Metrics",
    "RequestRecord",
    "percentile",
    "stats",
    "summaries",
]

#: The percentiles every latency summary gives.
PERCENTILES = (50, 90, 95, 99)
#: The SLO keys: vLLM's ttft, tpot, e2e (its e2el), and our itl and first_gap.
SLO_KEYS = ("ttft", "tpot", "e2e", "itl", "first_gap")

_SUB = operator.sub


@attrs.frozen
class RequestRecord:
    """What happened to one request, as the client saw it.

    Args:
        id, arm: the request and the arm (configuration) that served it.
        arrival: when it was sent (absolute seconds).
        prompt_len, output_len: tokens asked for.
        first_token, finish: when the first token arrived and when the request
            completed (its last token); None if never (a rejected, cancelled
            or failed request has no finish).
        token_times: the arrival time of every output token, the first
            included (``token_times[0] == first_token``).
        rejected: refused at admission (no capacity); never served.
        cancelled: cancelled by the client.
        failed: aborted by the server (a fault it could not retry around).
        retries: handoff attempts beyond the first.
        prefill_start: when the prefill that produced the first token started
            (None if no prefill started).
        transfer_start, transfer_end: PD only, the transfer that handed the
            first token's request to D: when it started (after P's
            coordination) and when it landed (None if it never did).  The
            seed asks for these beside the first token and the first gap.

    A record is *completed* when it is none of rejected, cancelled, failed
    and has a finish time.
    """

    id: str
    arm: str
    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None
    finish: float | None
    token_times: tuple[float, ...]
    rejected: bool = False
    cancelled: bool = False
    failed: bool = False
    retries: int = 0
    prefill_start: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None

    @property
    def completed(self) -> bool:
        """True when the request ran to its end."""
        return not (self.rejected or self.cancelled or self.failed) and self.finish is not None

    @property
    def ttft(self) -> float | None:
        """First token - arrival, seconds (None without a first token)."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        """Last token (or finish) - arrival, seconds (None when unfinished)."""
        end = self.token_times[-1] if self.token_times else self.finish
        return None if end is None else end - self.arrival

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (n - 1) over n >= 2 tokens; None for fewer."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def first_gap(self) -> float | None:
        """Second token - first token, seconds (None with fewer than two)."""
        tt = self.token_times
        return tt[1] - tt[0] if len(tt) >= 2 else None


# -- SLOs ----------------------------------------------------------------------------


def _optional_bound(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type, operator]  # mypy does not narrow on type() in (...)
        raise UsageError(f"SLO {attr.name}", value, "a finite number of seconds > 0, or None")


@attrs.frozen
class SLO:
    """Per-request latency bounds, in **seconds**; None means not checked.

    ``ttft``, ``tpot``, ``e2e`` are vLLM's goodput keys (``--goodput ttft:MS
    tpot:MS e2el:MS``).  ``itl`` bounds *every* gap of a request (its largest
    ITL; stricter than vLLM, which refuses ITL as a goodput key), and
    ``first_gap`` the second token minus the first.  A request meets the SLO
    when each given value is ``<=`` its bound; one with one output token has
    TPOT 0 and no gaps, so it meets ``tpot``, ``itl`` and ``first_gap``.

    Raises:
        UsageError: a bound that is not a positive finite number, or no bound.
    """

    ttft: float | None = attrs.field(default=None, validator=_optional_bound)
    tpot: float | None = attrs.field(default=None, validator=_optional_bound)
    e2e: float | None = attrs.field(default=None, validator=_optional_bound)
    itl: float | None = attrs.field(default=None, validator=_optional_bound)
    first_gap: float | None = attrs.field(default=None, validator=_optional_bound)

    def __attrs_post_init__(self) -> None:
        if all(getattr(self, k) is None for k in SLO_KEYS):
            raise UsageError("SLO", "no bound", f"at least one of {', '.join(SLO_KEYS)}")

    @classmethod
    def ms(cls, **bounds: float) -> SLO:
        """Bounds given in milliseconds: ``SLO.ms(ttft=200, tpot=100)``."""
        for key, value in bounds.items():
            if key not in SLO_KEYS:
                raise UsageError("SLO key", key, f"one of {', '.join(SLO_KEYS)}")
            _optional_bound(None, attrs.fields_dict(cls)[key], value)
        return cls(**{k: v / 1000.0 for k, v in bounds.items()})

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``"ttft:200,tpot:100"`` (ms; commas or spaces; ``e2el`` is read as ``e2e``).

        Raises:
            UsageError: a malformed pair, an unknown key, a repeated key, a bad number.
        """
        bounds: dict[str, float] = {}
        parts = text.replace(",", " ").split() if isinstance(text, str) else []
        if not parts:
            raise UsageError("--slo", text, "KEY:MS pairs such as ttft:200,tpot:100")
        for part in parts:
            key, sep, value = part.partition(":")
            key = "e2e" if key.strip().lower() == "e2el" else key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise UsageError("--slo", part, f"KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
            if key in bounds:
                raise UsageError("--slo", part, f"each key once ({key} repeats)")
            try:
                ms = float(value)
            except ValueError:
                raise UsageError("--slo", part, "KEY:MS with MS a number of milliseconds > 0") from None
            if not (math.isfinite(ms) and ms > 0):
                raise UsageError("--slo", part, "KEY:MS with MS a number of milliseconds > 0")
            bounds[key] = ms
        return cls.ms(**bounds)

    def to_ms(self) -> dict[str, float]:
        """The given bounds in ms, by key."""
        return {k: getattr(self, k) * 1000.0 for k in SLO_KEYS if getattr(self, k) is not None}

    def __str__(self) -> str:
        return ",".join(f"{k}:{v:g}" for k, v in self.to_ms().items())


# -- statistics ------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolated linearly (numpy's default)."""
    n = len(ordered)
    if n == 0:
        return 0.0
    h = (n - 1) * q / 100.0
    lo = int(h)
    if lo + 1 >= n:
        return float(ordered[-1])
    return ordered[lo] + (h - lo) * (ordered[lo + 1] - ordered[lo])


def stats(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int]:
    """count, mean, std, median, p90, p95, p99, max of ``values`` times ``scale``.

    Empty: count 0 and every figure 0.0 (vLLM reports 0 for an empty list).
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return {
            "count": 0,
            "mean": 0.0,
            "std": 0.0,
            "median": 0.0,
            "p90": 0.0,
            "p95": 0.0,
            "p99": 0.0,
            "max": 0.0,
        }
    mean = math.fsum(ordered) / n
    var = math.fsum((v - mean) ** 2 for v in ordered) / n
    out: dict[str, float | int] = {"count": n, "mean": mean * scale, "std": math.sqrt(var) * scale}
    for q in PERCENTILES:
        out["median" if q == 50 else f"p{q}"] = percentile(ordered, q) * scale
    out["max"] = ordered[-1] * scale
    return out


class _Gaps:
    """Every inter-token gap while there are at most ``limit``, then a uniform
    sample: each gap kept with probability 1/``stride`` (a request's gaps from
    a random offset, every ``stride``-th; when the sample outgrows ``limit``
    every other one is dropped and ``stride`` doubles).  The work per request
    is one slice, not a Python step per gap.  Count, mean and max stay exact."""

    __slots__ = ("limit", "values", "seen", "total", "top", "stride", "_rng", "_sorted")

    def __init__(self, limit: int = 250_000, seed: int = 0) -> None:
        self.limit = max(2, limit)
        # a list, not an array("d"): extending a list with a request's gaps
        # copies pointers, while an array converts each float through the
        # argument parser (about 20x the work; at the limit the list holds
        # ~8 MB instead of ~2 MB)
        self.values: list[float] = []
        self.seen = 0
        self.total = 0.0
        self.top = 0.0
        self.stride = 1
        self._rng = random.Random(seed)
        self._sorted: list[float] | None = None

    @property
    def exact(self) -> bool:
        return self.stride == 1

    def add(self, gaps: list[float], total: float, top: float) -> None:
        """Fold in one request's ``gaps`` (their sum ``total``, their max ``top``)."""
        self.seen += len(gaps)
        self.total += total
        if top > self.top:
            self.top = top
        self._sorted = None
        stride = self.stride
        if stride == 1:
            self.values.extend(gaps)
        else:
            self.values.extend(gaps[self._rng.randrange(stride) :: stride])
        if len(self.values) > self.limit:
            self.values = self.values[self._rng.randrange(2) :: 2]
            self.stride = stride * 2

    def ordered(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self.values)
        return self._sorted

    def stats(self, scale: float = 1000.0) -> dict[str, float | int]:
        if self.seen == 0:
            return stats((), scale)
        ordered = self.ordered()
        n = len(ordered)
        sample_mean = math.fsum(ordered) / n
        var = math.fsum((v - sample_mean) ** 2 for v in ordered) / n
        out: dict[str, float | int] = {
            "count": self.seen,
            "mean": self.total / self.seen * scale,
            "std": math.sqrt(var) * scale,
        }
        for q in PERCENTILES:
            out["median" if q == 50 else f"p{q}"] = percentile(ordered, q) * scale
        out["max"] = self.top * scale
        if not self.exact:
            out["approx"] = True
        return out

    def cdf(self) -> tuple[list[float], list[float]]:
        """(sorted values, cumulative share) for a CDF plot."""
        ordered = self.ordered()
        n = len(ordered)
        return list(ordered), [(i + 1) / n for i in range(n)]


# -- gauges ----------------------------------------------------------------------------------


class Gauge:
    """A piecewise-constant signal (a queue length, KV blocks in use, ...).

    ``set(t, value)`` records that the signal is ``value`` from time ``t``
    on (times never decrease).  Kept: the time integral (for the
    time-average), the maximum, the last value, and at most ``points``
    samples for plots (when full, every other sample is dropped and only
    every second new one is kept; the max stays exact).  ``capacity`` (or
    None) is what the signal is measured against, e.g. a pool's KV blocks.
    """

    __slots__ = (
        "name",
        "capacity",
        "start",
        "t",
        "value",
        "area",
        "peak",
        "times",
        "values",
        "_every",
        "_skip",
        "_points",
    )

    def __init__(
        self, name: str, capacity: float | None = None, start: float = 0.0, points: int = 2000
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.start = start
        self.t = start
        self.value = 0.0
        self.area = 0.0
        self.peak = 0.0
        # lists (at most ``points`` each): an array("d") append converts its
        # float through the argument parser, several times a list append's cost
        self.times: list[float] = []
        self.values: list[float] = []
        self._every = 1
        self._skip = 0
        self._points = max(2, points)

    def set(self, t: float, value: float) -> None:
        """The signal is ``value`` from ``t`` on."""
        if t > self.t:
            self.area += self.value * (t - self.t)
            self.t = t
        self.value = value
        if value > self.peak:
            self.peak = value
        self._skip += 1
        if self._skip >= self._every:
            self._skip = 0
            self.times.append(t)
            self.values.append(value)
            if len(self.times) >= self._points:
                self.times = self.times[::2]
                self.values = self.values[::2]
                self._every *= 2

    def add(self, t: float, delta: float) -> None:
        """The signal changes by ``delta`` at ``t``."""
        self.set(t, self.value + delta)

    def mean(self, until: float | None = None) -> float:
        """Time-average from the start to ``until`` (default: the last change)."""
        end = self.t if until is None else max(until, self.t)
        span = end - self.start
        if span <= 0:
            return self.value
        return (self.area + self.value * (end - self.t)) / span

    def summary(self, until: float | None = None) -> dict[str, float | None]:
        out: dict[str, float | None] = {"mean": self.mean(until), "max": self.peak, "last": self.value}
        if self.capacity:
            out["capacity"] = self.capacity
            out["mean_share"] = self.mean(until) / self.capacity
            out["max_share"] = self.peak / self.capacity
        return out


# -- the accumulator -------------------------------------------------------------------------


class Metrics:
    """Streams request records and pool signals into one summary.

    Args:
        arm: the configuration's name (shown in the summary).
        devices: accelerators the arm uses (the per-device figures divide by it).
        weight_copies: model replicas those devices hold (a PD arm with N_P +
            N_D instances of TP 1 holds N_P + N_D copies).
        keep_records: keep the first this many records whole (for the
            timeline plot); the rest are folded away.
        itl_exact_limit: inter-token gaps kept exactly; beyond, a uniform
            sample of at most that many (ITL percentiles then estimated from it,
            marked ``"approx": true``; count, mean and max stay exact).
        series_points: samples each gauge keeps for plots.

    The engine calls :meth:`add` once per request, :meth:`gauge` for pool
    signals (queue lengths, KV blocks in use), :meth:`busy` for device busy
    time, :meth:`transfer` for each KV transfer and :meth:`count` for events
    (preemptions, timeouts, transfer failures, ...).
    """

    def __init__(
        self,
        arm: str = "",
        *,
        devices: int = 1,
        weight_copies: int = 1,
        keep_records: int = 0,
        itl_exact_limit: int = 250_000,
        series_points: int = 2000,
    ) -> None:
        self.arm = arm
        self.devices = devices
        self.weight_copies = weight_copies
        self.keep_records = keep_records
        self.records: list[RequestRecord] = []
        self.series_points = series_points
        # per completed request (parallel arrays)
        self._ttft = array("d")
        self._e2e = array("d")
        self._tpot = array("d")  # 0.0 for one-token requests (goodput), see _multi
        self._multi = array("b")  # 1 when the request has >= 2 tokens
        self._first_gap = array("d")
        self._max_itl = array("d")
        self._itl = _Gaps(itl_exact_limit)
        self.requests = 0
        self.completed = 0
        self.rejected = 0
        self.cancelled = 0
        self.failed = 0
        self.retries = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.generated_tokens = 0  # every token of every record, incomplete ones included
        self.first_arrival = math.inf
        self.last_time = -math.inf
        self._e2e_sum = 0.0
        self.gauges: dict[str, Gauge] = {}
        self.busy_time: dict[str, float] = {}
        self.counters: Counter[str] = Counter()
        self.transfers = 0
        self.network_bytes = 0
        self._transfer_wait = array("d")
        self._transfer_time = array("d")

    # -- requests

    def add(self, record: RequestRecord) -> None:
        """Fold one request in."""
        self.requests += 1
        arrival = record.arrival
        if arrival < self.first_arrival:
            self.first_arrival = arrival
        tt = record.token_times
        end = record.finish
        last = tt[-1] if tt else arrival
        if end is not None and end > last:
            last = end
        if last > self.last_time:
            self.last_time = last
        self.generated_tokens += len(tt)
        self.retries += record.retries
        if len(self.records) < self.keep_records:
            self.records.append(record)
        if record.rejected:
            self.rejected += 1
            return
        if record.cancelled:
            self.cancelled += 1
            return
        if record.failed or end is None or not tt:
            self.failed += 1
            return
        self.completed += 1
        self.prompt_tokens += record.prompt_len
        n = len(tt)
        self.output_tokens += n
        first = tt[0]
        self._ttft.append(first - arrival)
        e2e = tt[-1] - arrival
        self._e2e.append(e2e)
        self._e2e_sum += e2e
        if n >= 2:
            gaps = list(map(_SUB, tt[1:], tt))
            top = max(gaps)
            self._itl.add(gaps, tt[-1] - first, top)
            self._tpot.append((tt[-1] - first) / (n - 1))
            self._multi.append(1)
            self._first_gap.append(gaps[0])
            self._max_itl.append(top)
        else:
            self._tpot.append(0.0)
            self._multi.append(0)
            self._first_gap.append(0.0)
            self._max_itl.append(0.0)

    # -- pools and devices

    def gauge(self, name: str, capacity: float | None = None, start: float = 0.0) -> Gauge:
        """The gauge called ``name`` (made on first use; ``capacity`` then sets its scale)."""
        g = self.gauges.get(name)
        if g is None:
            g = self.gauges[name] = Gauge(name, capacity, start, self.series_points)
        return g

    def busy(self, device: str, seconds: float) -> None:
        """``device`` computed for ``seconds`` more."""
        self.busy_time[device] = self.busy_time.get(device, 0.0) + seconds

    def transfer(self, nbytes: int, queued: float, seconds: float) -> None:
        """One KV transfer of ``nbytes`` that waited ``queued`` s and then moved for ``seconds``."""
        self.transfers += 1
        self.network_bytes += nbytes
        self._transfer_wait.append(queued)
        self._transfer_time.append(seconds)

    def count(self, event: str, k: int = 1) -> None:
        """Count ``k`` more ``event`` (``"preemption"``, ``"timeout"``, ...)."""
        self.counters[event] += k

    # -- reading

    def values(self, metric: str) -> list[float]:
        """Per-request values of ``ttft``, ``tpot``, ``e2e``, ``first_gap`` or
        ``max_itl`` over completed requests, seconds, sorted (TPOT, first gap
        and max ITL only over requests with >= 2 tokens)."""
        arrays = {
            "ttft": self._ttft,
            "e2e": self._e2e,
            "tpot": self._tpot,
            "first_gap": self._first_gap,
            "max_itl": self._max_itl,
        }
        if metric not in arrays:
            raise UsageError("metric", metric, f"one of {', '.join(arrays)}")
        data = arrays[metric]
        if metric in ("ttft", "e2e"):
            return sorted(data)
        return sorted(v for v, m in zip(data, self._multi) if m)

    def itl_cdf(self) -> tuple[list[float], list[float]]:
        """(ITL values in s, cumulative share), pooled over all gaps."""
        return self._itl.cdf()

    def good(self, slo: SLO) -> int:
        """Completed requests meeting every bound of ``slo``."""
        checks = []
        for key, data in (
            ("ttft", self._ttft),
            ("tpot", self._tpot),
            ("e2e", self._e2e),
            ("itl", self._max_itl),
            ("first_gap", self._first_gap),
        ):
            bound = getattr(slo, key)
            if bound is not None:
                checks.append((data, bound))
        if not checks:
            return self.completed
        good = 0
        for i in range(self.completed):
            for data, bound in checks:
                if data[i] > bound:
                    break
            else:
                good += 1
        return good

    def duration(self) -> float:
        """First arrival to the last time any record shows (0 without records)."""
        if self.requests == 0:
            return 0.0
        return max(0.0, self.last_time - self.first_arrival)

    def summary(self, slo: SLO | None = None, duration: float | None = None) -> dict[str, Any]:
        """Every figure as one JSON-ready dict (see the module docstring for definitions).

        Args:
            slo: the bounds for goodput and attainment (None: no goodput keys).
            duration: the run's length in s (default :meth:`duration`).

        Raises:
            UsageError: a negative or non-finite duration.
        """
        if duration is None:
            duration = self.duration()
        elif type(duration) not in (int, float) or not math.isfinite(duration) or duration < 0:
            raise UsageError("duration", duration, "a finite number of seconds >= 0")
        per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
        multi = [i for i, m in enumerate(self._multi) if m]
        out: dict[str, Any] = {
            "arm": self.arm,
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "retries": self.retries,
            "duration_s": duration,
            "devices": self.devices,
            "weight_copies": self.weight_copies,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "request_throughput": per_s(self.completed),
            "output_throughput": per_s(self.output_tokens),
            "total_token_throughput": per_s(self.prompt_tokens + self.output_tokens),
            "request_throughput_per_device": per_s(self.completed) / self.devices,
            "concurrency": per_s(self._e2e_sum),
            "ttft_ms": stats(self._ttft),
            "tpot_ms": stats(self._tpot[i] for i in multi),
            "itl_ms": self._itl.stats(),
            "e2e_ms": stats(self._e2e),
            "first_gap_ms": stats(self._first_gap[i] for i in multi),
        }
        if slo is not None:
            good = self.good(slo)
            asked = self.requests - self.cancelled
            out["slo"] = slo.to_ms()
            out["good"] = good
            out["goodput"] = per_s(good)
            out["goodput_per_device"] = per_s(good) / self.devices
            out["attainment"] = good / asked if asked else 0.0
        until = self.first_arrival + duration if self.requests else None
        out["gauges"] = {name: g.summary(until) for name, g in sorted(self.gauges.items())}
        out["utilisation"] = {
            d: (b / duration if duration > 0 else 0.0) for d, b in sorted(self.busy_time.items())
        }
        out["transfers"] = {
            "count": self.transfers,
            "network_bytes": self.network_bytes,
            "queue_ms": stats(self._transfer_wait),
            "time_ms": stats(self._transfer_time),
        }
        out["counters"] = dict(sorted(self.counters.items()))
        return out


def summaries(metrics: Mapping[str, Metrics], slo: SLO | None = None) -> dict[str, dict[str, Any]]:
    """``summary(slo)`` of each arm, by name."""
    return {name: m.summary(slo) for name, m in metrics.items()}
