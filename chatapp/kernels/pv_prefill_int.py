"""The prefill chunk's P V over a quantised middle's 8-bit values on integers: two rows a product.

prefill_attention.chunk_attention runs O^T [e, m] += sum_n V [n, e] P^T [n, m] for a block of key
rows with the query lanes m in vectors (microkernels.outer4x32: 4 broadcast values times two
16-lane vectors of weights, one FMA per row and lane). For SmolLM2's 544-token chunk after 4,096
cached rows that P V was the largest share of the attention (22 of ~40 ms a layer on one thread)
and ran at the FMA's peak. A middle's values are bytes already (MLX's affine rows: v = s_n q + b_n
per row and group), and ``vpdpwssd`` takes two 16-bit pairs a lane at the FMA's rate (measured on
the Xeon: 7.2 G instructions/s for both, two a cycle), so on integers one instruction does two rows.

Per block of key rows (at most ``MAX_ROWS``) and value group g, each lane's weights w [n, m] =
P [n, m] x s_ng (the row's value scale folded in, which MLX's rows may hold negative) are rounded
to 16-bit integers against the lane's largest magnitude in the block (``quantise_weights``), two
rows' weights interleaved in a dword per lane; the values are the stored bytes widened to 16 bits,
two rows interleaved per column (``value_pairs``, once per KV head and thread, as the float path
dequantises once). ``pairs8x32`` then sums int32 products over the block's row pairs and adds
float(sum) x the lane's step plus the lane's bias term, sum_n P [n, m] b_ng (the same for every
column of the group), to O^T. The rounding is at most half a step, 1/65,534 of the lane's largest
weight in the block: far below the values' own 8-bit steps. The int32 sums stay below 2^31 (64
rows x 255 x 32,767).

One thread on the Xeon, a block of 64 rows x 96 lanes (SmolLM2's 3 query heads x 32 tokens), D 64:
floats 4.5 us (outer8x32; 5.3 on outer4x32), integers 3.4 (the weights 0.8 of it; 8 broadcast
columns a call, 16 accumulators: with 4 columns and 8, LLVM split half the vpdpwssd into
vpmaddwd + vpaddd to shorten the latency chain, 3.3 us for the products alone against 2.4).
Preparing the pairs costs ~3 ns a row (one shuffle per 16 columns of two rows).

Where the CPU has no ``vpdpwssd`` the portable IR's widen-multiply-add is what LLVM makes of it
(``vpmaddwd`` on AVX2): the tests run that build anywhere. chunk_attention takes this route where
its scores run on integers (numerics fast on a CPU with vpdpbusd, which has vpdpwssd too) and the
middle holds 8 bits; the window's rows and the chunk's own stay on floats.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, V16I
from .llvm import as_f32
from .microkernels import _F32_1D, _U8_1D, _counted_loop, _int_args
from .pv_int import _pair_dot
from .qk_int import INT_SCORES
from .simd import I64, V16F, declare, declare_fma, splat, vload

MAX_ROWS = 64  # key rows a block may hold: 32 pairs x 2 x 255 x 32,767 < 2^31
WMAX = np.float32(32767.0)
ROWS = 8  # value columns (broadcast) per pairs call: 16 accumulators (8 had left vpdpwssd's latency showing)
LANES = 32  # query lanes per call: two 16-lane vectors
VECS = LANES // 16
_I32_1D = types.Array(types.int32, 1, "C")
_I32 = ir.IntType(32)


def make_pairs(isa: str, rows: int):
    """``pairs(a, a_off, a_sp, b, b_off, b_sp, c, c_off, c_si, n_pairs, lsc, lbi, l_off)``:

        c[c_off + i c_si + l] += float(sum_{p < n_pairs} a[a_off + p a_sp + i] . b[b_off + p b_sp + l])
                                 x lsc[l_off + l] + lbi[l_off + l]        for i < ``rows``, l < 32

    where "." is the sum of the products of two int16 pairs packed in an int32 (``vpdpwssd``)."""

    @intrinsic
    def pairs(typingctx, a, a_off, a_sp, b, b_off, b_sp, c, c_off, c_si, n_pairs, lsc, lbi, l_off):
        if not (a == _I32_1D and b == _I32_1D and c == _F32_1D and lsc == _F32_1D and lbi == _F32_1D):
            return None
        if not all(isinstance(t, types.Integer) for t in (a_off, a_sp, b_off, b_sp, c_off, c_si, n_pairs, l_off)):
            return None

        def codegen(context, builder, signature, args):
            aa, ba, ca, sa, la = (context.make_array(signature.args[i])(context, builder, args[i])
                                  for i in (0, 3, 6, 10, 11))
            a_off_, a_sp_, b_off_, b_sp_, c_off_, c_si_, n_, l_off_ = _int_args(
                context, builder, signature, args, (1, 2, 4, 5, 7, 8, 9, 12))
            fma = declare_fma(builder)

            def step(p, accs):
                a_p = builder.add(a_off_, builder.mul(p, a_sp_))
                b_p = builder.add(b_off_, builder.mul(p, b_sp_))
                bv = [vload(builder, ba.data, builder.add(b_p, ir.Constant(I64, 16 * j)), V16I) for j in range(2)]
                new = []
                for i in range(rows):
                    ai = builder.load(builder.gep(aa.data, [builder.add(a_p, ir.Constant(I64, i))]))
                    s = splat(builder, ai, V16I)
                    new += [_pair_dot(builder, isa, accs[2 * i + j], bv[j], s) for j in range(2)]
                return new

            finals = _counted_loop(builder, n_, [ir.Constant(V16I, [0] * 16)] * (2 * rows), step)
            steps = [vload(builder, sa.data, builder.add(l_off_, ir.Constant(I64, 16 * j)), V16F) for j in range(2)]
            bias = [vload(builder, la.data, builder.add(l_off_, ir.Constant(I64, 16 * j)), V16F) for j in range(2)]
            for i in range(rows):
                row = builder.add(c_off_, builder.mul(c_si_, ir.Constant(I64, i)))
                for j in range(2):
                    ptr = builder.bitcast(builder.gep(ca.data, [builder.add(row, ir.Constant(I64, 16 * j))]),
                                          V16F.as_pointer())
                    old = builder.fadd(builder.load(ptr, align=1), bias[j])
                    got = builder.sitofp(finals[2 * i + j], V16F)
                    builder.store(builder.call(fma, [got, steps[j], old]), ptr, align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(a, i64, i64, b, i64, i64, c, i64, i64, i64, lsc, lbi, i64), codegen

    return pairs


pairs8x32 = make_pairs(ISA if INT_SCORES else "generic", ROWS)


@intrinsic
def interleave_rows(typingctx, v, lo, hi, vp, dst, D):
    """vp[dst + e] = v[lo + e] | v[hi + e] << 16 for e < D (a multiple of 16): two byte rows as
    int16 pairs, 16 columns a step."""
    if not (v == _U8_1D and vp == _I32_1D and all(isinstance(t, types.Integer) for t in (lo, hi, dst, D))):
        return None

    def codegen(context, builder, signature, args):
        va, pa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3))
        lo_, hi_, dst_, D_ = _int_args(context, builder, signature, args, (1, 2, 4, 5))
        v16s = ir.VectorType(ir.IntType(16), 16)
        mix = ir.Constant(ir.VectorType(_I32, 32), [x for i in range(16) for x in (i, 16 + i)])

        def step(k, acc):
            at = builder.mul(k, ir.Constant(I64, 16))
            a, b = (builder.zext(vload(builder, va.data, builder.add(base, at), ir.VectorType(ir.IntType(8), 16)),
                                 v16s) for base in (lo_, hi_))
            words = builder.bitcast(builder.shuffle_vector(a, b, mix), V16I)
            builder.store(words, builder.bitcast(builder.gep(pa.data, [builder.add(dst_, at)]), V16I.as_pointer()),
                          align=1)
            return acc

        _counted_loop(builder, builder.sdiv(D_, ir.Constant(I64, 16)), [], step)
        return context.get_dummy_value()

    return types.void(v, types.int64, types.int64, vp, types.int64, types.int64), codegen


@njit(nogil=True, cache=True)
def value_pairs(vq, vs, vbias, p_base, s_base, r0, n, D, ng, last, vp, vsc, vbi):  # pragma: no cover - jitted
    """Rows r0 .. r0 + n - 1 (r0 even) of one head's 8-bit middle (MLX's layout: its bytes from
    vq[p_base], its groups' scales and biases, float32 or float16 bits, from s_base) as int16
    pairs: vp[(r // 2) D + e] (int32) holds row r's byte e (r even) in its low half and row r + 1's
    in its high half; a pair's second row past ``last`` (the middle's final row) repeats the first
    (pairs8x32 meets it with a weight of 0). vsc / vbi[r ng + g]: row r's group-g scale and bias."""
    for r in range(r0, r0 + n, 2):
        interleave_rows(vq, p_base + r * D, p_base + min(r + 1, last) * D, vp, (r // 2) * D, D)
    for r in range(r0, r0 + n):
        for g in range(ng):
            vsc[r * ng + g] = as_f32(vs[s_base + r * ng + g])
            vbi[r * ng + g] = as_f32(vbias[s_base + r * ng + g])


@intrinsic
def weights32(typingctx, st, n, M, l0, vsc, vbi, x0, ng, w, lsc, lbi):
    """Lanes l0 .. l0 + 31 (two vectors: two chains of maxima and sums, whose latency one alone
    had left showing) of a block's group weights (n key rows; P^T in st [n, M]; row i's value
    scale and bias at vsc / vbi[x0 + i ng]): lsc[l] = the lane's largest |st[i, l] x scale_i| /
    32,767, lbi[l] = sum_i st[i, l] x bias_i, and w[(i // 2) M + l] packs round(st[i, l] x scale_i /
    lsc[l]) of rows i (low half) and i + 1 (high half; 0 past n)."""
    if not (st == _F32_1D and vsc == _F32_1D and vbi == _F32_1D and w == _I32_1D and lsc == _F32_1D
            and lbi == _F32_1D):
        return None
    if not all(isinstance(t, types.Integer) for t in (n, M, l0, x0, ng)):
        return None

    def codegen(context, builder, signature, args):
        sa, sca, bia, wa, lsa, lba = (context.make_array(signature.args[i])(context, builder, args[i])
                                      for i in (0, 4, 5, 8, 9, 10))
        n_, M_, l0_, x0_, ng_ = _int_args(context, builder, signature, args, (1, 2, 3, 6, 7))
        fma = declare_fma(builder)
        vmax = declare(builder.module, "llvm.maxnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
        fabs = declare(builder.module, "llvm.fabs.v16f32", ir.FunctionType(V16F, [V16F]))
        rint = declare(builder.module, "llvm.rint.v16f32", ir.FunctionType(V16F, [V16F]))
        zero = ir.Constant(V16F, [0.0] * 16)

        def row_p(i, k):
            return vload(builder, sa.data, builder.add(builder.add(l0_, ir.Constant(I64, 16 * k)), builder.mul(i, M_)),
                         V16F)

        def param(arr, i):
            return splat(builder, builder.load(builder.gep(arr.data, [builder.add(x0_, builder.mul(i, ng_))])), V16F)

        def scan(i, acc):
            sc, bi = param(sca, i), param(bia, i)
            out = []
            for k in range(VECS):
                p = row_p(i, k)
                out += [builder.call(vmax, [acc[2 * k], builder.call(fabs, [builder.fmul(p, sc)])]),
                        builder.call(fma, [p, bi, acc[2 * k + 1]])]
            return out

        found = _counted_loop(builder, n_, [zero] * (2 * VECS), scan)
        wmax = ir.Constant(V16F, [float(WMAX)] * 16)
        invs = []
        for k in range(VECS):
            big, bsum = found[2 * k], found[2 * k + 1]
            invs.append(builder.select(builder.fcmp_ordered(">", big, zero), builder.fdiv(wmax, big), zero))
            at = builder.add(l0_, ir.Constant(I64, 16 * k))
            builder.store(builder.fdiv(big, wmax), builder.bitcast(builder.gep(lsa.data, [at]), V16F.as_pointer()),
                          align=1)
            builder.store(bsum, builder.bitcast(builder.gep(lba.data, [at]), V16F.as_pointer()), align=1)
        last = builder.sub(n_, ir.Constant(I64, 1))
        one = ir.Constant(I64, 1)

        def pack(j, acc):
            i0 = builder.mul(j, ir.Constant(I64, 2))
            i1 = builder.add(i0, one)
            past = builder.icmp_signed(">", i1, last)
            i1 = builder.select(past, last, i1)  # an odd block's last pair: row i0 again, weighed 0
            s0, s1 = param(sca, i0), builder.select(past, zero, param(sca, i1))
            for k in range(VECS):
                lo, hi = (builder.fptosi(builder.call(rint, [builder.fmul(builder.fmul(row_p(i, k), sc), invs[k])]),
                                         V16I) for i, sc in ((i0, s0), (i1, s1)))
                word = builder.or_(builder.and_(lo, ir.Constant(V16I, [0xFFFF] * 16)),
                                   builder.shl(hi, ir.Constant(V16I, [16] * 16)))
                dst = builder.add(builder.mul(j, M_), builder.add(l0_, ir.Constant(I64, 16 * k)))
                builder.store(word, builder.bitcast(builder.gep(wa.data, [dst]), V16I.as_pointer()), align=1)
            return acc

        pairs = builder.sdiv(builder.add(n_, one), ir.Constant(I64, 2))
        _counted_loop(builder, pairs, [], pack)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(st, i64, i64, i64, vsc, vbi, i64, i64, w, lsc, lbi), codegen


@njit(nogil=True, cache=True)
def middle_pv(st, n, M, ot, D, group, vp, r0, vsc, vbi, w, lsc, lbi):  # pragma: no cover - jitted
    """O^T [e, m] (ot, D x M) += sum over the block's n middle rows r0 .. (r0 even, n <= MAX_ROWS)
    of V [r, e] P^T [r - r0, m], on integers (M a multiple of LANES)."""
    ng = D // group
    pairs = (n + 1) // 2
    for g in range(ng):
        for l0 in range(0, M, LANES):
            weights32(st, n, M, l0, vsc, vbi, r0 * ng + g, ng, w, lsc, lbi)
        for mc in range(0, M, LANES):
            for e in range(g * group, (g + 1) * group, ROWS):
                pairs8x32(vp, (r0 // 2) * D + e, D, w, mc, M, ot, e * M + mc, M, pairs, lsc, lbi, mc)
