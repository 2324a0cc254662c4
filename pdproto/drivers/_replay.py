"""Replaying as a library: :func:`replay` executes a history on real paged KV
buffers (the torch backend, or with ``model=`` a real transformer: the model
backend) while the monitor judges it, and returns a :class:`ReplayResult`.
Also the one place that loads those backends (:func:`load_torch_backend`,
:func:`torch_backend_factory`, :func:`load_model_backend`,
:func:`model_backend_factory`): torch and transformers are optional, and the
absence of either is one clear :class:`~pdproto.UsageError`."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from .._errors import MissingExtraError, UsageError
from ..spec import MAX_LINE_BYTES, Monitor, Violation, check_invariant_ids, open_history

#: the invariant id of the data-level check (the backend's)
KV_CORRUPTION = "kv-corruption"
#: the invariant id of the model backend's check: a decode step's logits differ
#: from those of a colocated run (``replay(..., model=...)``)
LOGIT_DIVERGENCE = "logit-divergence"
#: the invariants the backends report (data level)
DATA_INVARIANTS = (KV_CORRUPTION, LOGIT_DIVERGENCE)


def load_torch_backend() -> Any:
    """The package :mod:`pdproto.backends`, its torch backend loaded (imports
    torch); a :class:`~pdproto.MissingExtraError` (a
    :class:`~pdproto.PdprotoError`) naming ``pip install 'pdproto[torch]'``
    when PyTorch is not installed (:func:`pdproto.backends.require_torch`)."""
    from .. import backends

    backends.require_torch()
    return backends


def torch_backend_factory(**options: Any) -> Callable[[Any], Any]:
    """``factory(header) -> TorchBackend(header, **options)`` (for
    :func:`pdproto.fuzz`); loads torch now (see :func:`load_torch_backend`).
    A ``transport`` named here (``"nixl"``, ``"mooncake"``) is made now, once,
    and shared by every backend the factory makes (its agents are reused):
    ``factory.transport`` is it, and ``factory.close()`` closes it when the
    factory made it (call it when done; a transport object passed in is the
    caller's to close)."""
    tb = load_torch_backend()
    made = None
    if isinstance(options.get("transport"), str) and options["transport"] != "copy":
        made = options["transport"] = load_transport(options["transport"])

    def factory(header: Any) -> Any:
        return tb.TorchBackend(header, **options)

    def close() -> None:
        if made is not None:
            made.close()

    factory.transport = options.get("transport")  # type: ignore[attr-defined]
    factory.close = close  # type: ignore[attr-defined]
    return factory


def load_transport(name: Any) -> Any:
    """The transport ``name`` (``"copy"``, ``"nixl"``, ``"mooncake"``) made
    now (its library loaded), or ``name`` when it is a transport already; a
    :class:`~pdproto.MissingExtraError` naming the extra when its library is
    not installed."""
    return load_torch_backend().make_transport(name)


def load_model_backend() -> Any:
    """The package :mod:`pdproto.backends`, its model backend loaded (imports
    torch and transformers); a :class:`~pdproto.MissingExtraError` naming
    ``pip install 'pdproto[model]'`` when either is missing."""
    backends = load_torch_backend()
    try:
        importlib.import_module("transformers")
    except ImportError:
        raise MissingExtraError("the model backend (replay --model)", "transformers", "model") from None
    backends.ModelBackend  # noqa: B018 - loads the model backend
    return backends


def model_backend_factory(model: Any = "tiny-llama", **options: Any) -> Callable[[Any], Any]:
    """``factory(header) -> ModelBackend(header, model=model, **options)``
    (for :func:`pdproto.fuzz`; ``lambda: factory(header)`` for
    :func:`pdproto.explore`); loads the model now, once.  The options are
    :class:`~pdproto.backends._transformer.ModelBackend`'s (``tp``,
    ``threads``, ``boundary``, ...)."""
    mb = load_model_backend()
    loaded = mb.load_transformer(model) if isinstance(model, (str, os.PathLike)) else model

    def factory(header: Any) -> Any:
        return mb.ModelBackend(header, model=loaded, **options)

    return factory


def level(v: Violation) -> str:
    """``"data"`` for the backends' kv-corruption and logit-divergence, else ``"protocol"``."""
    return "data" if v.invariant in DATA_INVARIANTS else "protocol"


@attrs.frozen
class ReplayResult:
    """What :func:`replay` found: the monitor's and the backend's
    ``violations`` together, sorted by line; ``backend`` describes the KV
    buffers (device, dtype, shapes, bytes copied).  :meth:`to_dict` is the
    JSON object of ``pdproto replay --json``."""

    events: int
    requests: int
    policy: str
    complete: bool
    violations: tuple[Violation, ...]
    backend: Mapping[str, Any]

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def data_violations(self) -> int:
        return sum(1 for v in self.violations if v.invariant in DATA_INVARIANTS)

    @property
    def protocol_violations(self) -> int:
        return len(self.violations) - self.data_violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "events": self.events,
            "violations": [dict(v.to_dict(), level=level(v)) for v in self.violations],
            "protocol_violations": self.protocol_violations,
            "data_violations": self.data_violations,
            "requests": self.requests,
            "policy": self.policy,
            "complete": self.complete,
            "backend": dict(self.backend),
        }


def _check_shapes(
    layers: int | None, kv_heads: int | None, head_dim: int | None, block_size: int | None
) -> None:
    for name, value, low in (
        ("--layers", layers, 1),
        ("--kv-heads", kv_heads, 1),
        ("--head-dim", head_dim, 5),
    ):
        if value is not None and value < low:
            raise UsageError(name, value, f"an integer >= {low}")
    if block_size is not None and block_size < 1:
        raise UsageError("--block-size", block_size, "an integer >= 1")


def replay(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    dtype: str | None = None,
    tp: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    block_size: int | None = None,
    layout: str | None = None,
    scale: str | None = None,
    policy: str | None = None,
    complete: bool = False,
    skip: Iterable[str] = (),
    max_line_bytes: int = MAX_LINE_BYTES,
    max_memory: int | None = None,
    threads: int | None = 1,
    model: Any = None,
    transport: Any = None,
    timing: str = "adversarial",
) -> ReplayResult:
    """Replay the history at ``path`` (``"-"``: standard input) on one paged
    KV pool per worker, with the monitor judging it.

    ``tp`` is ``"P:D"``, the tensor-parallel sizes of prefill and decode
    workers.  Each shape option left None comes from the header (format
    1.1: ``kv``, and each worker's ``tp`` / ``pp``), else from the defaults
    (bfloat16, 1:1, 2 layers, 4 KV heads, head dim 8, block size 4, mha);
    one given explicitly overrides the header.  ``threads``: torch's
    intra-op threads during the replay (restored after; None leaves them):
    the per-block copies and checks are small, and on a busy machine waking
    threads for each costs more than it gains.  ``policy``,
    ``complete`` and ``skip`` are those of :func:`pdproto.audit`.  Needs
    torch (a :class:`~pdproto.UsageError` when it is missing).

    ``model``: a built-in model name (``tiny-llama``, ``tiny-qwen2``,
    ``tiny-mistral``, ``smollm2-135m``), the path of a local Hugging Face model
    folder, or a loaded model: replay with that real transformer (the model
    backend, which needs the ``model`` extra): P prefills, the real KV moves
    through the history's blocks, D decodes, and each decode step's logits
    are compared bit for bit with a colocated run (``logit-divergence``).  The
    layers and KV heads are then the model's (``layers`` / ``kv_heads`` must
    be left None), ``head_dim`` and ``dtype`` those of the ownership channel.

    ``transport``: how transfers move KV between the pools: ``"copy"``
    (default, ``Tensor.copy_``), ``"nixl"`` (NIXL agents over UCX on host
    memory; the ``nixl`` extra) or ``"mooncake"`` (Mooncake's transfer
    engine over TCP on loopback; the ``mooncake`` extra), or a transport
    object (reused; the caller closes it).  ``timing``: ``"adversarial"``
    (default: a transfer's bytes move at its read_done and write_done, the
    latest) or ``"eager"`` (posted at transfer_start and complete before the
    next event, the earliest).  See docs/replay.md."""
    tb = load_torch_backend()
    own = isinstance(transport, str) and transport != "copy"
    if model is not None and transport not in (None, "copy"):
        raise UsageError("--transport with --model", transport, "copy (the model backend moves KV itself)")
    if model is not None and timing != "adversarial":
        raise UsageError("--transfer-timing with --model", timing, "adversarial")
    tr = load_transport(transport) if transport is not None else None
    mb = None
    if model is not None:
        mb = load_model_backend()
        if layers is not None or kv_heads is not None:
            raise UsageError(
                "--layers/--kv-heads with --model",
                layers if layers is not None else kv_heads,
                "none: the model sets the layers and KV heads",
            )
        model = mb.load_transformer(model) if isinstance(model, (str, os.PathLike)) else model
    skipped = check_invariant_ids(skip)
    _check_shapes(layers, kv_heads, head_dim, block_size)
    if threads is not None and (type(threads) is not int or threads < 1):
        raise UsageError("--threads", threads, "an integer >= 1")
    before = tb.torch_threads(threads)
    try:
        return _replay(
            tb,
            path,
            device,
            dtype,
            tp,
            layers,
            kv_heads,
            head_dim,
            block_size,
            layout,
            scale,
            policy,
            complete,
            skipped,
            max_line_bytes,
            max_memory,
            mb,
            model,
            threads,
            tr,
            timing,
        )
    finally:
        if threads is not None:
            tb.torch_threads(before)
        if own and tr is not None:
            tr.close()


def _replay(
    tb: Any,
    path: str | os.PathLike[str],
    device: str,
    dtype: str | None,
    tp: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    block_size: int | None,
    layout: str | None,
    scale: str | None,
    policy: str | None,
    complete: bool,
    skipped: Any,
    max_line_bytes: int,
    max_memory: int | None,
    mb: Any = None,
    model: Any = None,
    threads: int | None = 1,
    transport: Any = None,
    timing: str = "adversarial",
) -> ReplayResult:
    with open_history(os.fspath(path), max_line_bytes=max_line_bytes) as reader:
        monitor = Monitor.from_header(reader.header, policy=policy, complete=complete, skip=skipped)
        limit = {} if max_memory is None else {"max_memory": max_memory}  # default: the backend's
        if mb is not None:
            backend = mb.ModelBackend(
                reader.header,
                model=model,
                device=device,
                dtype=dtype,
                tp=None if tp is None else tb.parse_tp(tp),
                head_dim=head_dim,
                block_size=block_size,
                layout=layout,
                scale=scale,
                threads=threads,
                **limit,
            )
        else:
            backend = tb.TorchBackend(
                reader.header,
                device=device,
                dtype=dtype,
                tp=None if tp is None else tb.parse_tp(tp),
                layers=layers,
                kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                layout=layout,
                scale=scale,
                transport=transport,
                timing=timing,
                policy=monitor.policy,
                **limit,
            )
        feed, apply = monitor.feed, backend.apply
        for line, event in reader:
            feed(event, line)
            apply(event, line)
        last = max(monitor.line, reader.line)
        monitor.line = last
        backend.line = max(backend.line, last)
        monitor.finish()
        backend.finish()
    merged = sorted(
        [(v.line, 0, i, v) for i, v in enumerate(monitor.violations)]
        + [(v.line, 1, i, v) for i, v in enumerate(backend.violations)]
    )
    return ReplayResult(
        events=monitor.events,
        requests=monitor.requests,
        policy=monitor.policy,
        complete=monitor.complete,
        violations=tuple(m[3] for m in merged),
        backend=_backend_info(backend),
    )


def _backend_info(backend: Any) -> dict[str, Any]:
    model = getattr(backend, "m", None)
    if model is not None:  # the model backend: its ownership channel's layout, and the model
        out = _backend_info(backend.tags)
        out["name"] = "model"
        out["model"] = backend.info()
        return out
    L = backend.layout
    out = {
        "name": "torch",
        "device": str(backend.device),
        "dtype": L.dtype,
        "tp": list(backend.tp),
        "layers": L.layers,
        "kv_heads": L.kv_heads,
        "head_dim": L.head_dim,
        "block_size": L.block_size,
        "layout": L.layout,
        "bytes_copied": backend.bytes_copied,
        "bytes_verified": backend.bytes_verified,
        "memory": backend.memory,
        "transport": backend.transport.name,
        "timing": backend.timing,
        "workers": {
            name: {"role": w.role, "tp": w.tp, "pp": w.pp, "blocks": w.nblocks}
            for name, w in sorted(backend._workers.items())
        },
    }
    if L.scale is not None:
        out["scale"] = L.scale
    if backend.transport.name != "copy":
        out["transport_statistics"] = backend.transport.statistics().to_dict()
    return out


__all__ = [
    "replay",
    "ReplayResult",
    "load_torch_backend",
    "torch_backend_factory",
    "load_transport",
    "load_model_backend",
    "model_backend_factory",
    "KV_CORRUPTION",
    "LOGIT_DIVERGENCE",
]
