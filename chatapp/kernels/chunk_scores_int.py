"""The prefill chunk's attention scores on integers: unsigned key bytes against int8 query lanes.

prefill_attention.chunk_attention multiplies a block of key rows by the chunk's queries held in
lanes (S^T = K Q^T). On floats that product runs at the FMA's peak (Zen 4: ~56 GMAC/s a core) and
was, with P V, three quarters of a 544-token chunk's time at 4,096 held rows: the reason a turn's
first token grew with the history held. ``vpdpbusd`` multiplies 64 byte pairs per instruction,
four times an FMA's 16, so on numerics ``fast`` where the CPU has it (decode_step.FAST_ATTN with
qk_int.INT_SCORES) the scores run on bytes:

- each key row of a block is quantised once per claim to unsigned bytes, affine per row
  (k ~ sk u + bk, u in 0..255: the rounding of an 8-bit KV cache, which costs SmolLM2 no
  measurable perplexity), whatever it was stored as (float16, float32, or a quantised middle
  already dequantised and turned back by its rotation delta);
- each query lane (a head at a token) symmetric per lane over its D elements
  (q ~ sq x, x in -127..127: llama.cpp's own choice, q8 queries against q8 keys, on its CPU);
- score = scale x (sk sq (u . x) + bk sq sum(x)): the integer dot product of 8 rows x 32 lanes in
  16 accumulators, 4 byte pairs per lane and step, then one FMA per 16 scores. (4 rows x 32 lanes
  had 8 accumulators, too few for vpdpbusd's 5-cycle latency at two a cycle: a 64-row block of 96
  lanes, D 64, one thread on the Xeon, 1.55 us against 1.35 on 8 rows.)

P V stays on floats: the probabilities span too many magnitudes for one byte scale.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, V16I, V64B, dot_i32_wide
from .llvm import F32
from .microkernels import _F32_1D, _U8_1D, _counted_loop, _int_args, _vload_f32
from .qk_int import INT_SCORES
from .simd import I64, V16F, declare_fma, hreduce, splat

_I8_1D = types.Array(types.int8, 1, "C")
_I32 = ir.IntType(32)
_V16U8 = ir.VectorType(ir.IntType(8), 16)
ROWS, LANES = 8, 32  # one call: 8 key rows x 32 query lanes


def _make_scores(isa: str, rows: int):
    @intrinsic
    def scores(typingctx, k, k_off, k_row, ksc, kbi, x, x_off, x_step, steps, lsc, lsu, l_off, s, s_off, s_si):
        if not (k == _U8_1D and x == _I8_1D and all(a == _F32_1D for a in (ksc, kbi, lsc, lsu, s))):
            return None
        ints = (k_off, k_row, x_off, x_step, steps, l_off, s_off, s_si)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None

        def codegen(context, builder, signature, args):
            ka, ksa, kba, xa, lsa, lua, sa = (context.make_array(signature.args[i])(context, builder, args[i])
                                              for i in (0, 3, 4, 5, 9, 10, 12))
            k_off_, k_row_, x_off_, x_step_, steps_, l_off_, s_off_, s_si_ = _int_args(
                context, builder, signature, args, (1, 2, 6, 7, 8, 11, 13, 14))
            D = builder.mul(steps_, ir.Constant(I64, 4))
            zero = ir.Constant(V16I, [0] * 16)
            i32p = _I32.as_pointer()

            def step(r, accs):
                xo = builder.add(x_off_, builder.mul(r, x_step_))
                xv = [builder.load(builder.bitcast(builder.gep(xa.data, [builder.add(xo, ir.Constant(I64, 64 * j))]),
                                                   V64B.as_pointer()), align=1) for j in range(2)]
                new = []
                for i in range(rows):
                    at = builder.add(builder.add(k_off_, builder.mul(D, ir.Constant(I64, i))),
                                     builder.mul(r, ir.Constant(I64, 4)))
                    word = builder.load(builder.bitcast(builder.gep(ka.data, [at]), i32p), align=1)
                    kv = builder.bitcast(splat(builder, word, V16I), V64B)
                    new += [dot_i32_wide(builder, isa, accs[2 * i + j], kv, xv[j]) for j in range(2)]
                return new

            finals = _counted_loop(builder, steps_, [zero] * (2 * rows), step)
            fma = declare_fma(builder)
            lane_sc = [_vload_f32(builder, lsa.data, builder.add(l_off_, ir.Constant(I64, 16 * j)), "f32")
                       for j in range(2)]
            lane_su = [_vload_f32(builder, lua.data, builder.add(l_off_, ir.Constant(I64, 16 * j)), "f32")
                       for j in range(2)]
            for i in range(rows):
                row = builder.add(k_row_, ir.Constant(I64, i))
                sk = splat(builder, builder.load(builder.gep(ksa.data, [row])), V16F)
                bk = splat(builder, builder.load(builder.gep(kba.data, [row])), V16F)
                out = builder.add(s_off_, builder.mul(s_si_, ir.Constant(I64, i)))
                for j in range(2):
                    val = builder.call(fma, [builder.sitofp(finals[2 * i + j], V16F), builder.fmul(sk, lane_sc[j]),
                                             builder.fmul(bk, lane_su[j])])
                    ptr = builder.bitcast(builder.gep(sa.data, [builder.add(out, ir.Constant(I64, 16 * j))]),
                                          V16F.as_pointer())
                    builder.store(val, ptr, align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(k, i64, i64, ksc, kbi, x, i64, i64, i64, lsc, lsu, i64, s, i64, i64), codegen

    scores.__doc__ = f"""s[s_off + i s_si + l] = ksc[k_row + i] lsc[l_off + l] raw(i, l)
    + kbi[k_row + i] lsu[l_off + l] for key rows i < {rows} and lanes l < 32, where
    raw(i, l) = sum_e k[k_off + i D + e] x(e, l), D = 4 steps, and
    x(e, l) = x[x_off + (e // 4) x_step + 4 l + e % 4] (int8 lanes, 4 elements of a lane together:
    vpdpbusd's operand); k unsigned bytes, rows of D."""
    return scores


# the intrinsic on integers where the CPU has vpdpbusd; elsewhere the portable code, which the
# tests run (chunk_attention never takes this route there)
scores8x32 = _make_scores(ISA if INT_SCORES else "generic", ROWS)


@intrinsic
def quantise_key_row(typingctx, kb, off, D, u, ksc, kbi, i):
    """Row i of D floats (a multiple of 16) at kb[off:] as unsigned bytes at u[off:], affine:
    kb ~ ksc[i] u + kbi[i] with kbi[i] = the row's min, ksc[i] = its range / 255 (0 for a constant
    row), u = trunc((kb - min) / ksc + 0.5). Vector min/max and conversions: the plain loop stayed
    scalar (~0.5 ns an element on Zen 4, as much as the integer scores it feeds)."""
    if not (kb == _F32_1D and u == _U8_1D and ksc == _F32_1D and kbi == _F32_1D):
        return None
    if not all(isinstance(t, types.Integer) for t in (off, D, i)):
        return None

    def codegen(context, builder, signature, args):
        ka, ua, sa, ba = (context.make_array(signature.args[j])(context, builder, args[j]) for j in (0, 3, 4, 5))
        off_, D_, i_ = _int_args(context, builder, signature, args, (1, 2, 6))

        def vmin(a, b):  # vminps: no NaN ordering to honour (minnum's would cost a compare and a blend)
            return builder.select(builder.fcmp_ordered("<", a, b), a, b)

        def vmax(a, b):
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)
        n16 = builder.sdiv(D_, ir.Constant(I64, 16))
        first = _vload_f32(builder, ka.data, off_, "f32")

        def at(c):
            return builder.add(off_, builder.mul(c, ir.Constant(I64, 16)))

        def span(c, accs):
            v = _vload_f32(builder, ka.data, at(c), "f32")
            return [vmin(accs[0], v), vmax(accs[1], v)]

        lo_v, hi_v = _counted_loop(builder, n16, [first, first], span)
        lo, hi = hreduce(builder, vmin, lo_v), hreduce(builder, vmax, hi_v)
        span_ = builder.fsub(hi, lo)
        sc = builder.fmul(span_, ir.Constant(F32, 1.0 / 255.0))
        pos = builder.fcmp_ordered(">", span_, ir.Constant(F32, 0.0))
        inv = builder.select(pos, builder.fdiv(ir.Constant(F32, 255.0), span_), ir.Constant(F32, 0.0))
        builder.store(sc, builder.gep(sa.data, [i_]))
        builder.store(lo, builder.gep(ba.data, [i_]))
        lo_s, inv_s = splat(builder, lo, V16F), splat(builder, inv, V16F)
        half = splat(builder, ir.Constant(F32, 0.5), V16F)
        fma = declare_fma(builder)

        def write(c, accs):
            v = _vload_f32(builder, ka.data, at(c), "f32")
            q = builder.fptoui(builder.call(fma, [builder.fsub(v, lo_s), inv_s, half]), _V16U8)
            builder.store(q, builder.bitcast(builder.gep(ua.data, [at(c)]), _V16U8.as_pointer()), align=1)
            return accs

        _counted_loop(builder, n16, [], write)
        return context.get_dummy_value()

    i64 = types.int64
    return types.void(kb, i64, i64, u, ksc, kbi, i64), codegen


@njit(nogil=True, cache=True)
def quantise_key_rows(kb, n, D, u, ksc, kbi):  # pragma: no cover - jitted
    """Rows 0..n-1 of kb [n x D float32] as unsigned bytes u [n x D] with per-row scale and bias
    (quantise_key_row)."""
    for i in range(n):
        quantise_key_row(kb, i * D, D, u, ksc, kbi, i)


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def quantise_query_lane(qr, D, scale, m, M, x, lsc, lsu):  # pragma: no cover - jitted
    """Lane m of M: the query qr [D] as int8 at x[(e // 4) 4M + 4m + e % 4] (scores4x32's layout),
    lsc[m] = scale x sq (what a raw dot is worth), lsu[m] = lsc[m] x the sum of its bytes (what a
    key row's bias adds)."""
    amax = np.float32(0.0)
    for e in range(D):
        amax = max(amax, abs(qr[e]))
    sq = amax / np.float32(127.0)
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    tot = 0
    for e in range(D):
        v = np.int32(np.rint(qr[e] * inv))
        x[(e // 4) * 4 * M + 4 * m + e % 4] = np.int8(v)
        tot += v
    lsc[m] = scale * sq
    lsu[m] = scale * sq * np.float32(tot)


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def zero_query_lane(D, m, M, x, lsc, lsu):  # pragma: no cover - jitted
    """Lane m scores 0 against every key (a lane past the chunk or before q_from)."""
    for e in range(D):
        x[(e // 4) * 4 * M + 4 * m + e % 4] = 0
    lsc[m] = 0.0
    lsu[m] = 0.0
