"""MLX's affine quantisation and the keys' RoPE turn on 16-lane vectors (kernels/kv_rows.py).

kv_rows quantises rows as ``mx.quantize`` does, bit for bit, and a scored cache's eviction
re-quantises every kept key after the first evicted one (move_keys). Written as numba loops,
the group's min/max stayed scalar (vminss/vmaxss, fastmath's no-NaN flags notwithstanding),
each group went through two calls on array slices, and the turn's halves through a loop with
runtime alias checks: ~300 ns a row of 64 on the Xeon, 80-90 ms of a SmolLM2 eviction.

Here each step is a loop over 16-lane vectors: the same IEEE float32 operations, in the same
order on each value as kv_rows' scalar definition (no FMA, no reciprocal: LLVM emits exactly the
fsub/fdiv/fmul written here, since the builder sets no fast-math flags), so the bits do not
change. min and max are exact in any order, so their reduction across lanes is too (a signed
zero may come out either way; it never reaches a scale or a level, see kv_rows._quantize_row).
The vectors are generic LLVM types, legal on every target, as in simd.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .microkernels import _F32_1D, _U8_1D, _counted_loop, _int_args, _vload_f32
from .simd import I64, V16F, declare, hreduce, splat

_V16B = ir.VectorType(ir.IntType(8), 16)
_V8B = ir.VectorType(ir.IntType(8), 8)
_I32 = ir.IntType(32)


def _ints(*ts) -> bool:
    return all(isinstance(t, types.Integer) for t in ts)


def _store(builder: ir.IRBuilder, base_ptr, index, value) -> None:
    """``value`` (a vector) stored from element ``index`` of ``base_ptr`` (unaligned)."""
    builder.store(value, builder.bitcast(builder.gep(base_ptr, [index]), value.type.as_pointer()), align=1)


def _minmax(builder: ir.IRBuilder, name: str):
    fn = declare(builder.module, f"llvm.{name}.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
    return lambda a, b: builder.call(fn, [a, b])


@intrinsic
def range16(typingctx, x, off, n):
    """(min, max) of x[off:off + n], n a positive multiple of 16 (a quantisation group)."""
    if not (x == _F32_1D and _ints(off, n)):
        return None

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        off_, n_ = _int_args(context, builder, signature, args, (1, 2))
        vmin, vmax = _minmax(builder, "minnum"), _minmax(builder, "maxnum")
        first = _vload_f32(builder, xa.data, off_, "f32")

        def step(c, accs):
            v = _vload_f32(builder, xa.data, builder.add(off_, builder.mul(c, ir.Constant(I64, 16))), "f32")
            return [vmin(accs[0], v), vmax(accs[1], v)]

        rest = builder.sub(builder.sdiv(n_, ir.Constant(I64, 16)), ir.Constant(I64, 1))
        # step c reads vector c + 1: the first one seeds both accumulators
        lo, hi = _counted_loop(builder, rest, [first, first],
                               lambda c, accs: step(builder.add(c, ir.Constant(I64, 1)), accs))
        pair = context.make_tuple(builder, signature.return_type,
                                  [hreduce(builder, vmin, lo), hreduce(builder, vmax, hi)])
        return pair

    return types.UniTuple(types.float32, 2)(x, off, n), codegen


@intrinsic
def levels16(typingctx, x, off, n, out, o, bias, scale, n_bins, bits):
    """The levels of x[off:off + n] (n a multiple of 16) into ``out`` from byte ``o``: each
    clamp(rint((x - bias) / scale), 0, n_bins) as a byte (8 bits), or two to a byte (4 bits:
    value 2j in the low nibble of byte j, MLX's layout)."""
    if not (x == _F32_1D and out == _U8_1D and _ints(off, n, o, bits)
            and all(t == types.float32 for t in (bias, scale, n_bins))):
        return None

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        oa = context.make_array(signature.args[3])(context, builder, args[3])
        off_, n_, o_, bits_ = _int_args(context, builder, signature, args, (1, 2, 4, 8))
        b, s, top = (splat(builder, args[i], V16F) for i in (5, 6, 7))
        rint = declare(builder.module, "llvm.rint.v16f32", ir.FunctionType(V16F, [V16F]))
        vmin, vmax = _minmax(builder, "minnum"), _minmax(builder, "maxnum")
        zero = ir.Constant(V16F, [0.0] * 16)
        four = builder.icmp_signed("==", bits_, ir.Constant(I64, 4))
        evens = ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2)))
        odds = ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2)))

        def step(c, accs):
            at = builder.mul(c, ir.Constant(I64, 16))
            v = _vload_f32(builder, xa.data, builder.add(off_, at), "f32")
            q = builder.call(rint, [builder.fdiv(builder.fsub(v, b), s)])
            u = builder.fptoui(vmin(vmax(q, zero), top), _V16B)
            with builder.if_else(four) as (nibbles, whole):
                with nibbles:
                    lo = builder.shuffle_vector(u, u, evens)
                    hi = builder.shuffle_vector(u, u, odds)
                    packed = builder.or_(lo, builder.shl(hi, ir.Constant(_V8B, [4] * 8)))
                    _store(builder, oa.data, builder.add(o_, builder.udiv(at, ir.Constant(I64, 2))), packed)
                with whole:
                    _store(builder, oa.data, builder.add(o_, at), u)
            return accs

        _counted_loop(builder, builder.sdiv(n_, ir.Constant(I64, 16)), [], step)
        return context.get_dummy_value()

    return types.void(x, off, n, out, o, bias, scale, n_bins, bits), codegen


@intrinsic
def turn_halves16(typingctx, x, xo, y, yo, cos, sin, to, half):
    """RoPE's turn of one row in the non-traditional pairing (i, i + half), half a multiple of
    16: with a = x[xo + i], b = x[xo + half + i], c = cos[to + i], s = sin[to + i],
    y[yo + i] = a c - b s and y[yo + half + i] = a s + b c (decode_step.apply_rope's order)."""
    if not (all(t == _F32_1D for t in (x, y, cos, sin)) and _ints(xo, yo, to, half)):
        return None

    def codegen(context, builder, signature, args):
        xa, ya, ca, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4, 5))
        xo_, yo_, to_, half_ = _int_args(context, builder, signature, args, (1, 3, 6, 7))

        def step(i, accs):
            k = builder.mul(i, ir.Constant(I64, 16))
            a = _vload_f32(builder, xa.data, builder.add(xo_, k), "f32")
            b = _vload_f32(builder, xa.data, builder.add(builder.add(xo_, half_), k), "f32")
            c = _vload_f32(builder, ca.data, builder.add(to_, k), "f32")
            s = _vload_f32(builder, sa.data, builder.add(to_, k), "f32")
            _store(builder, ya.data, builder.add(yo_, k), builder.fsub(builder.fmul(a, c), builder.fmul(b, s)))
            _store(builder, ya.data, builder.add(builder.add(yo_, half_), k),
                   builder.fadd(builder.fmul(a, s), builder.fmul(b, c)))
            return accs

        _counted_loop(builder, builder.sdiv(half_, ir.Constant(I64, 16)), [], step)
        return context.get_dummy_value()

    return types.void(x, xo, y, yo, cos, sin, to, half), codegen
