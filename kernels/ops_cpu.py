"""The C kernels (kernels/csrc/lynx_codec.c, built as `lynx_kernels._ckernels`) behind the fused
run API on CPU, called through ctypes.

`lynx_kernels.fused` calls `encode_run`, `apply_anchor_run` and `apply_residual_run` after it has
validated the arguments; each is one C call per (layer, kind) run, and ctypes releases the GIL for
its duration. The C code is bit-identical to the torch reference (tests/kernels/test_cpu.py). The
extension is optional: `available()` is False when it was not built (no compiler at install time),
and `unavailable_reason()` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
from collections.abc import Iterator

import numpy as np
import torch

from . import exact
from .codec import quantization_input, unrepresentable_limit
from .rotation import inv_sqrt, rotation_signs
from .spec import CodecError, CodecSpec, StreamKind, Target

_OK, _E_INPUT = 0, 1
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_KIND_CODES = {StreamKind.K: 0, StreamKind.V: 1}
_ERR_LEN = 512


class _Params(ctypes.Structure):
    """Mirrors `lynx_params` in lynx_codec.c."""

    _fields_ = [
        ("dtype", ctypes.c_int32), ("kind", ctypes.c_int32), ("exact", ctypes.c_int32),
        ("over_tokens", ctypes.c_int32), ("rotate", ctypes.c_int32), ("flags", ctypes.c_int32),
        ("anchor_bits", ctypes.c_int32), ("group_size", ctypes.c_int32),
        ("heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("sink", ctypes.c_int32),
        ("recent", ctypes.c_int32), ("seed", ctypes.c_uint32), ("layer", ctypes.c_int32),
        ("request_tag", ctypes.c_uint64), ("total_tokens", ctypes.c_int64),
        ("chunk_tokens", ctypes.c_int64), ("pool_rows", ctypes.c_int64),
        ("pool_stride", ctypes.c_int64), ("inv_sqrt_d", ctypes.c_float),
        ("limit", ctypes.c_float), ("class_offset", ctypes.c_int32), ("k_base", ctypes.c_int32),
        ("signs", ctypes.c_void_p),
    ]


def _load(path: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The C codec at `path` (default: the built `lynx_kernels._ckernels`), or None and why not."""
    if path is None:
        spec = importlib.util.find_spec("lynx_kernels._ckernels")
        if spec is None or not spec.origin:
            return None, ("lynx_kernels._ckernels is not built (reinstall with a C compiler: "
                          "pip install -e .)")
        path = spec.origin
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    ptr, i64, cp = ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p
    params = ctypes.POINTER(_Params)
    lib.lynx_init.restype = None
    lib.lynx_isa.restype = ctypes.c_char_p
    lib.lynx_crc32.argtypes = [ctypes.c_uint32, ptr, i64]
    lib.lynx_crc32.restype = ctypes.c_uint32
    lib.lynx_encode_run.argtypes = [params, ptr, ptr, ptr, i64, ptr, i64, ptr, cp, i64]
    lib.lynx_apply_anchor_run.argtypes = [params, ptr, i64, ptr, ptr, cp, i64]
    lib.lynx_apply_residual_run.argtypes = [params, ptr, i64, ptr, i64, ptr, ptr, cp, i64]
    for fn in (lib.lynx_encode_run, lib.lynx_apply_anchor_run, lib.lynx_apply_residual_run):
        fn.restype = ctypes.c_int
    lib.lynx_init()
    return lib, ""


_LIB, _WHY = _load()


@contextlib.contextmanager
def library_at(path: str) -> Iterator[None]:
    """Runs impl="cpu" with another build of the C codec (same ABI) inside the block: for
    comparing two builds in one process (scripts/ab_codec_builds.py); not thread-safe."""
    global _LIB
    lib, why = _load(path)
    if lib is None:
        raise CodecError(why)
    saved, _LIB = _LIB, lib
    try:
        yield
    finally:
        _LIB = saved


def available() -> bool:
    return _LIB is not None


def unavailable_reason() -> str:
    return _WHY


def isa() -> str:
    """The instruction set the C kernels run with on this CPU ("x86-64-v4", "x86-64-v3" or "baseline")."""
    return _lib().lynx_isa().decode()


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise CodecError(f"impl='cpu' needs the C extension: {_WHY}")
    return _LIB


def crc32(data, crc: int = 0) -> int:
    """zlib.crc32 computed by the C code (tests check the two agree)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return _lib().lynx_crc32(crc, arr.ctypes.data, arr.size)


@functools.lru_cache(maxsize=256)
def _base_params(spec: CodecSpec, kind: StreamKind, dtype: torch.dtype, heads: int, head_dim: int,
                 flags: int) -> tuple[_Params, torch.Tensor]:
    """The per-layout part of a run's C parameters (cached: it costs more than a small run), and
    the signs tensor they point into (the cache entry keeps it alive)."""
    coding = exact.CODINGS[dtype]
    signs = rotation_signs(head_dim, spec.rotation_seed)
    return _Params(
        dtype=_DTYPE_CODES[dtype], kind=_KIND_CODES[kind],
        exact=int(spec.target is Target.EXACT), over_tokens=int(spec.groups_over_tokens(kind)),
        rotate=int(spec.rotate), flags=flags, anchor_bits=spec.anchor_bits,
        group_size=spec.group_size, heads=heads, head_dim=head_dim, sink=spec.sink_tokens,
        recent=spec.recent_tokens, seed=spec.rotation_seed, inv_sqrt_d=inv_sqrt(head_dim),
        limit=unrepresentable_limit(spec.rotate, head_dim), class_offset=coding.class_offset,
        k_base=coding.k_base, signs=signs.data_ptr(),
    ), signs


def _params(spec: CodecSpec, kind: StreamKind, pool: torch.Tensor, layer: int, request_tag: int,
            total_tokens: int, chunk_tokens: int, flags: int) -> _Params:
    _, heads, head_dim = pool.shape
    params = _Params.from_buffer_copy(_base_params(spec, kind, pool.dtype, heads, head_dim, flags)[0])
    params.layer, params.request_tag, params.total_tokens = layer, request_tag, total_tokens
    params.chunk_tokens, params.pool_rows, params.pool_stride = (chunk_tokens, pool.shape[0],
                                                                 pool.stride(0))
    return params


def _check(rc: int, err: ctypes.Array) -> None:
    if rc != _OK:
        raise CodecError(err.value.decode(errors="replace"))


def encode_run(pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, kind: StreamKind,
               layer: int, chunk_tokens: int, request_tag: int, flags: int,
               anchor_out: np.ndarray, residual_out: np.ndarray | None) -> tuple[int, int]:
    """`encode_run_into` of lynx_kernels.fused (residual_out None: the Anchor only)."""
    params = _params(spec, kind, pool, layer, request_tag, len(slots), chunk_tokens, flags)
    written = (ctypes.c_int64 * 2)()
    err = ctypes.create_string_buffer(_ERR_LEN)
    res_ptr, res_cap = (None, 0) if residual_out is None else (residual_out.ctypes.data,
                                                               residual_out.size)
    rc = _lib().lynx_encode_run(ctypes.byref(params), pool.data_ptr(), slots.data_ptr(),
                                anchor_out.ctypes.data, anchor_out.size, res_ptr, res_cap,
                                written, err, _ERR_LEN)
    if rc == _E_INPUT:
        # The reference names the offending value; the C code only knows that there is one.
        quantization_input(pool[slots], spec, kind, layer)
    _check(rc, err)
    return written[0], written[1]


def apply_run(anchor: np.ndarray, residual: np.ndarray | None, pool: torch.Tensor,
              slots: torch.Tensor, spec: CodecSpec, kind: StreamKind, layer: int, request_tag: int,
              flags: int) -> None:
    """`apply_anchor_run` (residual None) or `apply_residual_run` of lynx_kernels.fused."""
    params = _params(spec, kind, pool, layer, request_tag, len(slots), 0, flags)
    err = ctypes.create_string_buffer(_ERR_LEN)
    if residual is None:
        rc = _lib().lynx_apply_anchor_run(ctypes.byref(params), anchor.ctypes.data, anchor.size,
                                          pool.data_ptr(), slots.data_ptr(), err, _ERR_LEN)
    else:
        rc = _lib().lynx_apply_residual_run(ctypes.byref(params), anchor.ctypes.data, anchor.size,
                                            residual.ctypes.data, residual.size, pool.data_ptr(),
                                            slots.data_ptr(), err, _ERR_LEN)
    _check(rc, err)
