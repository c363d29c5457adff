"""Register-blocked micro-kernels for attention, written in LLVM IR with 16-lane vectors.

- ``outerRxW``: c[R, W] (= or +=) a[R, r] b[r, W], summed over r: R broadcast scalars of ``a``
  times W / 16 vectors of ``b`` per step, R x W / 16 accumulators in registers for the whole
  reduction, no horizontal sums. The prefill's attention runs both of
  its products on it (queries in lanes); the decode's runs P V on it (head dims in lanes).
  ``b`` is float32 or float16 bits (uint16: K/V caches in float16, vcvtph2ps where the CPU
  has F16C).
- ``dots16``: 16 dot products of one vector with 16 rows (a query against 16 cached keys):
  a <16 x float> accumulator per row over the row's length, then one transpose-and-add tree
  (4 levels of two shuffles and an add) that leaves the 16 sums in one vector, in order: ~1
  shuffle-add per key instead of a 4-level horizontal sum per key.

The vectors are generic LLVM types (legal on every target: LLVM splits them into what the CPU
has), as in simd.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import I64, V16F, declare_fma, splat

A_ROWS = 4  # broadcast rows per outer-product call
_I16 = ir.IntType(16)
_V16H = ir.VectorType(_I16, 16)
_F32_1D = types.Array(types.float32, 1, "C")
_U16_1D = types.Array(types.uint16, 1, "C")


def _vload_f32(builder: ir.IRBuilder, base_ptr, index, half: bool):
    """16 floats from element ``index`` of a float32 or float16-bits (uint16) array (unaligned)."""
    p = builder.gep(base_ptr, [index])
    if not half:
        return builder.load(builder.bitcast(p, V16F.as_pointer()), align=1)
    bits = builder.load(builder.bitcast(p, _V16H.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)


def _int_args(context, builder, signature, args, idx):
    return [context.cast(builder, args[i], signature.args[i], types.int64) for i in idx]


def _counted_loop(builder: ir.IRBuilder, n, init: list, body):
    """Values after ``body(r, values)`` ran for r = 0 .. n - 1 from ``init`` (SSA phis: the loop
    carries them in registers). Returns the final values (``init`` when n <= 0)."""
    entry = builder.block
    loop = builder.append_basic_block("mk.loop")
    done = builder.append_basic_block("mk.done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(I64, 0)), loop, done)
    builder.position_at_end(loop)
    r = builder.phi(I64)
    r.add_incoming(ir.Constant(I64, 0), entry)
    phis = []
    for v in init:
        p = builder.phi(v.type)
        p.add_incoming(v, entry)
        phis.append(p)
    new = body(r, phis)
    nxt = builder.add(r, ir.Constant(I64, 1))
    r.add_incoming(nxt, builder.block)
    for p, v in zip(phis, new):
        p.add_incoming(v, builder.block)
    builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
    builder.position_at_end(done)
    out = []
    for v0, v in zip(init, new):
        f = builder.phi(v0.type)
        f.add_incoming(v0, entry)
        f.add_incoming(v, loop)
        out.append(f)
    return out


def _make_outer(rows: int, vecs: int):
    lanes = 16 * vecs

    @intrinsic
    def outer(typingctx, a, a_off, a_si, a_sr, b, b_off, b_sr, c, c_off, c_si, r_len, accumulate):
        if not (a == _F32_1D and c == _F32_1D and b in (_F32_1D, _U16_1D)):
            return None
        ints = (a_off, a_si, a_sr, b_off, b_sr, c_off, c_si, r_len, accumulate)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        half = b == _U16_1D

        def codegen(context, builder, signature, args):
            aa, ba, ca = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 4, 7))
            a_off_, a_si_, a_sr_, b_off_, b_sr_, c_off_, c_si_, r_len_, acc_flag = _int_args(
                context, builder, signature, args, (1, 2, 3, 5, 6, 8, 9, 10, 11))
            fma = declare_fma(builder)
            zero = ir.Constant(V16F, [0.0] * 16)

            def step(r, accs):
                a_r = builder.add(a_off_, builder.mul(r, a_sr_))
                b_r = builder.add(b_off_, builder.mul(r, b_sr_))
                bv = [_vload_f32(builder, ba.data, builder.add(b_r, ir.Constant(I64, 16 * j)), half)
                      for j in range(vecs)]
                new = []
                for i in range(rows):
                    ai = builder.load(builder.gep(aa.data, [builder.add(a_r, builder.mul(a_si_, ir.Constant(I64, i)))]))
                    s = splat(builder, ai, V16F)
                    new += [builder.call(fma, [s, bv[j], accs[vecs * i + j]]) for j in range(vecs)]
                return new

            finals = _counted_loop(builder, r_len_, [zero] * (rows * vecs), step)
            add = builder.icmp_signed("!=", acc_flag, ir.Constant(I64, 0))
            for i in range(rows):
                row = builder.add(c_off_, builder.mul(c_si_, ir.Constant(I64, i)))
                for j in range(vecs):
                    ptr = builder.bitcast(builder.gep(ca.data, [builder.add(row, ir.Constant(I64, 16 * j))]),
                                          V16F.as_pointer())
                    old = builder.load(ptr, align=1)
                    acc = finals[vecs * i + j]
                    builder.store(builder.select(add, builder.fadd(acc, old), acc), ptr, align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(a, i64, i64, i64, b, i64, i64, c, i64, i64, i64, i64), codegen

    outer.__doc__ = f"""c[i, 0:{lanes}] (= or +=) sum_r a[i, r] * b[r, 0:{lanes}] for i < {rows}, flat arrays:

    a[i, r] at a[a_off + i * a_si + r * a_sr] (float32 scalars, broadcast), b[r, 0:{lanes}] the
    {lanes} contiguous elements at b[b_off + r * b_sr] (float32, or float16 bits as uint16),
    c[i, 0:{lanes}] at c[c_off + i * c_si] (float32); r < r_len; accumulate != 0 adds to c."""
    return outer


outer4x32 = _make_outer(4, 2)
outer4x64 = _make_outer(4, 4)
# the decode's P V (group_attention.py): rows = a KV group's query heads, lanes = head dims;
# rows x vectors <= 16 accumulators (of the 32 AVX-512 registers)
outer1x32, outer1x64, outer1x128 = _make_outer(1, 2), _make_outer(1, 4), _make_outer(1, 8)
outer2x32, outer2x64, outer2x128 = _make_outer(2, 2), _make_outer(2, 4), _make_outer(2, 8)


def _transpose_add(builder: ir.IRBuilder, vecs: list):
    """16 <16 x float> vectors -> one whose lane i is the sum of vecs[i]'s lanes: at each of 4
    levels, pairs (x, y) become lo + hi, lo taking the even blocks of w lanes of x ++ y and hi
    the odd ones (w = 8, 4, 2, 1), which keeps each vector's partial sums together, in order."""
    w = 8
    while len(vecs) > 1:
        lo = [i for i in range(32) if (i // w) % 2 == 0]
        hi = [i for i in range(32) if (i // w) % 2 == 1]
        mlo = ir.Constant(ir.VectorType(ir.IntType(32), 16), lo)
        mhi = ir.Constant(ir.VectorType(ir.IntType(32), 16), hi)
        vecs = [builder.fadd(builder.shuffle_vector(x, y, mlo), builder.shuffle_vector(x, y, mhi))
                for x, y in zip(vecs[0::2], vecs[1::2])]
        w //= 2
    return vecs[0]


@intrinsic
def dots16(typingctx, q, q_off, k, k_off, k_stride, length, scale, s, s_off):
    """s[s_off + i] = scale * sum_e q[q_off + e] * k[k_off + i * k_stride + e] for i < 16,
    e < length (a multiple of 16). q, s float32; k float32 or float16 bits (uint16)."""
    if not (q == _F32_1D and s == _F32_1D and k in (_F32_1D, _U16_1D)):
        return None
    if not all(isinstance(t, types.Integer) for t in (q_off, k_off, k_stride, length, s_off)):
        return None
    if not isinstance(scale, types.Float):
        return None
    half = k == _U16_1D

    def codegen(context, builder, signature, args):
        qa, ka, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 7))
        q_off_, k_off_, k_stride_, length_, s_off_ = _int_args(context, builder, signature, args, (1, 3, 4, 5, 8))
        scale_ = context.cast(builder, args[6], signature.args[6], types.float32)
        fma = declare_fma(builder)
        zero = ir.Constant(V16F, [0.0] * 16)
        n_chunks = builder.sdiv(length_, ir.Constant(I64, 16))

        def step(c, accs):
            e = builder.mul(c, ir.Constant(I64, 16))
            qv = _vload_f32(builder, qa.data, builder.add(q_off_, e), False)
            out = []
            for i in range(16):
                row = builder.add(k_off_, builder.add(builder.mul(k_stride_, ir.Constant(I64, i)), e))
                out.append(builder.call(fma, [qv, _vload_f32(builder, ka.data, row, half), accs[i]]))
            return out

        sums = _transpose_add(builder, _counted_loop(builder, n_chunks, [zero] * 16, step))
        res = builder.fmul(sums, splat(builder, scale_, V16F))
        ptr = builder.bitcast(builder.gep(sa.data, [s_off_]), V16F.as_pointer())
        builder.store(res, ptr, align=1)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(q, i64, k, i64, i64, i64, types.float32, s, i64), codegen
