"""P V over a quantised middle's 8-bit values on integers: 16-bit weights, two rows a product.

quant_split's float P V (microkernels.outer_q8_*) turns each value byte into a float and meets
it with an FMA per query head: for SmolLM2's KV head (3 query heads of 64, padded to the kernel's
4 rows) a row costs 16 FMAs, 8 conversions and the broadcasts of its weights, the largest share of
a quantised row's attention once the scores run on integers (qk_int.py, qk_lanes.py).

Here a query head's weights for a block of ``BLOCK`` rows, w_r = p_r x s_r (its softmax numerator
times the row's value scale, which MLX's affine rows may hold negative), are rounded to 16-bit
integers against the block's largest magnitude (each block its own step, so a block far from the
peak keeps its precision), and two value rows meet a head in one ``vpdpwssd`` per 16 columns: their
bytes interleaved and widened to 16 bits (two unpacks and four widenings serve every head), the
pair of weights broadcast. The int32 sums go to floats once per block. A row then costs ~4
shuffles and widenings and 2 G products for 64 columns, against the float kernel's 16 FMAs and 8
conversions. The rounding is at most half a step, 1/65,534 of the block's largest weight, far below
the values' own 8-bit steps (1/255 of their range). Measured on the Xeon (one thread, a unit of
1,024 rows of SmolLM2's KV head in L2, called from numba): P V 7.2 -> 2.8 ns a row.

The interleave leaves each 64-column group's columns in a fixed order (``PERM``); the driver
accumulates in that order and puts the columns back once. The biases' share (sum_r p_r b_r, the
same for a group's columns) is summed on floats with the weights. A short last block is copied into
zero-padded scratch (the kernel reads BLOCK entries of p and of the scales); an odd block's last
pair reads its one row twice, the second time with a weight of 0.

Served where the decode's attention runs on integers (qk_int.INT_SCORES: the CPU has vpdpbusd,
so it has vpdpwssd) for 8-bit values in groups of 64, head_dim 64 or 128, and at least two query
heads per KV head (calls of 2-4 heads, qk_lanes.heads_at); elsewhere quant_split's float P V. The
portable IR (``generic``) is what the tests compile on a CPU without VNNI.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, V16I, V64B
from .llvm import F32
from .microkernels import _F32_1D, _U8_1D, _U16_1D, _counted_loop, _int_args
from .qk_int import INT_SCORES
from .qk_lanes import HEADS, heads_at
from .simd import I64, V16F, declare, declare_fma, hreduce, hsum, splat, vload

GROUP = 64  # columns a group: one 64-byte vector of a row
BLOCK = 64  # rows a weight scale: int32 sums of 32 pairs stay below 2^31 (32 x 2 x 255 x 32767)
WMAX = 32767.0
_I16_1D = types.Array(types.int16, 1, "C")
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_V32S = ir.VectorType(_I16, 32)
_V32I = ir.VectorType(_I32, 32)


def _perm() -> list[int]:
    """The column each accumulator lane holds: vector k's lane l is column PERM[16 k + l]."""
    lo = [16 * lane + i for lane in range(4) for i in range(8)]  # unpacklo: bytes 0-7 of each 16
    hi = [c + 8 for c in lo]
    return lo[:16] + lo[16:] + hi[:16] + hi[16:]


PERM = np.array(_perm(), np.int64)


def _pair_dot(builder: ir.IRBuilder, isa: str, acc, x, w):
    """acc (<16 x i32>) + per lane i: x[2i] w[2i] + x[2i+1] w[2i+1] (<32 x i16> as <16 x i32>)."""
    if isa == "vnni512":
        f = declare(builder.module, "llvm.x86.avx512.vpdpwssd.512", ir.FunctionType(V16I, [V16I] * 3))
        return builder.call(f, [acc, x, w])
    prod = builder.mul(builder.sext(builder.bitcast(x, _V32S), _V32I), builder.sext(builder.bitcast(w, _V32S), _V32I))
    ev = builder.shuffle_vector(prod, prod, ir.Constant(V16I, list(range(0, 32, 2))))
    od = builder.shuffle_vector(prod, prod, ir.Constant(V16I, list(range(1, 32, 2))))
    return builder.add(acc, builder.add(ev, od))


def _params(builder: ir.IRBuilder, arr, index, q: int, ng: int, j, half: bool):
    """<16 x float>: rows 16 q .. 16 q + 15's group-j entries (row i's at index + i * ng + j) of a
    scale or bias array (float32, or float16 bits): one load of the rows' 16 ng entries, then a
    shuffle per group and a select on the run-time j."""
    et = ir.IntType(16) if half else F32
    v = vload(builder, arr.data, builder.add(index, ir.Constant(I64, 16 * q * ng)), ir.VectorType(et, 16 * ng))
    out = None
    for g in range(ng):
        pick = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [i * ng + g for i in range(16)]))
        out = pick if out is None else builder.select(builder.icmp_signed("==", j, ir.Constant(I64, g)), pick, out)
    return builder.fpext(builder.bitcast(out, ir.VectorType(ir.HalfType(), 16)), V16F) if half else out


def make_pv_block(isa: str, heads: int, ng: int):
    """An intrinsic ``pv(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)``: one
    block of nb <= BLOCK rows of one 64-column group j of 8-bit value rows (D / 64 = ``ng`` groups
    a row), for h < ``heads``:

        o[o_off + h * D + k] += sum_{r < nb} p_hr x (sc_r x v[v_off + r * D + PERM[k]])
        bsum[h] += sum_{r < nb} p_hr x bi_r

    p_hr = s[s_off + h * L + r]; sc_r / bi_r = vs / vb[x0 + r * ng + j] (float32 or float16 bits).
    The BLOCK entries of p, vs and vb from each start are read whatever nb (the caller pads a short
    block), p past nb must be 0; value rows past nb are not read. w: int16 scratch [HEADS x BLOCK].
    The weights p_hr x sc_r go to integers against the block's largest, per head."""

    @intrinsic
    def pv(typingctx, s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum):
        if not (s == _F32_1D and v == _U8_1D and w == _I16_1D and o == _F32_1D and bsum == _F32_1D
                and vs == vb and vs in (_F32_1D, _U16_1D)):
            return None
        if not all(isinstance(t, types.Integer) for t in (s_off, L, x0, j, v_off, D, nb, o_off)):
            return None
        half = vs == _U16_1D

        def codegen(context, builder, signature, args):
            sa, vsa, vba, va, wa, oa, bsa = (context.make_array(signature.args[i])(context, builder, args[i])
                                             for i in (0, 3, 4, 7, 11, 12, 14))
            s_off_, L_, x0_, j_, v_off_, D_, nb_, o_off_ = _int_args(context, builder, signature, args,
                                                                   (1, 2, 5, 6, 8, 9, 10, 13))
            fma = declare_fma(builder)
            vmax = declare(builder.module, "llvm.maxnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
            fabs = declare(builder.module, "llvm.fabs.v16f32", ir.FunctionType(V16F, [V16F]))
            rint = declare(builder.module, "llvm.rint.v16f32", ir.FunctionType(V16F, [V16F]))
            f32 = lambda x: ir.Constant(F32, x)  # noqa: E731
            # the weights: per head, p x scale over the block's 4 x 16 rows, rounded against their max
            scs = [_params(builder, vsa, x0_, q, ng, j_, half) for q in range(BLOCK // 16)]
            bis = [_params(builder, vba, x0_, q, ng, j_, half) for q in range(BLOCK // 16)]
            steps = []
            for h in range(heads):
                row = builder.add(s_off_, builder.mul(L_, ir.Constant(I64, h)))
                ps = [vload(builder, sa.data, builder.add(row, ir.Constant(I64, 16 * q)), V16F)
                      for q in range(BLOCK // 16)]
                ws = [builder.fmul(p, sc) for p, sc in zip(ps, scs)]
                m = builder.call(fabs, [ws[0]])
                for x in ws[1:]:
                    m = builder.call(vmax, [m, builder.call(fabs, [x])])
                m = hreduce(builder, lambda a, b: builder.call(vmax, [a, b]), m)
                pos = builder.fcmp_ordered(">", m, f32(0.0))
                inv = builder.select(pos, builder.fdiv(f32(WMAX), m), f32(0.0))
                inv_v = splat(builder, inv, V16F)
                for q, x in enumerate(ws):
                    r = builder.fptosi(builder.call(rint, [builder.fmul(x, inv_v)]), V16I)
                    dst = builder.bitcast(builder.gep(wa.data, [ir.Constant(I64, h * BLOCK + 16 * q)]),
                                          ir.VectorType(_I16, 16).as_pointer())
                    builder.store(builder.trunc(r, ir.VectorType(_I16, 16)), dst, align=1)
                steps.append(builder.fdiv(m, f32(WMAX)))
                bacc = builder.fmul(ps[0], bis[0])
                for p, bi in zip(ps[1:], bis[1:]):
                    bacc = builder.call(fma, [p, bi, bacc])
                bptr = builder.gep(bsa.data, [ir.Constant(I64, h)])
                builder.store(builder.fadd(builder.load(bptr), hsum(builder, bacc)), bptr)
            # the pairs of rows: the second of an odd block's last pair is read as the first (its weight is 0)
            lo = [16 * lane + i for lane in range(4) for i in range(8)]
            unpack_lo = ir.Constant(ir.VectorType(_I32, 64), [x for c in lo for x in (c, 64 + c)])
            unpack_hi = ir.Constant(ir.VectorType(_I32, 64), [x for c in lo for x in (c + 8, 72 + c)])
            halves = [ir.Constant(ir.VectorType(_I32, 32), list(range(32 * k, 32 * k + 32))) for k in (0, 1)]
            pairs_ = builder.sdiv(builder.add(nb_, ir.Constant(I64, 1)), ir.Constant(I64, 2))
            last = builder.sub(nb_, ir.Constant(I64, 1))
            i32p = _I32.as_pointer()

            def pair(p, accs):
                r0 = builder.mul(p, ir.Constant(I64, 2))
                r1 = builder.add(r0, ir.Constant(I64, 1))
                r1 = builder.select(builder.icmp_signed(">", r1, last), last, r1)
                a, b = (vload(builder, va.data, builder.add(v_off_, builder.mul(r, D_)), V64B) for r in (r0, r1))
                xs = []  # PERM's vectors 0-3: lo[0:32], lo[32:64], hi[0:32], hi[32:64]
                for mask in (unpack_lo, unpack_hi):
                    inter = builder.shuffle_vector(a, b, mask)
                    for hm in halves:
                        xs.append(builder.bitcast(builder.zext(builder.shuffle_vector(inter, inter, hm), _V32S), V16I))
                new = []
                for h in range(heads):
                    wp = builder.bitcast(builder.gep(wa.data, [builder.add(ir.Constant(I64, h * BLOCK), r0)]), i32p)
                    wd = splat(builder, builder.load(wp, align=1), V16I)
                    new += [_pair_dot(builder, isa, accs[4 * h + k], xs[k], wd) for k in range(4)]
                return new

            outs = _counted_loop(builder, pairs_, [ir.Constant(V16I, [0] * 16)] * (4 * heads), pair)
            for h in range(heads):
                sc = splat(builder, steps[h], V16F)
                for k in range(4):
                    ph = outs[4 * h + k]
                    head = builder.mul(D_, ir.Constant(I64, h))
                    off = builder.add(o_off_, builder.add(head, ir.Constant(I64, 16 * k)))
                    ptr = builder.bitcast(builder.gep(oa.data, [off]), V16F.as_pointer())
                    builder.store(builder.call(fma, [sc, builder.sitofp(ph, V16F), builder.load(ptr, align=1)]), ptr,
                                  align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(s, i64, i64, vs, vb, i64, i64, v, i64, i64, i64, w, o, i64, bsum), codegen

    return pv


_ISA = ISA if INT_SCORES else "generic"
_PV = {(h, ng): make_pv_block(_ISA, h, ng) for h in range(2, HEADS + 1) for ng in (1, 2)}
_pv2a, _pv3a, _pv4a = (_PV[h, 1] for h in range(2, HEADS + 1))
_pv2b, _pv3b, _pv4b = (_PV[h, 2] for h in range(2, HEADS + 1))


@njit(nogil=True, cache=True, inline="always")
def _block(hc, ng, s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum):  # pragma: no cover - jitted
    if ng == 1:
        if hc == 2:
            _pv2a(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)
        elif hc == 3:
            _pv3a(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)
        else:
            _pv4a(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)
    elif hc == 2:
        _pv2b(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)
    elif hc == 3:
        _pv3b(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)
    else:
        _pv4b(s, s_off, L, vs, vb, x0, j, v, v_off, D, nb, w, o, o_off, bsum)


@njit(fastmath=True, nogil=True, cache=True)
def pv_lanes(G, D, s, L, n, vq, v_base, vs, vb, sv, o):  # pragma: no cover - jitted
    """o[g * D + e] = sum_r s[g * L + r] x value row r's element e (dequantised: scale x byte + bias)
    for g < G (2 or more), r < n, e < D (64 or 128): 8-bit rows in groups of 64 at
    vq[v_base + r * D], their groups' scales and biases at vs / vb[sv + r * ng + j] (float32 or
    float16 bits); o float32 [G * D] at least. A last block shorter than BLOCK is copied
    into padded scratch first (the kernel reads BLOCK entries of s, vs and vb)."""
    ng = D // GROUP
    w16 = np.empty(HEADS * BLOCK, np.int16)
    bsum = np.empty(HEADS, np.float32)
    tmp = np.empty(GROUP, np.float32)
    full = n // BLOCK * BLOCK
    rest = n - full
    ps = np.zeros(HEADS * BLOCK if rest else 0, np.float32)
    pvs = np.zeros(BLOCK * ng if rest else 0, vs.dtype)
    pvb = np.zeros(BLOCK * ng if rest else 0, vb.dtype)
    for r in range(rest * ng):
        pvs[r] = vs[sv + full * ng + r]
        pvb[r] = vb[sv + full * ng + r]
    for i in range(G * D):
        o[i] = 0.0
    g0 = 0
    while g0 < G:
        hc = heads_at(G - g0)
        for h in range(hc * (rest > 0)):
            for r in range(rest):
                ps[h * BLOCK + r] = s[(g0 + h) * L + full + r]
        for j in range(ng):
            c0 = j * GROUP
            bsum[:] = 0.0
            for r0 in range(0, full, BLOCK):
                _block(hc, ng, s, g0 * L + r0, L, vs, vb, sv + r0 * ng, j, vq, v_base + r0 * D + c0, D, BLOCK, w16, o,
                       g0 * D + c0, bsum)
            if rest:
                _block(hc, ng, ps, 0, BLOCK, pvs, pvb, 0, j, vq, v_base + full * D + c0, D, rest, w16, o, g0 * D + c0,
                       bsum)
            for h in range(hc):
                base = (g0 + h) * D + c0
                for k in range(GROUP):
                    tmp[PERM[k]] = o[base + k]
                for k in range(GROUP):
                    o[base + k] = tmp[k] + bsum[h]
        g0 += hc
