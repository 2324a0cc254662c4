"""Configuration of the reference model and its variants: sizes and fault
budgets.  Faults are actions; each kind may happen at most its budget times
in one run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._errors import UsageError, parse_int
from ..spec import POLICIES

__all__ = ["FAULT_KINDS", "ModelConfig", "parse_faults"]

#: Every fault kind, in the order drivers report them.
FAULT_KINDS = (
    "cancel",  # the client cancels the request, at any phase
    "dup",  # a control message is delivered twice
    "loss",  # a control message is lost
    "reorder",  # a control message other than the oldest is delivered next
    "restart",  # a P or D worker crashes and comes back with a new incarnation
    "timeout",  # a timer or lease expires
    "transfer_fail",  # the data plane fails a transfer
    "retry",  # the router retries a failed generation as a new one
)


def _faults(value: Mapping[str, int] | None) -> Mapping[str, int]:
    out = {kind: 0 for kind in FAULT_KINDS}
    for kind, budget in (value or {}).items():
        if kind not in out:
            raise UsageError("fault kind", kind, "one of " + ", ".join(FAULT_KINDS))
        if type(budget) is not int or budget < 0:
            raise UsageError(f"budget of fault {kind!r}", budget, "an integer >= 0")
        out[kind] = budget
    return out


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 1:
        raise UsageError(attribute.name, value, "an integer >= 1")


def _flag(instance: object, attribute: attrs.Attribute, value: bool) -> None:
    if type(value) is not bool:
        raise UsageError(attribute.name, value, "True or False")


def _policy(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in POLICIES:
        raise UsageError("policy", value, " or ".join(POLICIES))


@attrs.frozen(init=False)
class ModelConfig:
    """Sizes and fault budgets of one run of a handoff model.

    ``policy`` is the protocol family (the history header's word): ``"push"``
    (reserve D blocks first, P writes into D) or ``"pull"`` (prefill first, D
    reserves and reads from P).  ``mode`` is its old name: ``ModelConfig(mode=
    "pull")`` still works, and when both are given ``mode`` wins, so that
    ``attrs.evolve(config, mode="pull")`` works too.
    ``blocks`` is the pool size of every worker; a request's prompt of
    ``prompt_len`` tokens fills ``ceil(prompt_len / block_size)`` blocks.
    ``faults`` maps each kind of :data:`FAULT_KINDS` to its budget (missing
    kinds are 0).

    Format 1.1 behaviour, off by default (every flag off: the model, its
    state counts and its traces are those of format 1):

    - ``prefix_cache``: every prompt starts with the same prefix, and P
      caches it: the full blocks before the prompt's last token
      (``(prompt_len - 1) // block_size`` of them; at least one is needed).
      The first generation to prefill them on a P worker publishes them; a
      later prefill on that worker takes a reference on them (a ``share``
      event) instead of allocating and computing them, while any generation
      still holds them.  A block goes back to the pool when its last owner
      frees it (and is then evicted from the cache).
    - ``chunks``: the handoff is ``chunks`` transfers under one ticket, one
      after the other; each moves a range of the prompt's positions
      (``tokens=[lo, hi)``, split as evenly as possible) or, with
      ``layerwise``, one layer of ``chunks`` layers (``layers=[i, i+1)``).
      The KV is ready when every chunk has landed.

    Extensions for bugs the base protocol cannot express (docs/protocol.md,
    "Extensions"; off by default, and then the model is unchanged):

    - ``heartbeat`` (pull): P's source of a prefilled generation is held
      under a lease that D renews with heartbeats while it is alive; when
      D's heartbeats stop (D restarted since P told it the prefill was
      ready) the lease may expire (a ``timeout`` fault): P frees the source
      and the router fails the generation.  Without a heartbeat the source
      waits for D however long it takes (the base protocol).  No new event
      kind: the history format is unchanged.
    """

    policy: str = attrs.field(default="push", validator=_policy)
    requests: int = attrs.field(default=2, validator=_positive)
    prefill_workers: int = attrs.field(default=1, validator=_positive)
    decode_workers: int = attrs.field(default=1, validator=_positive)
    blocks: int = attrs.field(default=2, validator=_positive)
    block_size: int = attrs.field(default=4, validator=_positive)
    prompt_len: int = attrs.field(default=3, validator=_positive)
    max_new_tokens: int = attrs.field(default=2, validator=_positive)
    faults: Mapping[str, int] = attrs.field(factory=dict, converter=_faults, hash=False)
    prefix_cache: bool = attrs.field(default=False, validator=_flag)
    chunks: int = attrs.field(default=1, validator=_positive)
    layerwise: bool = attrs.field(default=False, validator=_flag)
    heartbeat: bool = attrs.field(default=False, validator=_flag)

    def __init__(self, *args: Any, mode: str | None = None, **kwargs: Any) -> None:
        if mode is not None:
            kwargs["policy"] = mode
        self.__attrs_init__(*args, **kwargs)  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        if self.prefix_cache and self.prefix_blocks < 1:
            raise UsageError(
                "prefix_cache with prompt_len",
                self.prompt_len,
                f"a prompt longer than one block (block_size {self.block_size}): the cached prefix is "
                "the full blocks before the last prompt token",
            )
        if self.layerwise and self.chunks < 2:
            raise UsageError("chunks with layerwise", self.chunks, "an integer >= 2 (one layer per chunk)")
        if not self.layerwise and self.chunks > self.prompt_len:
            raise UsageError(
                "chunks",
                self.chunks,
                f"at most prompt_len ({self.prompt_len}): a chunk moves at least one position",
            )

    @property
    def mode(self) -> str:
        """The old name of :attr:`policy` (read-only)."""
        return self.policy

    def __hash__(self) -> int:  # faults is a dict; hash its items
        return hash(
            (
                self.policy,
                self.requests,
                self.prefill_workers,
                self.decode_workers,
                self.blocks,
                self.block_size,
                self.prompt_len,
                self.max_new_tokens,
                tuple(sorted(self.faults.items())),
                self.prefix_cache,
                self.chunks,
                self.layerwise,
                self.heartbeat,
            )
        )

    @property
    def prefix_blocks(self) -> int:
        """Blocks of the cached prefix: the full blocks before the last prompt token."""
        return (self.prompt_len - 1) // self.block_size

    @property
    def chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """The ``[lo, hi)`` of each chunk: prompt positions, or layers with ``layerwise``."""
        total = self.chunks if self.layerwise else self.prompt_len
        return tuple((total * i // self.chunks, total * (i + 1) // self.chunks) for i in range(self.chunks))

    @property
    def features(self) -> frozenset[str]:
        """The format 1.1 features this configuration's histories use (empty: format 1)."""
        out = set()
        if self.prefix_cache:
            out.add("share")
        if self.chunks > 1:
            out.add("ranges")
        if self.layerwise:
            out.add("kv")
        return frozenset(out)

    @property
    def blocks_per_request(self) -> int:
        return -(-self.prompt_len // self.block_size)

    @classmethod
    def all_faults(cls, budget: int = 1, **kwargs: object) -> ModelConfig:
        """A configuration with every fault kind at ``budget``."""
        return cls(faults={kind: budget for kind in FAULT_KINDS}, **kwargs)  # type: ignore[arg-type]


#: The largest budget of one fault kind ``parse_faults`` takes: far past what an
#: exhaustive search can cover, small enough that a budget is never a huge number.
MAX_FAULT_BUDGET = 1000


def parse_faults(text: str) -> dict[str, int]:
    """Parse ``"cancel=1,dup=2"`` (also ``"all=1"`` and ``"none"``) into budgets."""
    text = text.strip()
    if text in ("", "none"):
        return {kind: 0 for kind in FAULT_KINDS}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(
                "--faults entry", part.strip(), "KIND=N with N an integer >= 0, e.g. cancel=1,dup=1"
            )
        budget = parse_int(value, f"budget in --faults {part.strip()}", minimum=0, maximum=MAX_FAULT_BUDGET)
        if name == "all":
            out.update({kind: budget for kind in FAULT_KINDS})
        elif name in FAULT_KINDS:
            out[name] = budget
        else:
            raise UsageError("fault kind", name, "all or one of " + ", ".join(FAULT_KINDS))
    return out
