"""Prefill products on integers (``cpu.numerics = fast``): 4 rows x 4 tokens per step.

A prefill chunk multiplies every weight row by T tokens. On float32 the nibbles are converted
and multiplied once per token (prefill_step's tile: ~75 GFLOP/s a core, which bounds a 7B
prefill at ~10 tokens/s on two cores). Here the chunk's activations are quantised once per
phase to int8 per block of lanes (``quantise_tokens``: the lanes int8dot.py's row kernel reads,
from the permuted activations prefill_step keeps), and each 64 packed bytes of 4 rows are
unpacked once (an AND and a shift per row) for 4 tokens: per row and token two ``vpdpbusd``
(128 multiply-adds), one conversion and two FMAs (scales, bias) as in the row kernel.

Lane layout and scale/bias vectors as int8dot.make_rows_i8 (the same helpers): lane l of a step
sums weights 8l..8l+7; ls/xs hold per token and lane the activation scale and the float sum.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, ISAS, V8F, V16I, V32B, V64B, WIDE, dot_i32_wide, lane_params, wide_steps
from .simd import I64, V16F, declare, hsum, is_c_array, vload

ROWS, TOKENS = 4, 4  # 4 x 4 measured best of 4x1, 4x2, 2x4, 8x2 (same process, busy machine)


def make_tile_i8(isa: str, group_size: int, rows: int = ROWS, tokens: int = TOKENS):
    """out[i * tokens + j] = row r0 + i times token t0 + j, biases included (i < rows, j < tokens).

    w: uint8 [N, K/2]; xqe/xqo: int8 [T, K/2]; ls/xs: float32 [T, K/8]; scales/biases: float32
    or uint16 [N, K/gs]; out: float32 [>= rows * tokens]; those rows and tokens must exist."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")

    @intrinsic
    def q4_tile_i8(typingctx, w, r0, xqe, xqo, ls, xs, t0, scales, biases, out):
        if not (is_c_array(w, (types.uint8,), 2) and is_c_array(xqe, (types.int8,), 2)
                and is_c_array(xqo, (types.int8,), 2)
                and is_c_array(ls, (types.float32,), 2) and is_c_array(xs, (types.float32,), 2)
                and is_c_array(scales, (types.float32, types.uint16), 2) and scales == biases
                and is_c_array(out, (types.float32,), 1)):
            return None
        half_scales = scales.dtype == types.uint16

        def codegen(context, builder, signature, args):
            wa, ea, oa, la, xa, sa, ba, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                                for i in (0, 2, 3, 4, 5, 7, 8, 9))
            r0v, t0v = args[1], args[6]
            row_bytes = builder.extract_value(wa.shape, 1)
            n_groups = builder.extract_value(sa.shape, 1)
            n_lanes_row = builder.udiv(row_bytes, ir.Constant(I64, 4))
            nstep = builder.udiv(row_bytes, ir.Constant(I64, WIDE))
            tail = builder.icmp_unsigned("!=", builder.urem(row_bytes, ir.Constant(I64, WIDE)),
                                         ir.Constant(I64, 0))
            fifteen, four = ir.Constant(V64B, [15] * 64), ir.Constant(V64B, [4] * 64)
            fma = declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(V16F, [V16F] * 3))
            elt = ir.HalfType() if half_scales else ir.FloatType()
            sdata, bdata = builder.bitcast(sa.data, elt.as_pointer()), builder.bitcast(ba.data, elt.as_pointer())
            wrows, srows, brows = [], [], []
            for i in range(rows):
                r = builder.add(r0v, ir.Constant(I64, i))
                wrows.append(builder.gep(wa.data, [builder.mul(r, row_bytes)]))
                srows.append(builder.gep(sdata, [builder.mul(r, n_groups)]))
                brows.append(builder.gep(bdata, [builder.mul(r, n_groups)]))
            toks = []
            for j in range(tokens):
                t = builder.add(t0v, ir.Constant(I64, j))
                toks.append((builder.gep(ea.data, [builder.mul(t, row_bytes)]),
                             builder.gep(oa.data, [builder.mul(t, row_bytes)]),
                             builder.gep(la.data, [builder.mul(t, n_lanes_row)]),
                             builder.gep(xa.data, [builder.mul(t, n_lanes_row)])))
            zero = ir.Constant(V16F, [0.0] * 16)
            izero = ir.Constant(V16I, [0] * 16)

            def step(base, accs, n_lanes):
                if n_lanes == 16:
                    load8 = lambda p, o: vload(builder, p, o, V64B)  # noqa: E731
                    loadf = lambda p, o: vload(builder, p, o, V16F)  # noqa: E731
                else:  # a half step: the upper half zero
                    pad = ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(32)) + [32] * 32)
                    v32z = ir.Constant(V32B, [0] * 32)
                    load8 = lambda p, o: builder.shuffle_vector(vload(builder, p, o, V32B), v32z, pad)  # noqa: E731
                    idx = ir.Constant(V16I, list(range(8)) + [8] * 8)
                    z8 = ir.Constant(V8F, [0.0] * 8)
                    loadf = lambda p, o: builder.shuffle_vector(vload(builder, p, o, V8F), z8, idx)  # noqa: E731
                lane0 = builder.udiv(base, ir.Constant(I64, 4))
                gidx = builder.udiv(builder.mul(base, ir.Constant(I64, 2)), ir.Constant(I64, group_size))
                tv = [(load8(e, base), load8(o, base), loadf(lp, lane0), loadf(xp, lane0)) for e, o, lp, xp in toks]
                out_accs = list(accs)
                for i in range(rows):
                    b = load8(wrows[i], base)
                    lo, hi = builder.and_(b, fifteen), builder.lshr(b, four)
                    ws = lane_params(builder, srows[i], gidx, group_size, n_lanes, half_scales)
                    wb = lane_params(builder, brows[i], gidx, group_size, n_lanes, half_scales)
                    for j, (xe, xo, lsv, xsv) in enumerate(tv):
                        d = dot_i32_wide(builder, isa, dot_i32_wide(builder, isa, izero, lo, xe), hi, xo)
                        k = i * tokens + j
                        acc = builder.call(fma, [builder.sitofp(d, V16F), builder.fmul(lsv, ws), out_accs[k]])
                        out_accs[k] = builder.call(fma, [wb, xsv, acc])
                return out_accs

            n_acc = rows * tokens
            finals = wide_steps(builder, nstep, tail, n_acc, zero, step, "tilei8")
            for i, f in enumerate(finals):
                builder.store(hsum(builder, f), builder.gep(outa.data, [ir.Constant(I64, i)]))
            return context.get_dummy_value()

        return types.none(w, r0, xqe, xqo, ls, xs, t0, scales, biases, out), codegen

    return q4_tile_i8


_TILES = {gs: make_tile_i8(ISA, gs) for gs in (32, 64, 128)}
_t32, _t64, _t128 = _TILES[32], _TILES[64], _TILES[128]


@njit(nogil=True, cache=True, inline="always")
def q4_tile_i8(w, r0, xq, t0, scales, biases, group_size, out):  # pragma: no cover - jitted
    """The ISA's tile kernel for ``group_size``; xq = (xqe, xqo, ls, xs) of quantise_tokens."""
    if group_size == 32:
        _t32(w, r0, xq[0], xq[1], xq[2], xq[3], t0, scales, biases, out)
    elif group_size == 64:
        _t64(w, r0, xq[0], xq[1], xq[2], xq[3], t0, scales, biases, out)
    else:
        _t128(w, r0, xq[0], xq[1], xq[2], xq[3], t0, scales, biases, out)


@njit(fastmath=True, nogil=True, cache=True)
def quantise_tokens(xp, block, xqe, xqo, ls, xs):  # pragma: no cover - jitted
    """xp [T, K] de-interleaved (even elements, then odd: prefill_step's layout) -> per token the
    int8 halves [T, K/2] and per lane of 8 natural elements the block scale and sum [T, K/8];
    ``block`` natural elements (8, 16 or 32) share a scale (max|x| / 127, nearest)."""
    T, K = xp.shape
    half = K // 2
    hb = block // 2
    for t in range(T):
        for b in range(K // block):
            m = np.float32(0.0)
            for j in range(b * hb, (b + 1) * hb):
                m = max(m, abs(xp[t, j]), abs(xp[t, half + j]))
            s = m / np.float32(127.0)
            inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
            for j in range(b * hb, (b + 1) * hb):
                xqe[t, j] = np.int8(np.int32(np.rint(xp[t, j] * inv)))
                xqo[t, j] = np.int8(np.int32(np.rint(xp[t, half + j] * inv)))
            for lane in range(b * block // 8, (b + 1) * block // 8):
                ls[t, lane] = s
        for lane in range(K // 8):
            acc = np.float32(0.0)
            for j in range(4 * lane, 4 * lane + 4):
                acc += xp[t, j] + xp[t, half + j]
            xs[t, lane] = acc
