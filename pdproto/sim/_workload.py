"""Workloads for the simulator: who arrives when, with how many tokens.

A :class:`WorkloadSpec` joins four parts, each a small frozen value:

* :class:`Arrival`: Poisson, gamma (``cv`` or vLLM's ``burstiness`` = gamma
  shape = 1/cv²), fixed interval, or replay of a trace's timestamps scaled by
  ``time_scale``;
* two :class:`Lengths` (prompt and output): fixed, uniform, lognormal,
  empirical (a list of values), or ``trace`` (the trace's own lengths);
* an optional :class:`Cancellation`: a share of the requests cancelled by
  the client, in a given phase;
* an optional trace file (:func:`load_trace`): the Azure LLM inference trace
  CSV, the SplitwiseSim and Vidur CSVs, the Mooncake JSONL, or our JSONL.

:func:`make_workload` turns a spec, a count and a seed into a stream of
:class:`SimRequest`, sorted by arrival.  Every random draw comes from
:mod:`random` seeded per part (arrivals, lengths, cancellations), so the
same seed gives the same requests on every machine, and changing the length
distribution leaves the arrival times alone.

Conventions: times are seconds, the first request arrives at 0 (as in vLLM's
benchmark client, which sends its first request at once); a request asks for
at least one prompt and one output token.  Unlike vLLM, gamma gaps are not
rescaled to make the last arrival land at exactly n/rate.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import random
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import attrs

from .._errors import FileFormatError, UsageError

__all__ = [
    "ARRIVALS",
    "LENGTHS",
    "PHASES",
    "TRACE_FORMATS",
    "Arrival",
    "Cancellation",
    "Lengths",
    "SimRequest",
    "Trace",
    "TraceFormatError",
    "WorkloadSpec",
    "load_trace",
    "make_workload",
    "write_jsonl",
]

#: Arrival processes.
ARRIVALS = ("poisson", "gamma", "fixed", "trace")
#: Length distributions.
LENGTHS = ("fixed", "uniform", "lognormal", "empirical", "trace")
#: Phases a client cancel can target.
PHASES = ("queued", "prefill", "transfer", "decode")
#: Trace formats :func:`load_trace` reads (``None`` there means: tell by the header).
TRACE_FORMATS = ("azure", "splitwise", "vidur", "mooncake", "jsonl")

#: The largest rate (requests/s), length (tokens) and time (s) accepted: far
#: beyond any real workload, they keep every sum a finite float.
MAX_RATE = 1e9
MAX_LEN = 2**31
MAX_TIME = 1e12


class TraceFormatError(FileFormatError):
    """A trace file that cannot be read.

    ``source`` names the file, ``line`` is 1-based (0 when the problem is
    not tied to a line), ``field`` the offending column or key (or None),
    ``value`` the offending value (shown in the message, cut to 40
    characters), ``problem`` what was expected.
    """

    SHOW_VALUE = True

    def __init__(
        self, problem: str, *, source: str, line: int = 0, field: str | None = None, value: object = None
    ) -> None:
        super().__init__(problem, source=source, line=line, field=field, value=value)


# -- validators ---------------------------------------------------------------


def _finite(value: object, what: str, low: float, high: float, *, low_inclusive: bool = False) -> float:
    ok = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
    if ok and (value >= low if low_inclusive else value > low) and value <= high:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    op = ">=" if low_inclusive else ">"
    raise UsageError(what, value, f"a finite number {op} {low:g} and <= {high:g}")


def _length(value: object, what: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_LEN:
        raise UsageError(what, value, f"an integer from 1 to {MAX_LEN:,}")
    return value


def _one_of(value: object, what: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise UsageError(what, value, f"one of {', '.join(allowed)}")


# -- requests -----------------------------------------------------------------


@attrs.frozen
class SimRequest:
    """One request of a workload.

    Args:
        id: unique within the workload (``"r0"``, ``"r1"``, ... in arrival order).
        arrival: when the client sends it, seconds from the start.
        prompt_len: prompt tokens (>= 1).
        output_len: output tokens wanted, the first one included (>= 1).
        cancel_at: the earliest absolute time the client cancels, or None.
        cancel_phase: None: the cancel fires at ``cancel_at`` whatever the
            request is doing.  One of :data:`PHASES`: the cancel fires when
            the request is in that phase, at ``max(cancel_at, phase start)``,
            and not at all if the phase ended before ``cancel_at`` or never
            happens (``"transfer"`` under a colocated arm).
    """

    id: str
    arrival: float
    prompt_len: int
    output_len: int
    cancel_at: float | None = None
    cancel_phase: str | None = None


# -- arrival processes ------------------------------------------------------------


@attrs.frozen
class Arrival:
    """When requests arrive.  Use the class methods.

    ``poisson(rate)``: exponential gaps of mean 1/rate.  ``gamma(rate, cv=)``
    or ``gamma(rate, burstiness=)``: gamma gaps of mean 1/rate, shape k =
    burstiness = 1/cv² (k = 1 is Poisson, k < 1 burstier), scale 1/(rate·k),
    as DistServe and Vidur (cv) and vLLM (burstiness) spell it.
    ``fixed(rate)``: one request every 1/rate s.  ``trace(time_scale)``: the
    trace's timestamps, shifted to start at 0 and multiplied by
    ``time_scale`` (2 halves the rate, as Vidur's time_scale_factor and
    SGLang's slowdown factor).

    Raises:
        UsageError: a kind not in :data:`ARRIVALS`, a missing or
            non-positive rate, a cv on anything but gamma.
    """

    kind: str
    rate: float | None = None
    cv: float | None = None
    time_scale: float = 1.0

    def __attrs_post_init__(self) -> None:
        _one_of(self.kind, "arrival", ARRIVALS)
        if self.kind == "trace":
            if self.rate is not None:
                raise UsageError("rate", self.rate, "none for a trace replay (use time_scale)")
        else:
            _finite(self.rate, "rate", 0.0, MAX_RATE)
        if self.kind == "gamma":
            _finite(self.cv, "cv", 0.0, 1e3)
        elif self.cv is not None:
            raise UsageError("cv", self.cv, "none unless the arrival is gamma")
        _finite(self.time_scale, "time_scale", 0.0, 1e9)
        if self.time_scale != 1.0 and self.kind != "trace":
            raise UsageError("time_scale", self.time_scale, "1.0 unless the arrival is a trace replay")

    @classmethod
    def poisson(cls, rate: float) -> Arrival:
        """Poisson arrivals at ``rate`` requests/s."""
        return cls("poisson", rate)

    @classmethod
    def gamma(cls, rate: float, cv: float | None = None, *, burstiness: float | None = None) -> Arrival:
        """Gamma gaps at ``rate`` requests/s; give ``cv`` or ``burstiness`` (= 1/cv²), not both."""
        if (cv is None) == (burstiness is None):
            raise UsageError(
                "gamma", {"cv": cv, "burstiness": burstiness}, "exactly one of cv and burstiness"
            )
        if burstiness is not None:
            cv = 1.0 / math.sqrt(_finite(burstiness, "burstiness", 0.0, 1e9))
        return cls("gamma", rate, cv)

    @classmethod
    def fixed(cls, rate: float) -> Arrival:
        """One request every ``1/rate`` seconds."""
        return cls("fixed", rate)

    @classmethod
    def trace(cls, time_scale: float = 1.0) -> Arrival:
        """Replay the workload's trace, its times multiplied by ``time_scale``."""
        return cls("trace", time_scale=time_scale)

    @property
    def burstiness(self) -> float | None:
        """vLLM's burstiness, the gamma shape 1/cv² (1.0 for Poisson, None otherwise)."""
        if self.kind == "poisson":
            return 1.0
        return 1.0 / (self.cv * self.cv) if self.cv is not None else None

    def _gaps(self, rng: random.Random) -> Iterator[float]:
        rate = self.rate
        assert rate is not None
        if self.kind == "poisson":
            expo = rng.expovariate
            while True:
                yield expo(rate)
        elif self.kind == "gamma":
            assert self.cv is not None
            shape = 1.0 / (self.cv * self.cv)
            scale = 1.0 / (rate * shape)
            gamma = rng.gammavariate
            while True:
                yield gamma(shape, scale)
        else:
            gap = 1.0 / rate
            while True:
                yield gap


# -- length distributions -----------------------------------------------------------


@attrs.frozen
class Lengths:
    """A distribution of token counts.  Use the class methods.

    ``fixed(n)``; ``uniform(low, high)`` (integers, both ends included);
    ``lognormal(median, sigma, low=1, high=None)``: round(exp(N(ln median,
    sigma²))), clipped to [low, high]; ``empirical(values)``: a value drawn
    uniformly from ``values``; ``trace()``: the trace's own lengths (row by
    row on a trace replay, otherwise a random row, the prompt and output of
    one row together when both are ``trace``).

    Raises:
        UsageError: a kind not in :data:`LENGTHS`, a bound that is not an
            integer from 1 to MAX_LEN, low > high, an empty list.
    """

    kind: str
    value: int | None = None
    low: int = 1
    high: int | None = None
    median: float | None = None
    sigma: float | None = None
    values: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        _one_of(self.kind, "lengths", LENGTHS)
        _length(self.low, "low")
        if self.high is not None and _length(self.high, "high") < self.low:
            raise UsageError("high", self.high, f"an integer >= low ({self.low})")
        if self.kind == "fixed":
            _length(self.value, "length")
        elif self.kind == "uniform" and self.high is None:
            raise UsageError("high", None, "an upper bound for a uniform length")
        elif self.kind == "lognormal":
            _finite(self.median, "median", 0.0, MAX_LEN)
            _finite(self.sigma, "sigma", 0.0, 20.0, low_inclusive=True)
        elif self.kind == "empirical":
            if not isinstance(self.values, tuple) or not self.values:
                raise UsageError("values", self.values, "a non-empty tuple of lengths")
            for v in self.values:
                _length(v, "values")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        """Always ``n`` tokens."""
        return cls("fixed", n)

    @classmethod
    def uniform(cls, low: int, high: int) -> Lengths:
        """An integer from ``low`` to ``high``, both included, each as likely."""
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int = 1, high: int | None = None) -> Lengths:
        """Lognormal around ``median`` (mean = median·exp(sigma²/2)), rounded, clipped to [low, high]."""
        return cls("lognormal", low=low, high=high, median=median, sigma=sigma)

    @classmethod
    def empirical(cls, values: Sequence[int]) -> Lengths:
        """One of ``values``, each entry as likely (repeat a value to weight it)."""
        return cls("empirical", values=tuple(values))

    @classmethod
    def trace(cls) -> Lengths:
        """The lengths of the workload's trace."""
        return cls("trace")

    @property
    def mean(self) -> float | None:
        """The expected length (None for ``trace``; clipping of a lognormal ignored)."""
        if self.kind == "fixed":
            return float(self.value)  # type: ignore[arg-type]
        if self.kind == "uniform":
            return (self.low + self.high) / 2  # type: ignore[operator]
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)  # type: ignore[operator]
        if self.kind == "empirical":
            return sum(self.values) / len(self.values)
        return None

    def _sampler(self, rng: random.Random) -> Any:
        """A no-argument function drawing one length."""
        if self.kind == "fixed":
            v = self.value
            return lambda: v
        if self.kind == "uniform":
            lo, hi, randint = self.low, self.high, rng.randint
            assert hi is not None  # a uniform length has a high bound (__attrs_post_init__)
            return lambda: randint(lo, hi)
        if self.kind == "lognormal":
            assert self.median is not None and self.sigma is not None  # checked by __attrs_post_init__
            mu, sigma, lo = math.log(self.median), self.sigma, self.low
            hi = self.high if self.high is not None else MAX_LEN
            draw = rng.lognormvariate

            def lognormal() -> int:
                return min(hi, max(lo, round(draw(mu, sigma))))

            return lognormal
        if self.kind == "empirical":
            values, choice = self.values, rng.choice
            return lambda: choice(values)
        raise AssertionError("trace lengths are drawn by make_workload")  # pragma: no cover


# -- cancellations ---------------------------------------------------------------------


@attrs.frozen
class Cancellation:
    """Client cancels: each request is cancelled with probability ``rate``.

    ``phase`` (one of :data:`PHASES`, or None for any) and ``delay`` (s after
    arrival, the earliest moment) give each cancelled request its
    ``cancel_phase`` and ``cancel_at = arrival + delay`` (see
    :class:`SimRequest` for how the engine fires them).

    Raises:
        UsageError: a rate outside [0, 1], an unknown phase, a negative delay.
    """

    rate: float
    phase: str | None = None
    delay: float = 0.0

    def __attrs_post_init__(self) -> None:
        _finite(self.rate, "cancel rate", 0.0, 1.0, low_inclusive=True)
        if self.phase is not None:
            _one_of(self.phase, "cancel phase", PHASES)
        _finite(self.delay, "cancel delay", 0.0, MAX_TIME, low_inclusive=True)


# -- traces ---------------------------------------------------------------------


@attrs.frozen(repr=False)
class Trace:
    """The rows of a trace file, sorted by arrival (stable), times from 0.

    ``arrivals`` in seconds, ``prompts`` and ``outputs`` in tokens (a 0 in the
    file is read as 1: every request asks for at least one of each).
    """

    source: str
    format: str
    arrivals: tuple[float, ...]
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]

    def __repr__(self) -> str:
        return f"load_trace({self.source!r}, {self.format!r})"

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def span(self) -> float:
        """Last arrival minus first, seconds."""
        return self.arrivals[-1] - self.arrivals[0] if self.arrivals else 0.0

    @property
    def rate(self) -> float | None:
        """Mean arrival rate, requests/s: (rows - 1) / span (None when the span is 0)."""
        return (len(self) - 1) / self.span if self.span > 0 else None


# Header columns that identify each CSV format: (arrival, prompt, output).
_CSV_COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "splitwise": ("arrival_timestamp", "prompt_size", "token_size"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
}
# JSONL keys: (arrival, prompt, output, seconds per unit of arrival).
_JSON_KEYS = {
    "jsonl": ("arrival", "prompt_len", "output_len", 1.0),
    "mooncake": ("timestamp", "input_length", "output_length", 1e-3),
}
_cache: dict[tuple[str, str | None, int, int], Trace] = {}


def load_trace(path: str | os.PathLike[str], format: str | None = None) -> Trace:
    """Read a trace file.

    Formats (``format=None`` tells them apart by the header or first record):

    * ``azure``: the Azure LLM inference trace CSV,
      ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP a date-time
      (``2023-11-16 18:17:03.979``, any number of fraction digits) or seconds.
    * ``splitwise``: SplitwiseSim's CSV (``arrival_timestamp``,
      ``prompt_size``, ``token_size`` used; seconds).
    * ``vidur``: Vidur's CSV (``arrived_at``, ``num_prefill_tokens``,
      ``num_decode_tokens``; seconds).
    * ``mooncake``: the Mooncake JSONL (``timestamp`` in ms,
      ``input_length``, ``output_length``).
    * ``jsonl``: ours, one object a line: ``{"arrival": s, "prompt_len": n,
      "output_len": n}``, other keys ignored.

    Extra columns are ignored; blank lines and lines starting with ``#`` are
    skipped.  Times are shifted so the earliest is 0; rows are sorted by time.
    A file read before is not read again unless it changed.

    Raises:
        UsageError: an unknown format.
        TraceFormatError: a missing or unreadable file, an unknown header, or
            a bad value, naming the file, the line and the field.
    """
    if format is not None:
        _one_of(format, "trace format", TRACE_FORMATS)
    source = os.fspath(path)
    try:
        st = os.stat(source)
    except OSError as exc:
        raise TraceFormatError(f"cannot read the trace: {exc.strerror or exc}", source=source) from None
    key = (os.path.abspath(source), format, st.st_mtime_ns, st.st_size)
    if key in _cache:
        return _cache[key]
    try:
        with open(source, encoding="utf-8", newline="") as fh:
            rows, fmt = _read(fh, source, format)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"not UTF-8 text ({exc.reason})", source=source) from None
    except OSError as exc:
        raise TraceFormatError(f"cannot read the trace: {exc.strerror or exc}", source=source) from None
    if not rows:
        raise TraceFormatError("no requests in the trace", source=source)
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    trace = Trace(
        source,
        fmt,
        tuple(r[0] - t0 for r in rows),
        tuple(r[1] for r in rows),
        tuple(r[2] for r in rows),
    )
    if len(_cache) >= 8:
        _cache.clear()
    _cache[key] = trace
    return trace


def _lines(fh: Any) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(fh, 1):
        text = line.strip()
        if text and not text.startswith("#"):
            yield number, text


def _read(fh: Any, source: str, format: str | None) -> tuple[list[tuple[float, int, int]], str]:
    lines = _lines(fh)
    first = next(lines, None)
    if first is None:
        raise TraceFormatError("empty trace: no header or record", source=source)
    number, text = first
    if text.startswith("{"):
        return _read_jsonl(source, format, [first], lines)
    if format in _JSON_KEYS:
        raise TraceFormatError(
            f"a {format} trace is JSON lines; this line is not an object",
            source=source,
            line=number,
            value=text[:40],
        )
    header = [h.strip().strip('"') for h in next(csv.reader([text]))]
    if format is None:
        for name, cols in _CSV_COLUMNS.items():
            if all(c in header for c in cols):
                format = name
                break
        else:
            expected = "; ".join(",".join(c) for c in _CSV_COLUMNS.values())
            raise TraceFormatError(
                f"unknown trace header; expected the columns {expected} (or JSON lines)",
                source=source,
                line=number,
                value=text[:80],
            )
    cols = _CSV_COLUMNS[format]
    missing = [c for c in cols if c not in header]
    if missing:
        raise TraceFormatError(
            f"the {format} header lacks the column(s) {', '.join(missing)}",
            source=source,
            line=number,
            value=text[:80],
        )
    at = [header.index(c) for c in cols]
    width = len(header)
    rows: list[tuple[float, int, int]] = []
    parse_time = _azure_time if format == "azure" else _seconds
    for number, text in lines:
        fields = next(csv.reader([text])) if '"' in text else text.split(",")
        if len(fields) != width:
            raise TraceFormatError(
                f"{len(fields)} fields, the header has {width}", source=source, line=number, value=text[:80]
            )
        try:
            t = parse_time(fields[at[0]].strip())
        except ValueError:
            raise TraceFormatError(
                "not a time (seconds, or a date-time for azure)",
                source=source,
                line=number,
                field=cols[0],
                value=fields[at[0]],
            ) from None
        rows.append(
            (
                t,
                _tokens(fields[at[1]], source, number, cols[1]),
                _tokens(fields[at[2]], source, number, cols[2]),
            )
        )
    return rows, format


def _read_jsonl(
    source: str, format: str | None, head: list[tuple[int, str]], lines: Iterator[tuple[int, str]]
) -> tuple[list[tuple[float, int, int]], str]:
    if format in _CSV_COLUMNS:
        raise TraceFormatError(f"a {format} trace is CSV; this line is JSON", source=source, line=head[0][0])
    rows: list[tuple[float, int, int]] = []
    keys: tuple[str, str, str, float] | None = _JSON_KEYS[format] if format else None
    for number, text in (*head, *lines):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            # json.loads also raises a plain ValueError (an integer of more than 4300 digits),
            # which has no .msg
            raise TraceFormatError(
                f"not JSON ({getattr(exc, 'msg', exc)})",
                source=source,
                line=number,
                value=text[:40],
            ) from None
        if not isinstance(obj, dict):
            raise TraceFormatError("not a JSON object", source=source, line=number, value=text[:40])
        if keys is None:
            for name, k in _JSON_KEYS.items():
                if k[0] in obj:
                    format, keys = name, k
                    break
            else:
                raise TraceFormatError(
                    "unknown record: expected the keys arrival, prompt_len, output_len (or Mooncake's "
                    "timestamp, input_length, output_length)",
                    source=source,
                    line=number,
                    value=text[:80],
                )
        for key in keys[:3]:
            if key not in obj:
                raise TraceFormatError("missing key", source=source, line=number, field=key)
        t = obj[keys[0]]
        if type(t) not in (int, float) or not math.isfinite(t) or not 0 <= t * keys[3] <= MAX_TIME:
            raise TraceFormatError(
                f"not a time from 0 to {MAX_TIME:g} s", source=source, line=number, field=keys[0], value=t
            )
        rows.append(
            (
                t * keys[3],
                _tokens(obj[keys[1]], source, number, keys[1]),
                _tokens(obj[keys[2]], source, number, keys[2]),
            )
        )
    assert format is not None
    return rows, format


def _tokens(value: object, source: str, line: int, field: str) -> int:
    if isinstance(value, str):
        text = value.strip()
        n = int(text) if text.isascii() and text.isdigit() and len(text) < 12 else -1
    elif type(value) is int:
        n = value
    else:
        n = -1
    if not 0 <= n <= MAX_LEN:
        raise TraceFormatError(
            f"not a token count from 0 to {MAX_LEN:,}", source=source, line=line, field=field, value=value
        )
    return max(n, 1)


def _seconds(text: str) -> float:
    t = float(text)
    if not (math.isfinite(t) and 0 <= t <= MAX_TIME):
        raise ValueError(text)
    return t


_EPOCH = datetime(1970, 1, 1)


def _azure_time(text: str) -> float:
    """A TIMESTAMP of the Azure trace as seconds: a date-time or a plain number."""
    try:
        return _seconds(text)
    except ValueError:
        pass
    base, _, frac = text.partition(".")
    if frac and not (frac.isascii() and frac.isdigit()):
        raise ValueError(text)
    stamp = datetime.fromisoformat(base)
    if stamp.tzinfo is not None:
        raise ValueError(text)
    return (stamp - _EPOCH).total_seconds() + (float("0." + frac) if frac else 0.0)


# -- the spec ---------------------------------------------------------------------


def _arrival(value: object) -> Arrival:
    if not isinstance(value, Arrival):
        raise UsageError("arrival", value, "an Arrival")
    return value


def _lengths_of(value: object) -> Lengths:
    if not isinstance(value, Lengths):
        raise UsageError("lengths", value, "a Lengths")
    return value


@attrs.frozen
class WorkloadSpec:
    """A whole workload: arrivals, prompt and output lengths, cancels, a trace.

    ``trace`` is a file path (read by :func:`load_trace` when the workload is
    made); it is needed when the arrival or a length is ``trace``.

    Raises:
        UsageError: a part of the wrong type, a ``trace`` part without a
            trace file.
    """

    arrival: Arrival = attrs.field(validator=lambda _i, _a, v: _arrival(v))
    prompt: Lengths = attrs.field(validator=lambda _i, _a, v: _lengths_of(v))
    output: Lengths = attrs.field(validator=lambda _i, _a, v: _lengths_of(v))
    cancel: Cancellation | None = None
    trace: str | None = None
    trace_format: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.cancel is not None and not isinstance(self.cancel, Cancellation):
            raise UsageError("cancel", self.cancel, "a Cancellation or None")
        if self.trace_format is not None:
            _one_of(self.trace_format, "trace format", TRACE_FORMATS)
        uses = self.arrival.kind == "trace" or "trace" in (self.prompt.kind, self.output.kind)
        if self.trace is None and uses:
            raise UsageError("trace", None, "a trace file when the arrival or a length comes from a trace")
        if self.trace is not None and not isinstance(self.trace, str):
            raise UsageError("trace", self.trace, "a file path (str)")

    @classmethod
    def poisson(
        cls, rate: float, prompt: int | Lengths, output: int | Lengths, *, cancel: Cancellation | None = None
    ) -> WorkloadSpec:
        """Poisson arrivals at ``rate``; an ``int`` length means a fixed one."""
        return cls(Arrival.poisson(rate), _as_lengths(prompt), _as_lengths(output), cancel)

    @classmethod
    def from_trace(
        cls,
        path: str | os.PathLike[str],
        *,
        time_scale: float = 1.0,
        format: str | None = None,
        cancel: Cancellation | None = None,
    ) -> WorkloadSpec:
        """Replay a trace file as it is: its times (scaled) and its lengths."""
        return cls(
            Arrival.trace(time_scale), Lengths.trace(), Lengths.trace(), cancel, os.fspath(path), format
        )

    def load(self) -> Trace | None:
        """The trace (read once, cached), or None without one."""
        return load_trace(self.trace, self.trace_format) if self.trace is not None else None

    @property
    def rate(self) -> float | None:
        """Mean arrival rate, requests/s (a trace replay's: the trace rate / time_scale)."""
        if self.arrival.kind != "trace":
            return self.arrival.rate
        trace = self.load()
        assert trace is not None
        return trace.rate / self.arrival.time_scale if trace.rate else None

    def with_rate(self, rate: float) -> WorkloadSpec:
        """The same workload at mean ``rate`` requests/s (a trace replay rescales its time)."""
        _finite(rate, "rate", 0.0, MAX_RATE)
        if self.arrival.kind != "trace":
            return attrs.evolve(self, arrival=attrs.evolve(self.arrival, rate=float(rate)))
        trace = self.load()
        assert trace is not None
        if not trace.rate:
            raise UsageError(
                "rate", rate, f"no rate for a trace whose requests all arrive at once ({trace.source})"
            )
        return attrs.evolve(self, arrival=Arrival.trace(trace.rate / rate))


def _as_lengths(value: int | Lengths) -> Lengths:
    return Lengths.fixed(value) if type(value) is int else _lengths_of(value)


def make_workload(spec: WorkloadSpec, n: int, seed: int = 0) -> Iterator[SimRequest]:
    """Up to ``n`` requests of ``spec``, sorted by arrival, made as they are read.

    A trace replay stops at the end of the trace (fewer than ``n`` when the
    trace is shorter); generated arrivals always give ``n``.  The same
    ``(spec, n, seed)`` gives the same requests.

    Raises:
        UsageError: ``n`` or ``seed`` not a non-negative integer; spec errors.
        TraceFormatError: an unreadable trace (raised on the first ``next``).
    """
    if type(n) is not int or n < 0:
        raise UsageError("n", n, "an integer >= 0")
    if type(seed) is not int or seed < 0:
        raise UsageError("seed", seed, "an integer >= 0")
    if not isinstance(spec, WorkloadSpec):
        raise UsageError("spec", spec, "a WorkloadSpec")
    return _generate(spec, n, seed)


def _generate(spec: WorkloadSpec, n: int, seed: int) -> Iterator[SimRequest]:
    trace = spec.load()
    arrival = spec.arrival
    replay = arrival.kind == "trace"
    if replay:
        assert trace is not None
        n = min(n, len(trace))
        scale = arrival.time_scale
        times: Iterator[float] = (t * scale for t in trace.arrivals)
    else:
        times = _cumulate(arrival._gaps(random.Random(f"{seed}:arrival")))
    length_rng = random.Random(f"{seed}:lengths")
    prompt_trace = spec.prompt.kind == "trace"
    output_trace = spec.output.kind == "trace"
    draw_prompt = None if prompt_trace else spec.prompt._sampler(length_rng)
    draw_output = None if output_trace else spec.output._sampler(length_rng)
    rows = len(trace) if trace is not None else 0
    pick = length_rng.randrange
    cancel = spec.cancel
    cancel_rng = random.Random(f"{seed}:cancel")
    p_cancel = cancel.rate if cancel is not None else 0.0
    for i, t in zip(range(n), times):
        row = i if replay else (pick(rows) if (prompt_trace or output_trace) else -1)
        prompt = trace.prompts[row] if prompt_trace else draw_prompt()  # type: ignore[union-attr,misc]
        output = trace.outputs[row] if output_trace else draw_output()  # type: ignore[union-attr,misc]
        if p_cancel and cancel_rng.random() < p_cancel:
            assert cancel is not None
            yield SimRequest(f"r{i}", t, prompt, output, t + cancel.delay, cancel.phase)
        else:
            yield SimRequest(f"r{i}", t, prompt, output)


def _cumulate(gaps: Iterator[float]) -> Iterator[float]:
    t = 0.0
    for gap in gaps:
        yield t
        t += gap


def write_jsonl(requests: Iterator[SimRequest] | Sequence[SimRequest], path: str | pathlib.Path) -> int:
    """Write requests as our JSONL trace (``arrival``, ``prompt_len``, ``output_len``); returns the count."""
    count = 0
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(
                json.dumps(
                    {"arrival": round(r.arrival, 6), "prompt_len": r.prompt_len, "output_len": r.output_len}
                )
                + "\n"
            )
            count += 1
    return count
