"""Scores against a quantised middle's 8-bit keys with the keys in lanes: several query heads per pass.

qk_int.py scores one query head at a time: each key row's bytes meet the head's two int8 planes
in ``vpdpbusd`` (16 lanes of 4-element partial sums), and 16 rows' lane vectors are then summed
by a transpose-and-add tree, per head. With a KV head's G query heads (SmolLM2: 3) that is G trees
of 30 shuffles and 15 adds per 16 rows, more work than the products themselves.

Here 16 rows' 64-byte groups are transposed once (16 x 16 dwords, 64 two-source shuffles), so that
vector d holds 4 bytes of each of the 16 rows, row i in lane i. A head's scores are then 16
``vpdpbusd`` per plane against its query's dword d broadcast: the 16 rows' integer dots land in
their lanes with no reduction, and the transpose serves every head and both planes. On SmolLM2's
layout (3 heads of 64, groups of 64) a row costs 4 shuffles and 6 products, against the tree's ~20
operations.

The integers are the ones qk_int.py computes (256 x hi-plane dot + lo-plane dot, exactly), and
the scale and bias of each row's group are applied by the same expression, so the scores are the
same floats: the tests compare them bit for bit.

Served: 8-bit keys in groups of 64 (MLX's default kv_group_size), head_dim 64 or 128, and 2 to
``HEADS`` query heads a call (``heads_at`` cuts larger groups: 5 = 3 + 2). One head alone gains
nothing (the transpose costs more than its one tree: one head of 64 measured 2.4 ns a row against
qk_int's 1.8), so quant_split keeps qk_int.py there. Measured on the Xeon (one thread, 1,024 rows
in L2, called from numba, ns a row): SmolLM2's 3 heads of 64 4.1 -> 3.1, 4 heads of 128 11.4 -> 6.6,
8 heads of 64 9.6 -> 6.7.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, V16I, V64B, dot_i32_wide
from .microkernels import _U16_1D, _int_args
from .qk_int import INT_SCORES, _group_params, scores_types
from .simd import I64, V16F, declare_fma, splat

GROUP = 64  # the group size served: one group is one 64-byte vector of a row
HEADS = 4  # query heads per call at most
CHUNKS = (1, 2)  # head_dim / 64: 64 and 128
_I32 = ir.IntType(32)


def transpose16(builder: ir.IRBuilder, rows: list) -> list:
    """16 <16 x i32> vectors -> their transpose: out[d] lane i = rows[i] lane d. At each of 4
    levels (w = 8, 4, 2, 1) the pair (i, i + w) swaps its off-diagonal w x w blocks."""
    rows = list(rows)
    w = 8
    while w >= 1:
        keep = ir.Constant(ir.VectorType(_I32, 16), [l if (l // w) % 2 == 0 else 16 + l - w for l in range(16)])
        swap = ir.Constant(ir.VectorType(_I32, 16), [l + w if (l // w) % 2 == 0 else 16 + l for l in range(16)])
        for i in range(16):
            if (i // w) % 2:
                continue
            a, b = rows[i], rows[i + w]
            rows[i] = builder.shuffle_vector(a, b, keep)
            rows[i + w] = builder.shuffle_vector(a, b, swap)
        w //= 2
    return rows


def make_qscores_lanes(isa: str, heads: int, chunks: int):
    """An intrinsic ``qs(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)``: the scores of
    ``heads`` query heads against 16 8-bit key rows of D = 64 x ``chunks`` bytes (row i at
    k[k_off + i * D]), groups of 64, in float32 at s[s_off + h * L + i]:

        s[h, i] = sum over groups j of f[f_off + h * 2 ng + j] * sc_ij * raw_hij + f[... + ng + j] * bi_ij

    as qk_int.make_qscores computes it (ng = chunks): head h's planes at x[x_off + h * 2D]
    (quantise_queries' layout), sc / bi = ks / kb[x0 + i * ng + j] (float32 or float16 bits)."""
    D = GROUP * chunks
    ng = chunks

    @intrinsic
    def qs(typingctx, x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L):
        if not scores_types(x, k, ks, kb, f, s, (x_off, k_off, x0, f_off, s_off, L)):
            return None
        half = ks == _U16_1D

        def codegen(context, builder, signature, args):
            xa, ka, ksa, kba, fa, sa = (context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 2, 4, 5, 7, 9))
            x_off_, k_off_, x0_, f_off_, s_off_, L_ = _int_args(context, builder, signature, args,
                                                                (1, 3, 6, 8, 10, 11))
            fma = declare_fma(builder)
            zero = ir.Constant(V16I, [0] * 16)
            shift = ir.Constant(V16I, [8] * 16)
            scales = _group_params(builder, ksa, x0_, ng, half)
            biases = _group_params(builder, kba, x0_, ng, half)
            i32p = _I32.as_pointer()

            def fval(index):
                return splat(builder, builder.load(builder.gep(fa.data, [index])), V16F)

            res = [None] * heads
            for j in range(ng):
                rows = []
                for i in range(16):
                    p = builder.gep(ka.data, [builder.add(k_off_, ir.Constant(I64, i * D + j * GROUP))])
                    rows.append(builder.load(builder.bitcast(p, V16I.as_pointer()), align=1))
                cols = [builder.bitcast(c, V64B) for c in transpose16(builder, rows)]
                for h in range(heads):
                    planes = []
                    for plane in range(2):
                        base = builder.add(x_off_, ir.Constant(I64, h * 2 * D + plane * D + j * GROUP))
                        acc = zero
                        for d in range(16):
                            at = builder.add(base, ir.Constant(I64, 4 * d))
                            p = builder.bitcast(builder.gep(xa.data, [at]), i32p)
                            qd = builder.bitcast(splat(builder, builder.load(p, align=1), V16I), V64B)
                            acc = dot_i32_wide(builder, isa, acc, cols[d], qd)
                        planes.append(acc)
                    raw = builder.sitofp(builder.add(builder.shl(planes[0], shift), planes[1]), V16F)
                    fo = builder.add(f_off_, ir.Constant(I64, h * 2 * ng + j))
                    fr = fval(fo)
                    fb = fval(builder.add(fo, ir.Constant(I64, ng)))
                    part = builder.call(fma, [builder.fmul(fr, scales[j]), raw, builder.fmul(fb, biases[j])])
                    res[h] = part if res[h] is None else builder.fadd(res[h], part)
            for h in range(heads):
                off = builder.add(s_off_, builder.mul(L_, ir.Constant(I64, h)))
                builder.store(res[h], builder.bitcast(builder.gep(sa.data, [off]), V16F.as_pointer()), align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(x, i64, k, i64, ks, kb, i64, f, i64, s, i64, i64), codegen

    return qs


_ISA = ISA if INT_SCORES else "generic"
_q2x1, _q3x1, _q4x1 = (make_qscores_lanes(_ISA, h, 1) for h in range(2, HEADS + 1))
_q2x2, _q3x2, _q4x2 = (make_qscores_lanes(_ISA, h, 2) for h in range(2, HEADS + 1))


@njit(nogil=True, cache=True, inline="always")
def heads_at(left):  # pragma: no cover - jitted
    """How many of ``left`` (>= 2) query heads the next call takes: 2 to HEADS, never leaving one
    alone (5 = 3 + 2), so that no kernel is built for a single head."""
    return 3 if left == 3 or left == 5 else min(HEADS, left)


@njit(nogil=True, cache=True, inline="always")
def lanes_layout(bits, group_size, D, G):  # pragma: no cover - jitted
    """Whether qscores_lanes and pv_int.pv_lanes serve this middle and query group (see the
    module's docstring)."""
    return bits == 8 and group_size == GROUP and (D == 64 or D == 128) and G >= 2


@njit(nogil=True, cache=True, inline="always")
def qscores_lanes(heads, D, x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L):  # pragma: no cover
    """make_qscores_lanes' product for ``heads`` (2-4, heads_at) heads and head_dim D (64 or 128)."""
    if D == 64:
        if heads == 2:
            _q2x1(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
        elif heads == 3:
            _q3x1(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
        else:
            _q4x1(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
    elif heads == 2:
        _q2x2(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
    elif heads == 3:
        _q3x2(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
    else:
        _q4x2(x, x_off, k, k_off, ks, kb, x0, f, f_off, s, s_off, L)
