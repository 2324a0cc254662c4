"""Replay a history with a real transformer: prefill on P, the real KV through
the protocol's blocks, decode on D, every step's logits compared bit for bit
with a colocated run (see docs/replay.md, "Replay with a real model").

:class:`ModelBackend` runs two :class:`~._torch.TorchBackend` side by side
on the same events, so that every block movement (pool growth, transfers with
their ranges and TP resharding, staging, poison, the prefix cache's stash and
revival, restarts) is the torch backend's own:

- the *ownership channel* is a plain torch backend with the model's layers and
  KV heads: its synthetic tagged values still say whose KV a decode reads
  (``kv-corruption``), which the model cannot always see (two full blocks
  swapped in a table, a block outside a sliding window);
- the *real channel* is a torch backend of the model's KV shape and dtype
  whose writes are the model's real K/V instead of synthetic values (and
  which checks nothing: the logits do).

Prefill runs the model on the generation's deterministic prompt (a function
of request, generation and prompt length; a prefix-cache hit takes the shared
positions' tokens from the generation whose KV the shared blocks hold, and
computes only the rest from the KV those blocks hold on P).  P samples the
first token greedily.  A decode builds the model's cache only from D's blocks,
through the block table of its event (only the positions inside a sliding
window), runs one step and writes the new K/V at its position.  Its logits are
compared exactly (``torch.equal``) with step ``k`` of the colocated reference
run of the same prompt, where ``k`` counts the generation's decodes from its
first (the first decode is step 0; later ones ``position - first position``).
The reference is computed once per prompt and kept with the model.

First-token conventions (the header's ``boundary``): ``sampled`` (the seed's:
P samples A, step 0 feeds A at position prompt_len) and ``recompute``
(vLLM's: P's token is dropped, step 0 feeds the last prompt token at position
prompt_len - 1, whose KV it recomputes).  A decode's real input token: at a
prompt position, the prompt's token there; at a later position, the real token
the history's symbol stands for there (P's first token for ``first_token`` at
prompt_len, D's greedy output of the step before for its ``output_token``);
any other symbol stands for a token other than the reference's.

The first step whose logits differ is reported once per generation as
:class:`LogitDivergence` (invariant ``logit-divergence``): the step, position,
the largest difference, and whether the greedy token changed.
"""

from __future__ import annotations

import copy as _copy
import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .._errors import UsageError
from ..spec import Decode, Event, HistoryHeader, PrefillDone, Share, Submit, Violation
from . import _torch as _tb
from ._builtin_models import LoadedModel, load_transformer

__all__ = ["LOGIT_DIVERGENCE", "LOGIT_DIVERGENCE_RULE", "LogitDivergence", "ModelBackend", "prompt_tokens"]

LOGIT_DIVERGENCE = "logit-divergence"
LOGIT_DIVERGENCE_RULE = (
    "(data level, pdproto replay --model) a decode step's logits are not bit for bit those of the "
    "same step of a colocated run of the same prompt: the KV D read through its block table, or the "
    "input token it fed, is not what colocated decoding has"
)
#: colocated reference runs kept per model, at most this many and this many
#: bytes of their KV (the oldest dropped first)
_MAX_REFERENCES = 512
_MAX_REFERENCE_BYTES = 256 << 20


@attrs.frozen
class LogitDivergence(Violation):
    """A decode step whose logits differ from the colocated run's.

    Besides the fields of :class:`~pdproto.Violation`: ``step`` (the
    generation's decode step, 0 for its first decode), ``position`` (where D
    decoded), ``reference_position`` (where the colocated step decodes),
    ``max_difference`` (the largest absolute logit difference; ``"nan"`` when
    D's logits hold NaN, as poisoned KV makes them), ``token_changed`` (the
    greedy tokens differ), ``token`` and ``expected_token`` (D's and the
    colocated greedy token).
    """

    step: int = attrs.field(default=0, kw_only=True)
    position: int | None = attrs.field(default=None, kw_only=True)
    reference_position: int | None = attrs.field(default=None, kw_only=True)
    max_difference: float | str = attrs.field(default=0.0, kw_only=True)
    token_changed: bool = attrs.field(default=False, kw_only=True)
    token: int | None = attrs.field(default=None, kw_only=True)
    expected_token: int | None = attrs.field(default=None, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for name in (
            "request",
            "gen",
            "worker",
            "step",
            "position",
            "reference_position",
            "max_difference",
            "token_changed",
            "token",
            "expected_token",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def prompt_tokens(
    request: str, gen: int, prompt_len: int, vocab: int, length: int | None = None
) -> list[int]:
    """The deterministic prompt of ``(request, gen, prompt_len)``: ``length``
    (default ``prompt_len``) token ids below ``vocab``, the same on every
    machine and run."""
    digest = hashlib.blake2b(f"{request}\x00{gen}\x00{prompt_len}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randint(0, vocab, (prompt_len if length is None else length,), generator=g).tolist()


# -- the model's one computation ---------------------------------------------------


def _forward(
    m: LoadedModel, prefix: torch.Tensor, tokens: Sequence[int], start: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``tokens`` at positions ``start..`` over the cache ``prefix``
    (``[c, layers, K/V, kv_heads, head_dim]``, positions ``start-c..start-1``);
    return (logits ``[len(tokens), vocab]`` in float32, the new K/V
    ``[len(tokens), layers, K/V, kv_heads, head_dim]``).  The reference and
    the disaggregated path both call this, with caches of the same shape, so
    that equal KV gives equal bits."""
    tf_cache = _dynamic_cache()
    c, n = prefix.shape[0], len(tokens)
    data = [
        (prefix[:, li, 0].permute(1, 0, 2).unsqueeze(0), prefix[:, li, 1].permute(1, 0, 2).unsqueeze(0))
        for li in range(m.layers)
    ]
    cache = tf_cache(ddp_cache_data=data)
    kpos = torch.arange(start - c, start + n, device=device)
    qpos = torch.arange(start, start + n, device=device)
    allow = kpos.view(1, -1) <= qpos.view(-1, 1)
    if m.window is not None:
        allow &= kpos.view(1, -1) > qpos.view(-1, 1) - m.window
    mask = allow.view(1, 1, n, c + n)
    if getattr(m.model.config, "_attn_implementation", "sdpa") == "eager":
        mask = torch.zeros(mask.shape, dtype=m.dtype, device=device).masked_fill_(
            ~mask, torch.finfo(m.dtype).min
        )
    with torch.inference_mode():
        out = m.model(
            input_ids=torch.tensor([list(tokens)], device=device),
            position_ids=qpos.view(1, -1),
            attention_mask=mask,
            use_cache=True,
            **{m.cache_kw: cache},
        )
        kv = torch.stack(
            [
                torch.stack((cache.layers[li].keys[0, :, c:], cache.layers[li].values[0, :, c:]))
                for li in range(m.layers)
            ]
        )  # [layers, K/V, heads, n, head_dim]
        return out.logits[0].float(), kv.permute(3, 0, 1, 2, 4).contiguous()


_CACHE_CLS: list[Any] = []


def _dynamic_cache() -> Any:
    if not _CACHE_CLS:
        from transformers import DynamicCache

        _CACHE_CLS.append(DynamicCache)
    return _CACHE_CLS[0]


class _Reference:
    """The colocated run of one prompt: the prefill (its last logits) and the
    decode steps, each over the KV this run itself keeps (``kv[p]``: the KV
    of position ``p``)."""

    __slots__ = ("tokens", "n", "split", "boundary", "kv", "length", "last_logits", "steps", "inputs")

    def __init__(
        self,
        m: LoadedModel,
        tokens: list[int],
        n: int,
        split: int,
        prefix: torch.Tensor,
        boundary: str,
        device: torch.device,
    ) -> None:
        self.tokens, self.n, self.split, self.boundary = tokens, n, split, boundary
        lo = _low(m, split)
        logits, kv = _forward(m, prefix[lo:split], tokens[split:n], split, device)
        self.kv = torch.empty((max(2 * n, n + 16),) + tuple(kv.shape[1:]), dtype=kv.dtype, device=device)
        self.kv[:split] = prefix[:split]
        self.kv[split:n] = kv
        self.length = n
        self.last_logits = logits[-1]
        self.steps: list[tuple[torch.Tensor, int]] = []  # (logits, greedy token)
        self.inputs: list[int] = []

    @property
    def start(self) -> int:
        """The position of step 0."""
        return self.n - 1 if self.boundary == "recompute" else self.n

    def input(self, m: LoadedModel, k: int, device: torch.device) -> int:
        """The token step ``k`` feeds."""
        if k < len(self.inputs):
            return self.inputs[k]
        if k == 0:
            return self.tokens[self.n - 1] if self.boundary == "recompute" else int(self.last_logits.argmax())
        return self.step(m, k - 1, device)[1]

    def step(self, m: LoadedModel, k: int, device: torch.device) -> tuple[torch.Tensor, int]:
        while len(self.steps) <= k:
            j = len(self.steps)
            q = self.start + j
            token = self.input(m, j, device)
            logits, kv = _forward(m, self.kv[_low(m, q) : q], [token], q, device)
            if q + 1 > self.kv.shape[0]:
                bigger = torch.empty(
                    (2 * self.kv.shape[0],) + tuple(self.kv.shape[1:]), dtype=self.kv.dtype, device=device
                )
                bigger[: self.length] = self.kv[: self.length]
                self.kv = bigger
            self.kv[q] = kv[0]
            self.length = max(self.length, q + 1)
            self.inputs.append(token)
            self.steps.append((logits[0], int(logits[0].argmax())))
        return self.steps[k] if k >= 0 else (self.last_logits, int(self.last_logits.argmax()))


def _low(m: LoadedModel, position: int) -> int:
    """The first position a token at ``position`` attends to (a sliding window's start)."""
    return 0 if m.window is None else max(0, position - (m.window - 1))


# -- the two torch backends ----------------------------------------------------------------


class _Real(_tb.TorchBackend):
    """The real channel: a torch backend whose writes are the model's K/V
    (``pending``: first position, ``[n, layers, K/V, heads, head_dim]``)
    instead of synthetic values, and which checks nothing."""

    pending: tuple[int, torch.Tensor] | None = None

    def _write_runs(
        self, w: Any, spans: list[tuple[int, int, int]], tags: Sequence[int], start: int, codes: Sequence[int]
    ) -> None:
        self._put(w, spans)

    def _write_chunks(
        self, w: Any, spans: list[tuple[int, int, int]], tags: Sequence[int], start: int, codes: Sequence[int]
    ) -> None:
        self._put(w, spans)

    def _put(self, w: Any, spans: list[tuple[int, int, int]]) -> None:
        bs = self.layout.block_size
        idx = [blk * bs + p % bs for blk, p0, p1 in spans for p in range(p0, p1)]
        pos = [p for _blk, p0, p1 in spans for p in range(p0, p1)]
        first, vals = self.pending if self.pending is not None else (0, None)
        index = torch.tensor(idx, dtype=torch.int64, device=self.device)
        for i, (l0, l1, hs) in enumerate(w.parts):
            flat = w.flats[i]
            if vals is None or pos[0] < first or pos[-1] - first >= vals.shape[0]:
                flat.index_fill_(0, index, float("nan"))  # nothing the model computed: unknown KV
                continue
            rows = vals[pos[0] - first : pos[-1] - first + 1]
            flat.index_copy_(0, index, rows[:, l0:l1, :, hs[0] : hs[-1] + 1])

    def _verify(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def _verify_items(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def _verify_slots(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def _verify_transfer(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _verify_probe(self, *args: Any, **kwargs: Any) -> None:
        return None

    def copy(self) -> _Real:
        new = super().copy()
        new.__class__ = _Real
        new.pending = None
        return new


# -- the backend ----------------------------------------------------------------------------


class _MGen:
    __slots__ = (
        "key",
        "prompt_len",
        "tokens",
        "src",
        "split",
        "ref",
        "first_pos",
        "at",
        "diverged",
        "prefill_line",
        "decodes",
    )

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.prompt_len: int | None = None
        self.tokens: list[int] | None = None
        self.src: dict[int, tuple[str, int]] = {}  # shared prompt position -> generation whose KV it holds
        self.split = 0  # prompt positions P took from shared blocks
        self.ref: _Reference | None = None
        self.first_pos: int | None = None  # position of the first decode
        self.at: dict[int, tuple[int, int]] = {}  # position -> (history token, real token) fed there
        self.diverged = False
        self.prefill_line: int | None = None
        self.decodes = 0

    def copy(self) -> _MGen:
        n = _copy.copy(self)
        n.src = dict(self.src)
        n.at = dict(self.at)
        return n


class ModelBackend:
    """Execute a history with a real transformer (see the module's text).

    ``ModelBackend(header, model="tiny-llama", device="cpu", dtype=None,
    tp=None, head_dim=None, block_size=None, scale=None, max_memory=...)``:
    ``model`` is a built-in name, a local model folder, or a
    :class:`~._builtin_models.LoadedModel`; the layers and KV heads of both
    channels are the model's; ``dtype``, ``head_dim`` and ``scale`` are the
    ownership channel's (as for :class:`~._torch.TorchBackend`), the real
    channel keeps the model's dtype.  ``apply(event, line)`` returns the
    violations the event made visible (``kv-corruption`` and
    ``logit-divergence``), ``finish()`` those of the end of the history;
    ``violations`` accumulates them, ``seconds`` times the model's work
    (``prefill``, ``decode``, ``reference``).  ``threads``: torch's intra-op
    threads while the model runs (restored after; None leaves them): 1 by
    default, since a tiny model's steps are too small to share."""

    def __init__(
        self,
        header: HistoryHeader | None = None,
        *,
        model: str | LoadedModel = "tiny-llama",
        device: str = "cpu",
        dtype: str | None = None,
        tp: tuple[int, int] | str | None = None,
        head_dim: int | None = None,
        block_size: int | None = None,
        scale: str | None = None,
        layout: str | None = None,
        max_memory: int | None = _tb.DEFAULT_MAX_MEMORY,
        boundary: str | None = None,
        threads: int | None = 1,
    ) -> None:
        header = header if header is not None else HistoryHeader()
        m = model if isinstance(model, LoadedModel) else load_transformer(model)
        kv = getattr(header, "kv", None) if getattr(header, "version", 1) != 1 else None
        if (layout or getattr(kv, "layout", None) or "mha") != "mha":
            raise UsageError("layout with --model", layout or kv.layout, f"mha (the KV of {m.name!r})")
        self.m = m
        self.header = header
        self.boundary = boundary if boundary is not None else getattr(header, "boundary", "sampled")
        if self.boundary not in ("sampled", "recompute"):
            raise UsageError("boundary", self.boundary, "sampled or recompute")
        self.tags = _tb.TorchBackend(
            header,
            device=device,
            dtype=dtype,
            tp=tp,
            layers=m.layers,
            kv_heads=m.kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            layout="mha",
            scale=scale,
            max_memory=max_memory,
        )
        self.device = self.tags.device
        self.real = _Real(
            header,
            device=self.device,
            dtype=_tb.canonical_dtype(str(m.dtype).split(".")[-1]),
            tp=tp,
            layers=m.layers,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            block_size=block_size,
            layout="mha",
            max_memory=max_memory,
        )
        if next(m.model.parameters()).device != self.device:
            m.model.to(self.device)
        if threads is not None and (type(threads) is not int or threads < 1):
            raise UsageError("threads", threads, "an integer >= 1, or None")
        self.threads = threads
        self.violations: list[Violation] = []
        self.line = 0
        self.events = 0
        self.seconds = {"prefill": 0.0, "decode": 0.0, "reference": 0.0}
        self.counts = {"prefill": 0, "decode": 0, "reference_steps": 0}
        self._gens: dict[tuple[str, int], _MGen] = {}

    # -- the torch backends' face -----------------------------------------------------------

    @property
    def layout(self) -> Any:
        return self.tags.layout

    @property
    def tp(self) -> tuple[int, int]:
        return self.tags.tp

    @property
    def ok(self) -> bool:
        return not self.violations

    def apply(self, event: Event, line: int | None = None) -> list[Violation]:
        """Execute one event; return the violations it made visible."""
        self.line = self.line + 1 if line is None else line
        self.events += 1
        line = self.line
        out: list[Violation] = []
        kind = type(event)
        if kind is PrefillDone or kind is Decode:
            before = torch.get_num_threads()
            if self.threads is not None and before != self.threads:
                torch.set_num_threads(
                    self.threads
                )  # small steps: waking more threads costs more than it gains
            try:
                found = self._prefill(event, line) if kind is PrefillDone else self._decode(event, line)
            finally:
                if self.threads is not None and before != self.threads:
                    torch.set_num_threads(before)
            out.extend(self.tags.apply(event, line))
            if found is not None:
                out.append(found)
        else:
            out.extend(self.tags.apply(event, line))
            self.real.apply(event, line)
            if kind is Submit:
                self._gen((event.request, event.gen)).prompt_len = event.prompt_len
            elif kind is Share:
                self._share(event)
        self.violations.extend(out)
        return out

    def finish(self) -> list[Violation]:
        """The ownership channel's end of the history (the real channel has no
        decode left to feed)."""
        self.tags.line = max(self.tags.line, self.line)
        out = self.tags.finish()
        self.violations.extend(out)
        return out

    def copy(self) -> ModelBackend:
        """An independent backend in the same state (the model and its
        reference runs are shared: they are deterministic)."""
        new = object.__new__(ModelBackend)
        d = self.__dict__.copy()
        d["tags"] = self.tags.copy()
        d["real"] = self.real.copy()
        d["violations"] = list(self.violations)
        d["seconds"] = dict(self.seconds)
        d["counts"] = dict(self.counts)
        d["_gens"] = {k: g.copy() for k, g in self._gens.items()}
        new.__dict__ = d
        return new

    def info(self) -> dict[str, Any]:
        """The model's part of ``pdproto replay --json``'s ``backend``."""
        m = self.m
        return {
            "name": m.name,
            "layers": m.layers,
            "heads": m.heads,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "vocab": m.vocab,
            "window": m.window,
            "dtype": str(m.dtype).split(".")[-1],
            "boundary": self.boundary,
            "prefills": self.counts["prefill"],
            "decodes": self.counts["decode"],
            "reference_steps": self.counts["reference_steps"],
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "bytes_copied": self.real.bytes_copied,
            "memory": self.real.memory,
        }

    # -- generations and prompts -------------------------------------------------------------

    def _gen(self, key: tuple[str, int]) -> _MGen:
        g = self._gens.get(key)
        if g is None:
            g = self._gens[key] = _MGen(key)
        return g

    def _share(self, ev: Share) -> None:
        """Which generation's KV (and so whose prompt tokens) each shared position holds."""
        key = (ev.request, ev.gen)
        g = self._gen(key)
        tg = self.tags._gens.get(key)
        if tg is None:
            return
        orig = tg.orig.get(ev.worker, {})
        for p in range(ev.tokens):
            tag = orig.get(p)
            if tag is not None and tag != tg.tag and tag < len(self.tags._tags):
                src = self.tags._tags[tag]
                if src in self._gens and self._gens[src].tokens is not None:
                    g.src[p] = src

    def _tokens(self, g: _MGen, length: int) -> list[int]:
        n = g.prompt_len if g.prompt_len is not None else length
        if g.tokens is None or len(g.tokens) < length:
            toks = prompt_tokens(g.key[0], g.key[1], n, self.m.vocab, max(n, length))
            for p, src in g.src.items():
                st = self._gens[src].tokens
                if st is not None and p < len(st) and p < len(toks):
                    toks[p] = st[p]
            g.tokens = toks
        return g.tokens

    def _reference(self, g: _MGen, p_prefix: torch.Tensor | None = None) -> _Reference | None:
        """The colocated run of ``g``'s prompt (made on first use, kept with the model)."""
        if g.ref is not None:
            return g.ref
        n = g.prompt_len
        if n is None or n < 1:
            return None
        m = self.m
        tokens = self._tokens(g, n)
        s = min(g.split, n - 1)
        prefix = self._empty(0)
        if s:
            # the shared prefix as colocated prefill computed it: from each position's origin
            prefix = self._empty(s)
            for p in range(s):
                src = g.src.get(p)
                sr = self._reference(self._gens[src]) if src is not None else None
                if sr is not None and p < sr.length:
                    prefix[p] = sr.kv[p]
                elif p_prefix is not None:
                    prefix[p] = p_prefix[p]
                else:
                    prefix[p] = float("nan")
        key = (
            tuple(tokens[:n]),
            s,
            self.boundary,
            str(self.device),
            hashlib.blake2b(
                prefix.cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16
            ).digest()
            if s
            else None,
        )
        refs = m.references
        ref = refs.get(key)
        if ref is not None:
            refs.move_to_end(key)
        else:
            t0 = time.perf_counter()
            ref = _Reference(m, tokens, n, s, prefix, self.boundary, self.device)
            self.seconds["reference"] += time.perf_counter() - t0
            refs[key] = ref
            while len(refs) > 1 and (
                len(refs) > _MAX_REFERENCES or sum(r.kv.nbytes for r in refs.values()) > _MAX_REFERENCE_BYTES
            ):
                refs.popitem(last=False)
        g.ref = ref
        return ref

    def _empty(self, n: int) -> torch.Tensor:
        m = self.m
        return torch.zeros((n, m.layers, 2, m.kv_heads, m.head_dim), dtype=m.dtype, device=self.device)

    # -- reading the real channel --------------------------------------------------------------

    def _gather(self, worker: str, table: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """The KV of positions ``lo..hi-1`` as ``worker`` holds them through
        ``table`` (every head from the first rank holding it); NaN where the
        table or the pool has no slot."""
        out = self._empty(max(0, hi - lo)).fill_(float("nan"))
        w = self.real._workers.get(worker)
        if w is None or hi <= lo:
            return out
        bs = self.real.layout.block_size
        rows, idx = [], []
        for p in range(lo, hi):
            bi = p // bs
            if bi < len(table) and table[bi] < w.nblocks:
                rows.append(p - lo)
                idx.append(table[bi] * bs + p % bs)
        if not idx:
            return out
        self.real._main_touch(worker)
        index = torch.tensor(idx, dtype=torch.int64, device=self.device)
        dst = torch.tensor(rows, dtype=torch.int64, device=self.device)
        done: set[tuple[int, int]] = set()
        for i, (l0, l1, hs) in enumerate(w.parts):
            if all((l0, h) in done for h in hs):
                continue  # a replicated head: the first rank holding it is the one read
            part = w.flats[i].index_select(0, index)
            out[:, l0:l1, :, hs[0] : hs[-1] + 1].index_copy_(0, dst, part)
            done.update((l0, h) for h in hs)
        return out

    # -- prefill and decode ----------------------------------------------------------------

    def _prefill(self, ev: PrefillDone, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        if g.prompt_len is None:
            g.prompt_len = ev.processed_len
        n = g.prompt_len
        tg = self.real._gens.get(key)
        shared = tg.shared.get(ev.worker) if tg is not None else None
        s = shared[1] if shared else 0
        table = self.real._table(tg, ev.worker, tg.prefill.get(ev.worker, ())) if tg is not None else []
        first = None
        if n >= 1 and ev.processed_len >= 1 and table:
            m = self.m
            tokens = self._tokens(g, max(n, s + ev.processed_len))
            t0 = time.perf_counter()
            prefix = self._gather(ev.worker, table, 0, s)
            logits, kv = _forward(m, prefix[_low(m, s) :], tokens[s : s + ev.processed_len], s, self.device)
            self.seconds["prefill"] += time.perf_counter() - t0
            self.counts["prefill"] += 1
            first = int(logits[-1].argmax())
            self.real.pending = (s, kv)
            g.split = s
            g.ref = None
            self._reference(g, prefix)
        try:
            self.real.apply(ev, line)
        finally:
            self.real.pending = None
        g.prefill_line = line
        if first is not None:
            g.at[n] = (ev.first_token, first)

    def _decode(self, ev: Decode, line: int) -> LogitDivergence | None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        q = ev.position
        n = g.prompt_len
        ref = self._reference(g) if n is not None else None
        if ref is None:
            self.real.apply(ev, line)
            return None
        m = self.m
        if g.first_pos is None:
            g.first_pos = q
        k = max(0, q - g.first_pos)
        t0 = time.perf_counter()
        before = len(ref.steps)
        ref_logits, ref_token = ref.step(m, k, self.device)
        self.counts["reference_steps"] += len(ref.steps) - before
        self.seconds["reference"] += time.perf_counter() - t0
        tokens = self._tokens(g, n)
        if q < n:
            token = tokens[q]
        elif g.at.get(q, (None,))[0] == ev.input_token:
            token = g.at[q][1]
        else:  # a token the history did not produce here: another than the colocated run's
            token = (ref.input(m, k, self.device) + 1 + ev.input_token % (m.vocab - 1)) % m.vocab
        t0 = time.perf_counter()
        prefix = self._gather(ev.worker, ev.blocks, _low(m, q), q)
        logits, kv = _forward(m, prefix, [token], q, self.device)
        self.seconds["decode"] += time.perf_counter() - t0
        self.counts["decode"] += 1
        self.real.pending = (q, kv)
        try:
            self.real.apply(ev, line)
        finally:
            self.real.pending = None
        row = logits[0]
        mine = int(row.argmax())
        g.at[q + 1] = (ev.output_token, mine)
        g.decodes += 1
        if g.diverged or torch.equal(row, ref_logits):
            return None
        g.diverged = True
        diff = (row - ref_logits).abs().max().item()
        big: float | str = "nan" if math.isnan(diff) else diff
        rq = ref.start + k
        where = f"position {q}" + ("" if q == rq else f" (the colocated step {k} decodes at {rq})")
        changed = mine != ref_token
        tg = self.tags._gens.get(key)
        commit = tg.committed[2] if tg is not None and tg.committed else None
        return LogitDivergence(
            LOGIT_DIVERGENCE,
            line,
            f"decode step {k} of {_tb._fmt(key)} at {where} on {ev.worker!r}: its logits differ from "
            f"the colocated run's by up to {'NaN' if big == 'nan' else f'{diff:.3g}'} (greedy token "
            + (f"changed: {mine} instead of {ref_token}" if changed else f"unchanged: {mine}")
            + "): the KV it read through its block table, or its input token, is not what colocated "
            "decoding has",
            _tb._witness([commit, g.prefill_line], line),
            request=ev.request,
            gen=ev.gen,
            worker=ev.worker,
            step=k,
            position=q,
            reference_position=rq,
            max_difference=big,
            token_changed=changed,
            token=mine,
            expected_token=ref_token,
        )
