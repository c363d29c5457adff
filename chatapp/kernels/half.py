"""16-bit K/V in the kernels: float16 bits held as uint16 (numba has no float16 type).

The CPU fused routes keep the K/V cache as float16 (half the bytes a long-context decode step
streams, half the cache's memory); the attention kernels read float32 or uint16 buffers through
``as_f32`` (llvm.py) and write through ``store_f32``, so each kernel compiles once per cache
dtype. The conversions are plain LLVM ``fpext``/``fptrunc`` on ``half``: where the CPU has F16C
(``HAS_F16C``), the vectoriser turns a loop of them into ``vcvtph2ps``/``vcvtps2ph`` (8 or 16
lanes); elsewhere LLVM calls its scalar conversion routines, which is why ``auto`` keeps float32
K/V there (fused_settings.resolve_kv_dtype).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import carray, types
from numba.extending import intrinsic, overload

I16 = ir.IntType(16)


def _host_has_f16c() -> bool:
    try:
        features = binding.get_host_cpu_features()
    except RuntimeError:  # a host LLVM cannot describe
        return False
    return bool(features.get("f16c", False))


HAS_F16C = _host_has_f16c()
# the numpy element type each cache dtype is read as in the kernels
KV_NUMPY = {"float32": np.float32, "float16": np.uint16}


@intrinsic
def f32_to_half_bits(typingctx, x):
    """The IEEE half-precision bits (round to nearest even) of a float32, as a uint16."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), I16)

    return types.uint16(types.float32), codegen


def store_f32(a, i, x):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError("store_f32 is only callable from numba-compiled code")


@overload(store_f32, inline="always")
def _store_f32(a, i, x):
    """a[i] = x for a float32 array, or x's float16 bits for a uint16 one."""
    if not isinstance(a, types.Array):
        return None
    if a.dtype == types.float32:
        def store(a, i, x):
            a[i] = x
        return store
    if a.dtype == types.uint16:
        def store16(a, i, x):
            a[i] = f32_to_half_bits(np.float32(x))
        return store16
    return None


def _pointer_at(dtype):
    @intrinsic
    def at(typingctx, addr):
        if addr != types.int64:
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(dtype).as_pointer())

        return types.CPointer(dtype)(types.int64), codegen

    return at


f32_at = _pointer_at(types.float32)
u16_at = _pointer_at(types.uint16)
u8_at = _pointer_at(types.uint8)


def kv_buffer(addr, size, like):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError("kv_buffer is only callable from numba-compiled code")


@overload(kv_buffer, inline="always")
def _kv_buffer(addr, size, like):
    """The flat cache buffer at ``addr`` (``size`` elements) with ``like``'s element type
    (float32, or uint16 for float16 bits; uint8 for a quantised buffer's packed bytes): ``like``
    is an empty array that picks the dtype."""
    if not isinstance(like, types.Array):
        return None
    if like.dtype == types.float32:
        return lambda addr, size, like: carray(f32_at(addr), (size,))
    if like.dtype == types.uint16:
        return lambda addr, size, like: carray(u16_at(addr), (size,))
    if like.dtype == types.uint8:
        return lambda addr, size, like: carray(u8_at(addr), (size,))
    return None

