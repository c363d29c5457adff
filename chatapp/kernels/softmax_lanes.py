"""The online softmax's steps across query lanes, in 16-lane vectors (the prefill's attention).

prefill_attention holds a block's scores as S^T [rows, M lanes] and folds each block into a
running max and sum per lane. Written as numba loops (``new_max[m] = max(new_max[m], s)``,
``p = fast_exp(s - max)``) those steps stayed largely scalar, ~0.5 ns an element on the Xeon:
with the products on integers and prepared K/V rows, the softmax had become 30% of the chunk's
attention at 4,096 cached rows (SmolLM2, one thread, 11.6 of 39.3 ms a layer). Here each step is
a loop over 16-lane chunks of the lanes with the rows inside, the max in a register, and exp
the same Cephes polynomial as attention.fast_exp, on vectors.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .attention import _C1, _C2, _LOG2E, fast_exp
from .microkernels import _F32_1D, _counted_loop, _int_args, _vload_f32, max16
from .simd import I64, V16F, declare, declare_fma, hsum, splat

_I32 = ir.IntType(32)
_V16I = ir.VectorType(_I32, 16)
# attention.fast_exp's polynomial, highest power first
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _c(value: float):
    return ir.Constant(V16F, [float(value)] * 16)


def vexp16(builder: ir.IRBuilder, x):
    """exp(x) for 16 float32 lanes x <= 88, as attention.fast_exp: inputs below -87 give ~0."""
    fma = declare_fma(builder)
    vmax = declare(builder.module, "llvm.maxnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
    floor = declare(builder.module, "llvm.floor.v16f32", ir.FunctionType(V16F, [V16F]))
    x = builder.call(vmax, [x, _c(-87.0)])
    n = builder.call(floor, [builder.call(fma, [x, _c(_LOG2E), _c(0.5)])])
    r = builder.call(fma, [n, _c(-_C1), x])
    r = builder.call(fma, [n, _c(-_C2), r])
    p = _c(_POLY[0])
    for k in _POLY[1:]:
        p = builder.call(fma, [p, r, _c(k)])
    y = builder.fadd(builder.call(fma, [p, builder.fmul(r, r), r]), _c(1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, _V16I), ir.Constant(_V16I, [127] * 16)),
                       ir.Constant(_V16I, [23] * 16))
    return builder.fmul(y, builder.bitcast(bits, V16F))


def _store(builder: ir.IRBuilder, base_ptr, index, value) -> None:
    builder.store(value, builder.bitcast(builder.gep(base_ptr, [index]), V16F.as_pointer()), align=1)


def _lane_chunks(builder: ir.IRBuilder, M, body) -> None:
    """body(l) for l = 0, 16, ..., M - 16 (M a multiple of 16)."""
    def step(c, accs):
        body(builder.mul(c, ir.Constant(I64, 16)))
        return accs
    _counted_loop(builder, builder.sdiv(M, ir.Constant(I64, 16)), [], step)


def _typed(arrays, ints) -> bool:
    return all(a == _F32_1D for a in arrays) and all(isinstance(t, types.Integer) for t in ints)


@intrinsic
def lanes_max(typingctx, s, n, M, mx):
    """mx[l] = max(mx[l], s[i M + l] for i < n), l < M (M a multiple of 16)."""
    if not _typed((s, mx), (n, M)):
        return None

    def codegen(context, builder, signature, args):
        sa, ma = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3))
        n_, M_ = _int_args(context, builder, signature, args, (1, 2))
        vmax = declare(builder.module, "llvm.maxnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))

        def load(i, lane):
            return _vload_f32(builder, sa.data, builder.add(builder.mul(i, M_), lane), "f32")

        def chunk(lane):
            # rows in pairs, two chains (one alone waited on vmaxps' latency: 64 x 96 0.44 -> 0.2 us)
            def pair(j, accs):
                i = builder.mul(j, ir.Constant(I64, 2))
                return [builder.call(vmax, [accs[k], load(builder.add(i, ir.Constant(I64, k)), lane)])
                        for k in range(2)]
            top = _vload_f32(builder, ma.data, lane, "f32")
            even, odd = _counted_loop(builder, builder.sdiv(n_, ir.Constant(I64, 2)), [top, top], pair)
            last = builder.sub(n_, ir.Constant(I64, 1))
            # an odd n's last row: a loop of n % 2 steps (a row is read only where it exists)
            (acc,) = _counted_loop(builder, builder.srem(n_, ir.Constant(I64, 2)), [builder.call(vmax, [even, odd])],
                                   lambda r, accs: [builder.call(vmax, [accs[0], load(last, lane)])])
            _store(builder, ma.data, lane, acc)
        _lane_chunks(builder, M_, chunk)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(s, i64, i64, mx), codegen


@intrinsic
def lanes_exp(typingctx, s, n, M, mx, total):
    """s[i M + l] = exp(s[i M + l] - mx[l]) and total[l] += the n new values, for i < n, l < M."""
    if not _typed((s, mx, total), (n, M)):
        return None

    def codegen(context, builder, signature, args):
        sa, ma, ta = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 4))
        n_, M_ = _int_args(context, builder, signature, args, (1, 2))

        def chunk(lane):
            top = _vload_f32(builder, ma.data, lane, "f32")

            def row(i, accs):
                at = builder.add(builder.mul(i, M_), lane)
                p = vexp16(builder, builder.fsub(_vload_f32(builder, sa.data, at, "f32"), top))
                _store(builder, sa.data, at, p)
                return [builder.fadd(accs[0], p)]
            (acc,) = _counted_loop(builder, n_, [_vload_f32(builder, ta.data, lane, "f32")], row)
            _store(builder, ta.data, lane, acc)
        _lane_chunks(builder, M_, chunk)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(s, i64, i64, mx, total), codegen


@intrinsic
def lanes_scale(typingctx, o, n, M, f):
    """o[i M + l] *= f[l] for i < n, l < M."""
    if not _typed((o, f), (n, M)):
        return None

    def codegen(context, builder, signature, args):
        oa, fa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3))
        n_, M_ = _int_args(context, builder, signature, args, (1, 2))

        def chunk(lane):
            k = _vload_f32(builder, fa.data, lane, "f32")

            def row(i, accs):
                at = builder.add(builder.mul(i, M_), lane)
                _store(builder, oa.data, at, builder.fmul(_vload_f32(builder, oa.data, at, "f32"), k))
                return accs
            _counted_loop(builder, n_, [], row)
        _lane_chunks(builder, M_, chunk)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(o, i64, i64, f), codegen



@intrinsic
def row_exp_sum(typingctx, x, off, n16, top):
    """x[off + i] = exp(x[off + i] - top) for i < n16 (a multiple of 16); returns their sum."""
    if not (x == _F32_1D and all(isinstance(t, types.Integer) for t in (off, n16)) and isinstance(top, types.Float)):
        return None

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        off_, n16_ = _int_args(context, builder, signature, args, (1, 2))
        tv = splat(builder, context.cast(builder, args[3], signature.args[3], types.float32), V16F)

        def step(c, accs):
            at = builder.add(off_, builder.mul(c, ir.Constant(I64, 16)))
            p = vexp16(builder, builder.fsub(_vload_f32(builder, xa.data, at, "f32"), tv))
            _store(builder, xa.data, at, p)
            return [builder.fadd(accs[0], p)]
        (acc,) = _counted_loop(builder, builder.sdiv(n16_, ir.Constant(I64, 16)), [_c(0.0)], step)
        return hsum(builder, acc)

    return types.float32(x, types.int64, types.int64, types.float32), codegen


@njit(fastmath=True, nogil=True, cache=True)
def softmax_row(x, off, n):  # pragma: no cover - jitted
    """x[off:off + n] <- exp(x - max) on 16-lane vectors; returns (max, sum): the caller divides
    (attention.softmax_max_inplace's contract; a row of 1,023 scores on the Xeon, in L1: 0.48 ->
    0.42 ns an element)."""
    n16 = n // 16 * 16
    top = max16(x[off:], n16) if n16 else x[off]
    for j in range(n16, n):
        top = max(top, x[off + j])
    total = row_exp_sum(x, off, n16, top)
    for j in range(n16, n):
        p = fast_exp(x[off + j] - top)
        x[off + j] = p
        total += p
    return top, total


@njit(fastmath=True, nogil=True, cache=True)
def attention_mass_rows(s, N, L, mass):  # pragma: no cover - jitted
    """mass[n] += sum over the rows r of s [R, N] (R = G x L: G query heads x L queries, the
    last L of N tokens, causal among themselves) of softmax(row r)[n]: what each key gets of the
    queries' attention (sparsity.attention_mass). Row r is query r % L, seeing keys up to
    N - L + r % L. The rows are overwritten (by their exp)."""
    R = s.shape[0]
    flat = s.reshape(-1)
    for r in range(R):
        seen = N - L + r % L + 1
        base = r * N
        total = softmax_row(flat, base, seen)[1]
        inv = np.float32(1.0) / total
        for j in range(seen):
            mass[j] += flat[base + j] * inv
