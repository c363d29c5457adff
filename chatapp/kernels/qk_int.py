"""Scores against a quantised middle's keys on integers: 16-bit queries, ``vpdpbusd``.

A window-quant, quantized or scored-quant cache holds most of a long conversation's keys as
MLX's affine 8- or 4-bit rows (quant_split.py). On floats each key element costs a conversion
(zero-extend and int->float) and an FMA per query head: on Zen 4, SmolLM2's 3 heads of 64 took
~9 ns a row, half of a quantised row's attention. Here each query head is split once per group
into two int8 planes, ``q ~ sq / 256 x (256 hi + lo)`` (hi = round(q / sq) with sq = max|q| / 127,
lo the rounded remainder x 256: ~1/65,000 of the group's largest element, far below the keys'
own 8-bit rounding), and a key row's group costs two ``vpdpbusd`` per 64 bytes (its unsigned
bytes against each plane, four products summed into each int32 lane), a shift and an add. Sixteen
rows' lane vectors are then summed by one transpose-and-add tree (microkernels._transpose_add)
and converted once: the raw integer dot products of 16 keys, in order. The caller applies each
row's scale and bias (quant_split._combine): score = scale_r x sq / 256 x raw + bias_r x sum(q).

4-bit rows (element 2j in the low nibble of byte j): each plane is held as its even elements
then its odd ones, so that the low nibbles meet the even elements and the high nibbles the odd
ones in the same lanes (int8dot.nibble_pairs_dot).

Only where the CPU has ``vpdpbusd`` (AVX-512 VNNI or AVX-VNNI): AVX2's ``vpmaddubsw`` would
saturate a byte up to 255 times an int8 pair. Elsewhere the middle keeps its float scores; the
kernels compile on every CPU (the portable IR, ``generic``), which is what the tests check them
with on a CPU without VNNI.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import ISA, V16I, V64B, dot_i32_wide, nibble_pairs_dot
from .llvm import F32, I8
from .microkernels import _F32_1D, _U16_1D, _int_args, _transpose_add
from .simd import I64, V16F, declare_fma, splat

INT_SCORES = ISA in ("vnni512", "vnni")  # the decode step's middle takes these scores
GROUP_SIZES = (32, 64, 128)
_I8_1D = types.Array(types.int8, 1, "C")
_U8_1D = types.Array(types.uint8, 1, "C")


def _load_padded(builder: ir.IRBuilder, base_ptr, index, nbytes: int):
    """<64 x i8> from ``nbytes`` (16, 32 or 64) bytes at base_ptr[index], zeros above them."""
    p = builder.gep(base_ptr, [index])
    if nbytes == 64:
        return builder.load(builder.bitcast(p, V64B.as_pointer()), align=1)
    vt = ir.VectorType(I8, nbytes)
    v = builder.load(builder.bitcast(p, vt.as_pointer()), align=1)
    idx = ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(nbytes)) + [nbytes] * (64 - nbytes))
    return builder.shuffle_vector(v, ir.Constant(vt, [0] * nbytes), idx)


def _group_raw(builder: ir.IRBuilder, isa: str, bits: int, nbytes: int, D: int, xa, x_off, ka, rows: list):
    """<16 x i32>: 256 x (hi . row_i) + (lo . row_i) over one group (nbytes bytes) of each of the
    16 rows (their group's first byte at ka.data[rows[i]]), the planes at xa.data[x_off]."""
    zero = ir.Constant(V16I, [0] * 16)
    shift = ir.Constant(V16I, [8] * 16)
    chunks = []  # per 64 bytes of the group: (offset, bytes, the planes' vectors)
    for c in range(0, nbytes, 64):
        nb = min(64, nbytes - c)
        xo = builder.add(x_off, ir.Constant(I64, c))
        offs = [xo, builder.add(xo, ir.Constant(I64, D))]
        if bits == 4:  # each plane's odd elements, D / 2 after its even ones
            offs += [builder.add(o, ir.Constant(I64, D // 2)) for o in offs]
        chunks.append((c, nb, [_load_padded(builder, xa.data, o, nb) for o in offs]))
    sums = []
    for row in rows:
        acc = zero
        for c, nb, planes in chunks:
            kv = _load_padded(builder, ka.data, builder.add(row, ir.Constant(I64, c)), nb)
            if bits == 8:
                hi = dot_i32_wide(builder, isa, zero, kv, planes[0])
                lo = dot_i32_wide(builder, isa, zero, kv, planes[1])
            else:
                lo_nib = builder.and_(kv, ir.Constant(V64B, [15] * 64))
                hi_nib = builder.lshr(kv, ir.Constant(V64B, [4] * 64))
                hi = nibble_pairs_dot(builder, isa, lo_nib, planes[0], hi_nib, planes[2])
                lo = nibble_pairs_dot(builder, isa, lo_nib, planes[1], hi_nib, planes[3])
            acc = builder.add(acc, builder.add(builder.shl(hi, shift), lo))
        sums.append(acc)
    return _transpose_add(builder, sums, builder.add)


def _group_params(builder: ir.IRBuilder, arr, index, ng: int, half: bool) -> list:
    """Per group, the <16 x float> of 16 rows' scales (or biases): 16 x ng contiguous elements
    from arr.data[index] (row-major, ng a row), split by one shuffle per group."""
    et = ir.IntType(16) if half else F32
    v = builder.load(builder.bitcast(builder.gep(arr.data, [index]), ir.VectorType(et, 16 * ng).as_pointer()),
                     align=1)
    out = []
    for grp in range(ng):
        g = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                     [i * ng + grp for i in range(16)]))
        out.append(builder.fpext(builder.bitcast(g, ir.VectorType(ir.HalfType(), 16)), V16F) if half else g)
    return out


def scores_types(x, k, ks, kb, f, s, ints) -> bool:
    """Whether a scores intrinsic takes these types: int8 query planes, uint8 key rows, scales and
    biases of one type (float32 or float16 bits), float32 factors and scores, integer offsets."""
    arrays = x == _I8_1D and k == _U8_1D and s == _F32_1D and f == _F32_1D and ks == kb and ks in (_F32_1D, _U16_1D)
    return arrays and all(isinstance(t, types.Integer) for t in ints)


def make_qscores(isa: str, bits: int, group_size: int, ng: int):
    """An intrinsic ``qscores(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)``: the
    scores of one query head against 16 key rows of D = ng x group_size elements, in float32 at
    s[s_off:s_off + 16]:

        s[i] = sum over groups j of f[f_off + j] * sc_ij * raw_ij + f[f_off + ng + j] * bi_ij

    sc_ij / bi_ij = ks / kb[x0 + i * ng + j], raw_ij = 256 x (hi . row_i) + (lo . row_i) over group j,
    row i's bytes from k[k_off + i * k_stride];
    x (int8) holds the head's planes from x[x_off] (quantise_queries); ks / kb the rows' scales and
    biases (float32 or float16 bits); f the head's factors (quantise_queries: the attention scale
    x sq / 256, then the attention scale x the group's sum)."""
    if bits not in (4, 8) or group_size not in GROUP_SIZES:
        raise ValueError(f"{bits}-bit groups of {group_size}")
    nbytes = group_size * bits // 8
    D = group_size * ng

    @intrinsic
    def qscores(typingctx, x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off):
        if not scores_types(x, k, ks, kb, f, s, (x_off, k_off, k_stride, x0, f_off, s_off)):
            return None
        half = ks == _U16_1D

        def codegen(context, builder, signature, args):
            xa, ka, ksa, kba, fa, sa = (context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 2, 5, 6, 8, 10))
            x_off_, k_off_, k_stride_, x0_, f_off_, s_off_ = _int_args(context, builder, signature, args,
                                                                       (1, 3, 4, 7, 9, 11))
            fma = declare_fma(builder)
            scales = _group_params(builder, ksa, x0_, ng, half)
            biases = _group_params(builder, kba, x0_, ng, half)
            res = None
            for j in range(ng):
                rows = [builder.add(builder.add(k_off_, builder.mul(k_stride_, ir.Constant(I64, i))),
                                    ir.Constant(I64, j * nbytes)) for i in range(16)]
                raw = builder.sitofp(_group_raw(builder, isa, bits, nbytes, D, xa,
                                                builder.add(x_off_, ir.Constant(I64, j * nbytes)), ka, rows), V16F)
                fr = splat(builder, builder.load(builder.gep(fa.data, [builder.add(f_off_, ir.Constant(I64, j))])),
                           V16F)
                fb = splat(builder, builder.load(builder.gep(fa.data, [builder.add(f_off_,
                                                                                   ir.Constant(I64, ng + j))])), V16F)
                part = builder.call(fma, [builder.fmul(fr, scales[j]), raw, builder.fmul(fb, biases[j])])
                res = part if res is None else builder.fadd(res, part)
            ptr = builder.bitcast(builder.gep(sa.data, [s_off_]), V16F.as_pointer())
            builder.store(res, ptr, align=1)
            return context.get_dummy_value()

        i64 = types.int64
        return types.void(x, i64, k, i64, i64, ks, kb, i64, f, i64, s, i64), codegen

    return qscores


# the layouts on integers: D = group_size x groups of 64 or 128 (every other layout: floats)
LAYOUTS = ((32, 2), (64, 1), (32, 4), (64, 2), (128, 1))
_QS = {(bits, gs, ng): make_qscores(ISA if INT_SCORES else "generic", bits, gs, ng)
       for bits in (8, 4) for gs, ng in LAYOUTS}
_q8_32x2, _q8_64x1, _q8_32x4, _q8_64x2, _q8_128x1 = (_QS[8, gs, ng] for gs, ng in LAYOUTS)
_q4_32x2, _q4_64x1, _q4_32x4, _q4_64x2, _q4_128x1 = (_QS[4, gs, ng] for gs, ng in LAYOUTS)


@njit(nogil=True, cache=True, inline="always")
def int_layout(bits, group_size, D):  # pragma: no cover - jitted
    """Whether qscores16 serves a middle of this layout."""
    return (bits == 8 or bits == 4) and (D == 64 and group_size <= 64 or D == 128 and group_size <= 128)


@njit(nogil=True, cache=True, inline="always")
def qscores16(bits, group_size, D, x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s,
              s_off):  # pragma: no cover - jitted
    """make_qscores's product for the layout (bits, group_size, D) at run time (int_layout)."""
    if bits == 8:
        if D == 64:
            if group_size == 32:
                _q8_32x2(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
            else:
                _q8_64x1(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
        elif group_size == 32:
            _q8_32x4(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
        elif group_size == 64:
            _q8_64x2(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
        else:
            _q8_128x1(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
    elif D == 64:
        if group_size == 32:
            _q4_32x2(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
        else:
            _q4_64x1(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
    elif group_size == 32:
        _q4_32x4(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
    elif group_size == 64:
        _q4_64x2(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)
    else:
        _q4_128x1(x, x_off, k, k_off, k_stride, ks, kb, x0, f, f_off, s, s_off)


@njit(fastmath=True, nogil=True, cache=True)
def quantise_queries(qg, G, D, bits, group_size, scale, x, f):  # pragma: no cover - jitted
    """Split the G query heads qg [G * D] into make_qscores's planes: head g's hi plane at
    x[g * 2D], its lo plane at x[g * 2D + D] (4 bits: even elements, then odd); and its factors
    at f[g * 2 ng]: per group ``scale`` x sq / 256 (what the raw dots are worth), then per group
    ``scale`` x the sum of the group's elements as quantised (what each row's bias adds)."""
    ng = D // group_size
    for g in range(G):
        for grp in range(ng):
            e0 = grp * group_size
            m = np.float32(0.0)
            for e in range(e0, e0 + group_size):
                m = max(m, abs(qg[g * D + e]))
            inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
            tot = np.int64(0)
            for e in range(e0, e0 + group_size):
                v = qg[g * D + e] * inv
                hi = np.rint(v)
                lo = min(np.float32(127.0), np.rint((v - hi) * np.float32(256.0)))
                if bits == 8:
                    pos = g * 2 * D + e
                else:  # element e: even ones first, odd ones D / 2 on
                    pos = g * 2 * D + e // 2 + (D // 2) * (e % 2)
                x[pos] = np.int8(np.int32(hi))
                x[pos + D] = np.int8(np.int32(lo))
                tot += np.int64(hi) * 256 + np.int64(lo)
            u = m / np.float32(127.0 * 256.0)
            f[g * 2 * ng + grp] = scale * u
            f[g * 2 * ng + ng + grp] = scale * u * np.float32(tot)
