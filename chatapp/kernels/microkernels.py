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

from .simd import I64, V16F, declare, declare_fma, hreduce, splat

A_ROWS = 4  # broadcast rows per outer-product call
_I16 = ir.IntType(16)
_V16H = ir.VectorType(_I16, 16)
_F32_1D = types.Array(types.float32, 1, "C")
_U16_1D = types.Array(types.uint16, 1, "C")
_U8_1D = types.Array(types.uint8, 1, "C")
_V16B = ir.VectorType(ir.IntType(8), 16)
_V8B = ir.VectorType(ir.IntType(8), 8)


def _vload_f32(builder: ir.IRBuilder, base_ptr, index, kind: str):
    """16 floats from element ``index`` of an array (unaligned), by ``kind``: "f32" float32,
    "f16" float16 bits (uint16), "u8" unsigned bytes, "u4" unsigned nibbles (element 2j in the
    low nibble of byte j, MLX's 4-bit layout; ``index`` even)."""
    if kind == "f32":
        return builder.load(builder.bitcast(builder.gep(base_ptr, [index]), V16F.as_pointer()), align=1)
    if kind == "f16":
        bits = builder.load(builder.bitcast(builder.gep(base_ptr, [index]), _V16H.as_pointer()), align=1)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)
    if kind == "u8":
        return builder.uitofp(builder.load(builder.bitcast(builder.gep(base_ptr, [index]), _V16B.as_pointer()),
                                           align=1), V16F)
    p = builder.gep(base_ptr, [builder.lshr(index, ir.Constant(index.type, 1))])
    half = builder.load(builder.bitcast(p, _V8B.as_pointer()), align=1)
    lo = builder.and_(half, ir.Constant(_V8B, [15] * 8))
    hi = builder.lshr(half, ir.Constant(_V8B, [4] * 8))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), 16), [i // 2 + 8 * (i % 2) for i in range(16)])
    return builder.uitofp(builder.shuffle_vector(lo, hi, mask), V16F)


def _kind(b, packed: int) -> str | None:
    """The loader kind of array type ``b`` (packed: 0 float, 8 or 4 quantised bits), or None."""
    if packed:
        return ("u8" if packed == 8 else "u4") if b == _U8_1D else None
    return {_F32_1D: "f32", _U16_1D: "f16"}.get(b)


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
        kind = _kind(b, 0)
        if not (a == _F32_1D and c == _F32_1D and kind):
            return None
        ints = (a_off, a_si, a_sr, b_off, b_sr, c_off, c_si, r_len, accumulate)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None

        def codegen(context, builder, signature, args):
            aa, ba, ca = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 4, 7))
            a_off_, a_si_, a_sr_, b_off_, b_sr_, c_off_, c_si_, r_len_, acc_flag = _int_args(
                context, builder, signature, args, (1, 2, 3, 5, 6, 8, 9, 10, 11))
            fma = declare_fma(builder)
            zero = ir.Constant(V16F, [0.0] * 16)

            def step(r, accs):
                a_r = builder.add(a_off_, builder.mul(r, a_sr_))
                b_r = builder.add(b_off_, builder.mul(r, b_sr_))
                bv = [_vload_f32(builder, ba.data, builder.add(b_r, ir.Constant(I64, 16 * j)), kind)
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
# the prefill's P V: 16 accumulators, which the FMA's latency needs (4 x 32: 5.3 us a 64-row block of
# SmolLM2's 96 lanes, 8 x 32: 4.5, one thread on the Xeon)
outer8x32 = _make_outer(8, 2)
outer4x64 = _make_outer(4, 4)
# the decode's P V (group_attention.py): rows = a KV group's query heads, lanes = head dims;
# rows x vectors <= 16 accumulators (of the 32 AVX-512 registers)
outer1x32, outer1x64, outer1x128 = _make_outer(1, 2), _make_outer(1, 4), _make_outer(1, 8)
outer2x32, outer2x64, outer2x128 = _make_outer(2, 2), _make_outer(2, 4), _make_outer(2, 8)
def _scalar_f32(builder: ir.IRBuilder, base_ptr, index, half: bool):
    """One float32 from element ``index`` of a float32 or float16-bits (uint16) array."""
    v = builder.load(builder.gep(base_ptr, [index]))
    return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType()) if half else v


def _make_outer_q(rows: int, vecs: int, bits: int):
    lanes = 16 * vecs
    kind = "u8" if bits == 8 else "u4"

    @intrinsic
    def outer_q(typingctx, a, a_off, a_si, b, b_off, b_sr, sc, bi, x0, x_sr, c, c_off, c_si, r_len, bsum, bs_off):
        if not (a == _F32_1D and c == _F32_1D and bsum == _F32_1D and b == _U8_1D and sc == bi
                and sc in (_F32_1D, _U16_1D)):
            return None
        ints = (a_off, a_si, b_off, b_sr, x0, x_sr, c_off, c_si, r_len, bs_off)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None
        half = sc == _U16_1D

        def codegen(context, builder, signature, args):
            aa, ba, sa, bia, ca, bsa = (context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 3, 6, 7, 10, 14))
            a_off_, a_si_, b_off_, b_sr_, x0_, x_sr_, c_off_, c_si_, r_len_, bs_off_ = _int_args(
                context, builder, signature, args, (1, 2, 4, 5, 8, 9, 11, 12, 13, 15))
            fma = declare_fma(builder)
            zero = ir.Constant(V16F, [0.0] * 16)
            fzero = ir.Constant(ir.FloatType(), 0.0)

            def step(r, accs):
                x = builder.add(x0_, builder.mul(r, x_sr_))
                f = _scalar_f32(builder, sa.data, x, half)
                bb = _scalar_f32(builder, bia.data, x, half)
                b_r = builder.add(b_off_, builder.mul(r, b_sr_))
                bv = [_vload_f32(builder, ba.data, builder.add(b_r, ir.Constant(I64, 16 * j)), kind)
                      for j in range(vecs)]
                new, sums = [], []
                for i in range(rows):
                    ai = builder.load(builder.gep(aa.data, [builder.add(builder.add(a_off_, r),
                                                                        builder.mul(a_si_, ir.Constant(I64, i)))]))
                    w = splat(builder, builder.fmul(ai, f), V16F)
                    new += [builder.call(fma, [w, bv[j], accs[vecs * i + j]]) for j in range(vecs)]
                    sums.append(builder.fadd(accs[rows * vecs + i], builder.fmul(ai, bb)))
                return new + sums

            finals = _counted_loop(builder, r_len_, [zero] * (rows * vecs) + [fzero] * rows, step)
            for i in range(rows):
                row = builder.add(c_off_, builder.mul(c_si_, ir.Constant(I64, i)))
                for j in range(vecs):
                    ptr = builder.bitcast(builder.gep(ca.data, [builder.add(row, ir.Constant(I64, 16 * j))]),
                                          V16F.as_pointer())
                    builder.store(builder.fadd(finals[vecs * i + j], builder.load(ptr, align=1)), ptr, align=1)
                builder.store(finals[rows * vecs + i],
                              builder.gep(bsa.data, [builder.add(bs_off_, ir.Constant(I64, i))]))
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(a, i64, i64, b, i64, i64, sc, bi, i64, i64, c, i64, i64, i64, bsum, i64), codegen

    outer_q.__doc__ = f"""P V over {bits}-bit values as stored, for i < {rows}, lanes {lanes}:

    c[i, 0:{lanes}] += sum_r a[i, r] * sc[x0 + r * x_sr] * q[r, 0:{lanes}] and
    bsum[bs_off + i] = sum_r a[i, r] * bi[x0 + r * x_sr], r < r_len: a[i, r] at a[a_off + i * a_si
    + r] (float32), q[r, :] the unsigned integers from element b_off + r * b_sr of b (uint8
    bytes; 4 bits: nibbles, element 2j in the low nibble of byte j), each row's scale and bias
    sc / bi (float32 or float16 bits) read as the rows go: P times each row's scale, never a
    dequantised value. The caller adds bsum[i] to each of the group's lanes."""
    return outer_q


# the decode's P V over a quantised middle (quant_split.py): rows = a KV group's query heads,
# lanes = one group's head dims (32 or 64 at a time)
outer_q8_1x32, outer_q8_1x64, outer_q8_2x32, outer_q8_2x64, outer_q8_4x32, outer_q8_4x64 = (
    _make_outer_q(r, v, 8) for r in (1, 2, 4) for v in (2, 4))
outer_q4_1x32, outer_q4_1x64, outer_q4_2x32, outer_q4_2x64, outer_q4_4x32, outer_q4_4x64 = (
    _make_outer_q(r, v, 4) for r in (1, 2, 4) for v in (2, 4))


def _transpose_add(builder: ir.IRBuilder, vecs: list, add=None):
    """16 <16 x float> vectors -> one whose lane i is the sum of vecs[i]'s lanes (``add``: the
    adding instruction, builder.fadd unless given; builder.add for integer lanes): at each of 4
    levels, pairs (x, y) become lo + hi, lo taking the even blocks of w lanes of x ++ y and hi
    the odd ones (w = 8, 4, 2, 1), which keeps each vector's partial sums together, in order."""
    w = 8
    while len(vecs) > 1:
        lo = [i for i in range(32) if (i // w) % 2 == 0]
        hi = [i for i in range(32) if (i // w) % 2 == 1]
        mlo = ir.Constant(ir.VectorType(ir.IntType(32), 16), lo)
        mhi = ir.Constant(ir.VectorType(ir.IntType(32), 16), hi)
        vecs = [(add or builder.fadd)(builder.shuffle_vector(x, y, mlo), builder.shuffle_vector(x, y, mhi))
                for x, y in zip(vecs[0::2], vecs[1::2])]
        w //= 2
    return vecs[0]


def _make_dots16(packed: int = 0):
    @intrinsic
    def dots16(typingctx, q, q_off, k, k_off, k_stride, length, scale, s, s_off):
        kind = _kind(k, packed)
        if not (q == _F32_1D and s == _F32_1D and kind):
            return None
        if not all(isinstance(t, types.Integer) for t in (q_off, k_off, k_stride, length, s_off)):
            return None
        if not isinstance(scale, types.Float):
            return None

        def codegen(context, builder, signature, args):
            qa, ka, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 7))
            q_off_, k_off_, k_stride_, length_, s_off_ = _int_args(context, builder, signature, args, (1, 3, 4, 5, 8))
            scale_ = context.cast(builder, args[6], signature.args[6], types.float32)
            fma = declare_fma(builder)
            zero = ir.Constant(V16F, [0.0] * 16)
            n_chunks = builder.sdiv(length_, ir.Constant(I64, 16))

            def step(c, accs):
                e = builder.mul(c, ir.Constant(I64, 16))
                qv = _vload_f32(builder, qa.data, builder.add(q_off_, e), "f32")
                out = []
                for i in range(16):
                    row = builder.add(k_off_, builder.add(builder.mul(k_stride_, ir.Constant(I64, i)), e))
                    out.append(builder.call(fma, [qv, _vload_f32(builder, ka.data, row, kind), accs[i]]))
                return out

            sums = _transpose_add(builder, _counted_loop(builder, n_chunks, [zero] * 16, step))
            res = builder.fmul(sums, splat(builder, scale_, V16F))
            ptr = builder.bitcast(builder.gep(sa.data, [s_off_]), V16F.as_pointer())
            builder.store(res, ptr, align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(q, i64, k, i64, i64, i64, types.float32, s, i64), codegen

    k_type = f"unsigned {packed}-bit integers (offsets in elements)" if packed else "float32 or float16 bits (uint16)"
    dots16.__doc__ = f"""s[s_off + i] = scale * sum_e q[q_off + e] * k[k_off + i * k_stride + e] for i < 16,
    e < length (a multiple of 16). q, s float32; k {k_type}."""
    return dots16


dots16 = _make_dots16()
# a quantised middle's keys as stored (quant_split.py): raw dot products, scaled per row by the caller
dots16_u8, dots16_u4 = _make_dots16(8), _make_dots16(4)


@intrinsic
def max16(typingctx, x, n16):
    """max(x[0:n16]) for n16 a multiple of 16 (> 0): a <16 x float> maxnum per 16 elements, then a
    reduction. The plain loop (``m = max(m, x[i])``) stays scalar even with fastmath: ~0.55 ns an
    element on Zen 4, as much as the exp that follows it in a softmax."""
    if not (x == _F32_1D and isinstance(n16, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        (n16_,) = _int_args(context, builder, signature, args, (1,))
        vmax = declare(builder.module, "llvm.maxnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
        first = _vload_f32(builder, xa.data, ir.Constant(I64, 0), "f32")

        def step(c, accs):
            v = _vload_f32(builder, xa.data, builder.mul(c, ir.Constant(I64, 16)), "f32")
            return [builder.call(vmax, [accs[0], v])]

        (acc,) = _counted_loop(builder, builder.sdiv(n16_, ir.Constant(I64, 16)), [first], step)
        return hreduce(builder, lambda a, b: builder.call(vmax, [a, b]), acc)

    return types.float32(x, n16), codegen
