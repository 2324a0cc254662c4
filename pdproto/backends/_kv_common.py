"""The torch backend's shared vocabulary: dtypes, the value encoding, the KV layout
and small tensor helpers (see :mod:`._torch`)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np  # noqa: I001 - the torch extra brings it (torch.from_numpy needs it too)
import torch  # first: without the torch extra, the missing module is torch

from .._errors import UsageError, parse_int
from ._transport import RAW

KV_CORRUPTION = "kv-corruption"
KV_CORRUPTION_RULE = (
    "(data level, pdproto replay --backend torch) the KV a decode reads, or a commit makes "
    "readable, is not exactly its generation's: some position 0..position-1 holds poison, "
    "another generation's KV, KV of another position, head or input token"
)

#: The KV pools of one replay may take at most this many bytes unless the
#: caller (``max_memory=``, ``pdproto replay --max-memory``) allows more.
DEFAULT_MAX_MEMORY = 4 << 30

#: The torch dtype of each KV dtype name.
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FP8 = ("float8_e4m3fn", "float8_e5m2")
SCALES = ("per-tensor", "per-block", "per-head")
LAYOUTS = ("mha", "mla")
#: when a transfer's bytes move (TorchBackend(timing=...), pdproto replay --transfer-timing)
TIMINGS = ("adversarial", "eager")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of a 32-bit value stay inside int64
_NO_TOKEN = _M32  # token code of a position no write is expected to have made
_PROMPT = 0  # token code of prompt positions
_CODE_DIMS = 4  # tag lo, tag hi, position, head
_PROBE = ("<probe>", 0)
#: the value encoding of each dtype family: code radix R (codes 1..R in dims
#: 0-3), hashed half-range A and divisor S (hashed dims (k - A) / S, k in
#: 0..2A).  Every value is exact in the dtype (fp8: with a power-of-two scale).
_ENCODING = {"wide": (125, 127, 64), "float8_e4m3fn": (15, 15, 8), "float8_e5m2": (7, 7, 4)}


def _mix_py(*parts: int) -> int:
    x = 0x1234567
    for p in parts:
        x = (x ^ (p & _M32)) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (((x >> 16) ^ x) * _MUL) & _M32
        x = (x >> 16) ^ x
    return x


def _position_hash(tag: int, position: int, code: int) -> int:
    """32 bits of (tag, position, token code): the seed of a row's hashed dims."""
    x = (tag * 0x9E3779B1 + position * 0x85EBCA77 + (code & _M32) * 0xC2B2AE3D + 0x51ED) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def torch_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count to ``threads`` (None: leave it) and
    return the count it had before (to set it back)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return before


def parse_tp(text: str | Sequence[int] | None) -> tuple[int, int]:
    """``"2:1"`` -> ``(2, 1)``: P-side and D-side tensor-parallel sizes."""
    if text is None:
        return (1, 1)
    if not isinstance(text, str):
        a, b = text
        parts = [a, b]
    else:
        bits = text.split(":")
        if len(bits) != 2:
            raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1")
        try:
            parts = [parse_int(b, "--tp", minimum=1) for b in bits]
        except UsageError:
            raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1") from None
    if any(type(p) is not int or p < 1 for p in parts):
        raise UsageError("--tp", text, "P:D with two integers >= 1, e.g. 2:1")
    return (parts[0], parts[1])


def rank_heads(tp: int, kv_heads: int) -> list[list[int]]:
    """The global KV heads each rank of a ``tp``-sized worker holds.

    ``tp <= kv_heads``: rank ``r`` holds ``[r*H/tp, (r+1)*H/tp)``; ``tp >
    kv_heads``: heads are replicated, rank ``r`` holds head ``r // (tp/H)``.
    """
    if type(tp) is not int or tp < 1:
        raise UsageError("tensor-parallel size", tp, "an integer >= 1")
    if tp <= kv_heads:
        if kv_heads % tp:
            raise UsageError("tensor-parallel size", tp, f"a divisor or multiple of the {kv_heads} KV heads")
        n = kv_heads // tp
        return [list(range(r * n, (r + 1) * n)) for r in range(tp)]
    if tp % kv_heads:
        raise UsageError("tensor-parallel size", tp, f"a divisor or multiple of the {kv_heads} KV heads")
    rep = tp // kv_heads
    return [[r // rep] for r in range(tp)]


@attrs.frozen
class KVLayout:
    """The shape of every worker's paged KV pool.  ``layout`` ``"mla"``: one
    latent vector of ``head_dim`` per token and layer (no heads, no separate
    K and V).  ``scale`` (fp8 dtypes only): ``"per-tensor"``, ``"per-block"``
    or ``"per-head"``."""

    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 8
    block_size: int = 4
    dtype: str = "bfloat16"
    layout: str = "mha"
    scale: str | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("layers", "kv_heads", "block_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise UsageError(name, v, "an integer >= 1")
        if type(self.head_dim) is not int or self.head_dim < _CODE_DIMS + 1:
            raise UsageError("head_dim", self.head_dim, f"an integer >= {_CODE_DIMS + 1}")
        if canonical_dtype(self.dtype) != self.dtype:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.layout not in LAYOUTS:
            raise UsageError("layout", self.layout, "one of " + ", ".join(LAYOUTS))
        if self.layout == "mla" and self.kv_heads != 1:
            object.__setattr__(self, "kv_heads", 1)
        radix = self.encoding[0]
        if self.kv_heads > radix:
            raise UsageError("kv_heads", self.kv_heads, f"at most {radix} with {self.dtype}")
        if self.dtype in FP8:
            if self.scale is None:
                object.__setattr__(self, "scale", "per-tensor")
            if self.scale not in SCALES:
                raise UsageError("scale", self.scale, "one of " + ", ".join(SCALES))
        elif self.scale is not None:
            raise UsageError("scale", self.scale, "no scale: only an fp8 dtype has scales")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def kv(self) -> int:
        """K and V (2), or the one latent of MLA (1)."""
        return 1 if self.layout == "mla" else 2

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8

    @property
    def encoding(self) -> tuple[int, int, int]:
        return _ENCODING.get(self.dtype, _ENCODING["wide"])

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all heads (all ranks of a tp=1 worker)."""
        return self.layers * self.kv * self.kv_heads * self.block_size * self.head_dim * self.elem_bytes


def canonical_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in TORCH_DTYPES:
        raise UsageError("dtype", name, "one of " + ", ".join(TORCH_DTYPES) + " (or bf16, fp16, fp32, fp8)")
    return name


def _heads_per_rank(tp: int, kv_heads: int) -> int:
    """KV heads each rank of a ``tp``-sized worker holds (see :func:`rank_heads`)."""
    return kv_heads // tp if tp <= kv_heads else 1


def _bit_table(values: Sequence[float], dtype: torch.dtype) -> tuple[str, list[int | float]]:
    """(array typecode, the entry of each value) to build a tensor of ``dtype``
    with :func:`torch.frombuffer` (the values are exact in ``dtype``)."""
    if dtype == torch.float32:
        return "f", list(values)
    if dtype == torch.float64:
        return "d", list(values)
    if dtype == torch.float16:
        return "H", [struct.unpack("<H", struct.pack("<e", v))[0] for v in values]
    if dtype == torch.bfloat16:
        return "H", [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values]
    raise UsageError("value dtype", str(dtype), "float32, float64, float16 or bfloat16")


#: the numpy dtype whose items a bit table's array typecode holds (bits of 16-bit floats as int16)
_NP_BITS = {"f": np.float32, "d": np.float64, "H": np.int16}

_RAW = RAW  # the integer dtype of each width (one table, the transport's)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its width: index_select / index_copy_ /
    index_fill_ are bit copies then (fp8 has no such kernels on CPU, and the
    integer ones are several times faster than bfloat16's)."""
    return t.view(_RAW[t.element_size()]) if t.is_floating_point() else t


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """libc's ``memcmp`` through ctypes, or None where it cannot be found."""
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        fn = ctypes.CDLL(name).memcmp if name else None
    except (ImportError, OSError, AttributeError):  # pragma: no cover - no libc
        return None
    if fn is None:  # pragma: no cover
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _load_memcmp()


def _slots(pool: torch.Tensor) -> torch.Tensor:
    """A pool ``[blocks, block_size, ...]`` viewed as ``[blocks * block_size, ...]`` (slot ``b * bs + s``)."""
    return pool.view((pool.shape[0] * pool.shape[1],) + tuple(pool.shape[2:]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal (no expected value is NaN, and a NaN's bits differ
    from every value's).  Contiguous CPU tensors of one shape and dtype are
    compared with ``memcmp`` (a third faster than ``torch.equal`` on large
    rows); others in the widest integers the rows allow (several times
    faster than comparing bfloat16 elements)."""
    if (
        _MEMCMP is not None
        and not a.is_cuda
        and not b.is_cuda
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.is_contiguous()
        and b.is_contiguous()
    ):
        n = a.numel() * a.element_size()
        return n == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    width = a.shape[-1] * a.element_size()
    for size, dtype in ((8, torch.int64), (4, torch.int32)):
        if width % size == 0 and size > a.element_size():
            try:
                return torch.equal(a.view(dtype), b.view(dtype))
            except RuntimeError:  # a stride that does not allow the view
                break
    return torch.equal(_bytes(a), _bytes(b))


def _nan_bits(dtype: torch.dtype) -> int:
    """The integer whose bits are a NaN of ``dtype`` (see :func:`_bytes`)."""
    return int(
        torch.tensor(float("nan"), dtype=dtype).view(_RAW[torch.empty((), dtype=dtype).element_size()])
    )


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError("device", str(device), "cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device", str(device), "cpu (no CUDA device is available here)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError("device", str(device), "cpu or cuda (cuda:N)")
    return dev


def _amount(n: int) -> str:
    """An integer for a message, huge ones shortened."""
    return f"{n:,}" if n < 10**15 else f"~10**{len(str(n)) - 1}"


def _fmt(key: tuple[str, int]) -> str:
    return f"request {key[0]!r} gen {key[1]}"


def _witness(lines: Iterable[int | None], line: int) -> tuple[int, ...]:
    return tuple(sorted({w for w in lines if w is not None and w != line and w > 0}))
