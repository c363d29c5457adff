"""Integer dot products for ``cpu.numerics = fast``: 4-bit weights against int8 activations.

The exact rows (rows4.py) convert every nibble to float and spend an FMA per 16 weights each,
plus the conversions: on two cores they reach ~25-30 G weights/s, below what memory delivers on
a 7B layer. Here each projection input is quantised once (``quantise_lanes``) to int8 per block
of ``ACT_BLOCK`` elements (scale max|x| / 127, round to nearest), and each 64 packed bytes (128
weights) of a row cost an AND, a shift, two ``vpdpbusd`` (unsigned nibble x signed int8, four
products summed into each int32 lane: one 512-bit instruction each with AVX-512 VNNI), one
int->float conversion and two FMAs (the activation x weight scales, and the bias).

Layout: byte j of a row holds weights 2j (low nibble) and 2j+1 (high nibble), so the activation
is split into even (``xqe``) and odd (``xqo``) int8 vectors in the same byte order; int32 lane i
of a 64-byte step then sums bytes 4i..4i+3, i.e. weights 8i..8i+7 of the step. Everything the
kernel needs per lane is precomputed per lane of 8 weights (K/8 floats each): the activation
scale of the lane's block (so blocks of 8, 16 or 32 cost the kernel the same) and the sum of
the lane's activations as quantised, which times the row's bias gives the bias's share of the
same quantised activations (``_lane_sums`` says why not the float sum). The row's scales and
biases of a step are one vector load each (4, 2 or 1 of them: the group size is fixed per
compiled kernel), broadcast to the lanes by a shuffle.

The instruction is picked from the CPU this process runs on (``detect_isa``, never assumed):
AVX-512 VNNI (512-bit ``vpdpbusd``), AVX-VNNI or AVX-512 VNNI with VL (256-bit, two per step),
AVX2 ``vpmaddubsw`` + ``vpmaddwd`` (the same sums: a nibble times an int8 pair stays far from
int16 saturation, 2 x 15 x 128, so the low and high nibbles' pairs are added as int16 and widened
once: ``nibble_pairs_dot``), otherwise plain vector IR that any target lowers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .llvm import F32, I8
from .simd import I64, V16F, declare, hsum, is_c_array, prefetch_ahead, vload

ROWS = 4  # rows per kernel call: they share each activation load
# activation elements per int8 scale (8, 16 or 32: the kernel reads per-lane scales either way);
# see ``FusedDecoder`` and BENCHMARKS.md for what each costs in perplexity
ACT_BLOCK = 8
ISAS = ("vnni512", "vnni", "avx2", "generic")
# where cpu.numerics = auto picks fast: the ISAs with a vector int8 product (VNNI's vpdpbusd,
# AVX2's vpmaddubsw). On a Zen 2 without VNNI (2 cores, quiet), fast against exact: the 7B
# geometry's decode 14.3 against 9.3 tok/s and its prefill 37.9 against 33.7; SmolLM2's decode
# 100 against 77, its prefill 367 against 386 (BENCHMARKS.md, stop 30). The portable code stays exact.
AUTO_FAST_ISAS = ("vnni512", "vnni", "avx2")
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
V32B = ir.VectorType(I8, 32)
_V8I = ir.VectorType(_I32, 8)
V8F = ir.VectorType(F32, 8)


def cpu_features() -> dict:
    """The host CPU's features as LLVM names them ({'avx512vnni': True, ...})."""
    from llvmlite import binding as llvm

    try:
        return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}
    except RuntimeError:  # LLVM could not read them: assume nothing
        return {}


def detect_isa(features: dict | None = None) -> str:
    """The best integer dot instruction this CPU has: one of ISAS."""
    f = cpu_features() if features is None else features
    if f.get("avx512vnni") and f.get("avx512bw") and f.get("avx512f"):
        return "vnni512"
    if f.get("avx512vnni") and f.get("avx512vl") or f.get("avxvnni"):
        return "vnni"
    if f.get("avx2"):
        return "avx2"
    return "generic"


ISA_NAMES = {"vnni512": "AVX-512 VNNI vpdpbusd (512-bit)", "vnni": "VNNI vpdpbusd (256-bit)",
             "avx2": "AVX2 vpmaddubsw+vpmaddwd", "generic": "portable vector code"}


def _dot_i32(builder: ir.IRBuilder, isa: str, acc, u8, s8):
    """acc (<8 x i32>) + for each lane i: sum_{k<4} u8[4i+k] * s8[4i+k] (u8 unsigned, s8 signed)."""
    mod = builder.module
    if isa in ("vnni", "vnni512"):
        f = declare(mod, "llvm.x86.avx512.vpdpbusd.256", ir.FunctionType(_V8I, [_V8I, _V8I, _V8I]))
        return builder.call(f, [acc, builder.bitcast(u8, _V8I), builder.bitcast(s8, _V8I)])
    if isa == "avx2":
        v16s = ir.VectorType(_I16, 16)
        maddubs = declare(mod, "llvm.x86.avx2.pmadd.ub.sw", ir.FunctionType(v16s, [V32B, V32B]))
        maddwd = declare(mod, "llvm.x86.avx2.pmadd.wd", ir.FunctionType(_V8I, [v16s, v16s]))
        pairs = builder.call(maddubs, [u8, s8])
        return builder.add(acc, builder.call(maddwd, [pairs, ir.Constant(v16s, [1] * 16)]))
    v32i = ir.VectorType(_I32, 32)
    prod = builder.mul(builder.zext(u8, v32i), builder.sext(s8, v32i))
    for k in range(4):
        part = builder.shuffle_vector(prod, prod, ir.Constant(_V8I, [4 * i + k for i in range(8)]))
        acc = builder.add(acc, part)
    return acc


WIDE = 64  # packed bytes per step: one 512-bit register, 128 weights
V64B = ir.VectorType(I8, 64)
V16I = ir.VectorType(_I32, 16)


def dot_i32_wide(builder: ir.IRBuilder, isa: str, acc, u8, s8):
    """_dot_i32 on <64 x i8> -> <16 x i32>: one 512-bit vpdpbusd with AVX-512 VNNI, else two halves."""
    if isa == "vnni512":
        f = declare(builder.module, "llvm.x86.avx512.vpdpbusd.512", ir.FunctionType(V16I, [V16I] * 3))
        return builder.call(f, [acc, builder.bitcast(u8, V16I), builder.bitcast(s8, V16I)])
    lo_idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
    hi_idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32, 64)))
    a8 = ir.Constant(ir.VectorType(_I32, 8), list(range(8)))
    b8 = ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16)))
    parts = []
    for idx, aidx in ((lo_idx, a8), (hi_idx, b8)):
        parts.append(_dot_i32(builder, isa, builder.shuffle_vector(acc, acc, aidx),
                              builder.shuffle_vector(u8, u8, idx), builder.shuffle_vector(s8, s8, idx)))
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(V16I, list(range(16))))


def nibble_pairs_dot(builder: ir.IRBuilder, isa: str, lo, xe, hi, xo):
    """<16 x i32>: per lane i, sum_{k<4} lo[4i+k] xe[4i+k] + hi[4i+k] xo[4i+k] (nibbles unsigned,
    activations signed, <64 x i8> each): the low and the high nibbles of the same bytes land in
    the same lanes. AVX2 adds the two ``vpmaddubsw`` results as int16 (a nibble pair times int8 is
    at most 2 x 15 x 128 = 3,840, two of them 7,680) and widens once with ``vpmaddwd``: one of the
    four multiplies of each 32 bytes fewer than two _dot_i32s, the same integers. Elsewhere
    dot_i32_wide twice."""
    if isa != "avx2":
        return dot_i32_wide(builder, isa, dot_i32_wide(builder, isa, ir.Constant(V16I, [0] * 16), lo, xe), hi, xo)
    mod = builder.module
    v16s = ir.VectorType(_I16, 16)
    maddubs = declare(mod, "llvm.x86.avx2.pmadd.ub.sw", ir.FunctionType(v16s, [V32B, V32B]))
    maddwd = declare(mod, "llvm.x86.avx2.pmadd.wd", ir.FunctionType(_V8I, [v16s, v16s]))
    halves = []
    for h in range(2):
        idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        part = [builder.shuffle_vector(v, v, idx) for v in (lo, xe, hi, xo)]
        pairs = builder.add(builder.call(maddubs, part[:2]), builder.call(maddubs, part[2:]))
        halves.append(builder.call(maddwd, [pairs, ir.Constant(v16s, [1] * 16)]))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(V16I, list(range(16))))


def lane_params(builder, ptr, index, group_size: int, n_lanes: int, half: bool, per_lane: int = 8):
    """The per-lane <16 x float> vector of a row's scales (or biases) for the ``per_lane`` x
    n_lanes weights starting at group ``index``: lane l gets entry (per_lane l) // group_size
    (8 weights a lane for 4-bit rows, 4 for 8-bit ones: int8head.py)."""
    n = max(1, per_lane * n_lanes // group_size)
    elt = ir.HalfType() if half else F32
    p = builder.bitcast(builder.gep(ptr, [index]), ir.VectorType(elt, n).as_pointer())
    v = builder.load(p, align=2 if half else 4)
    if half:
        v = builder.fpext(v, ir.VectorType(F32, n))
    mask = [(per_lane * lane) // group_size if lane < n_lanes else 0 for lane in range(16)]
    return builder.shuffle_vector(v, v, ir.Constant(V16I, mask))


def wide_steps(builder: ir.IRBuilder, nstep, tail, n_acc: int, zero, step, name: str) -> list:
    """The loop every int8 kernel runs: ``nstep`` full steps of WIDE packed bytes, then a half
    step when ``tail`` is set; ``step(byte_offset, accs, n_lanes)`` emits one step over ``n_acc``
    <16 x float> accumulators and returns the new ones. Returns the final accumulators."""
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    after = builder.append_basic_block(f"{name}.after")
    builder.cbranch(builder.icmp_unsigned(">", nstep, ir.Constant(I64, 0)), loop, after)
    builder.position_at_end(loop)
    k = builder.phi(I64)
    accs = [builder.phi(V16F) for _ in range(n_acc)]
    k.add_incoming(ir.Constant(I64, 0), entry)
    for a in accs:
        a.add_incoming(zero, entry)
    new_accs = step(builder.mul(k, ir.Constant(I64, WIDE)), accs, 16)
    nxt = builder.add(k, ir.Constant(I64, 1))
    k.add_incoming(nxt, builder.block)
    for a, n in zip(accs, new_accs):
        a.add_incoming(n, builder.block)
    builder.cbranch(builder.icmp_unsigned("<", nxt, nstep), loop, after)
    builder.position_at_end(after)
    mids = [builder.phi(V16F) for _ in range(n_acc)]
    for m, n in zip(mids, new_accs):
        m.add_incoming(zero, entry)
        m.add_incoming(n, loop)
    half_blk = builder.append_basic_block(f"{name}.half")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(tail, half_blk, done)
    builder.position_at_end(half_blk)
    tail_accs = step(builder.mul(nstep, ir.Constant(I64, WIDE)), mids, 8)
    tail_end = builder.block
    builder.branch(done)
    builder.position_at_end(done)
    finals = [builder.phi(V16F) for _ in range(n_acc)]
    for f, m, t in zip(finals, mids, tail_accs):
        f.add_incoming(m, after)
        f.add_incoming(t, tail_end)
    return finals


def make_rows_i8(isa: str, group_size: int, rows: int = 4, prefetch: int = 0, prefetch_params: bool = False,
                 symmetric: bool | None = False, planes: int = 1):
    """``rows`` rows of a 4-bit weight against int8 activations, biases included:

        out[i] = sum_l s[r0+i, g(l)] * ls[l] * (q_l . xq_l) + b[r0+i, g(l)] * xs[l]

    over lanes l of 8 weights (ls: the activation scale of the lane's block, xs: the sum of the
    lane's 8 activations as quantised; quantise_lanes writes both). 64 packed bytes (128 weights)
    per step: an AND, a shift, two vpdpbusd (one 512-bit each with AVX-512 VNNI), a conversion and two FMAs
    per row; the row scales/biases of the step are one vector load each. A row of K % 128 = 64
    ends with a half step. ``prefetch`` > 0: ask for each row's bytes that many steps ahead (and
    with ``prefetch_params`` its scales and biases as far ahead, every step). ``symmetric``: the
    biases are not read (the argument may be empty, affine.py); each is -8 x its scale, formed
    from the scale vector already loaded, which is exact: the same bits as reading them. None:
    both loops, the symmetric one taken when the bias array is empty ([N, 0]).

    ``planes`` 2: 16-bit activations (quantise_lanes_wide): xqe/xqo hold K/2 high bytes, then
    K/2 low ones, each value hi + lo / 256; each plane gets its own pair of dot products against
    the same nibbles, and per lane the two int32 sums are combined as (hi << 8) + lo before the
    one conversion (|hi sum| <= 8 x 15 x 127 per lane: shifted, far inside int32). The lane
    scales are then the block's scale / 256."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group size {group_size}")

    @intrinsic
    def q4_rows_dot_i8(typingctx, w, r0, xqe, xqo, lane_scales, lane_sums, scales, biases, out):
        if not (is_c_array(w, (types.uint8,), 2) and is_c_array(xqe, (types.int8,), 1)
                and is_c_array(xqo, (types.int8,), 1)
                and is_c_array(lane_scales, (types.float32,), 1) and is_c_array(lane_sums, (types.float32,), 1)
                and is_c_array(scales, (types.float32, types.uint16), 2) and scales == biases
                and is_c_array(out, (types.float32,), 1)):
            return None
        half_scales = scales.dtype == types.uint16

        def codegen(context, builder, signature, args):
            wa, ea, oa, la, xa, sa, ba, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                                for i in (0, 2, 3, 4, 5, 6, 7, 8))
            r0v = args[1]
            row_bytes = builder.extract_value(wa.shape, 1)
            n_groups = builder.extract_value(sa.shape, 1)
            nstep = builder.udiv(row_bytes, ir.Constant(I64, WIDE))
            tail = builder.icmp_unsigned("!=", builder.urem(row_bytes, ir.Constant(I64, WIDE)),
                                         ir.Constant(I64, 0))
            fifteen, four = ir.Constant(V64B, [15] * 64), ir.Constant(V64B, [4] * 64)
            fma = declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(V16F, [V16F] * 3))
            sdata = builder.bitcast(sa.data, (ir.HalfType() if half_scales else F32).as_pointer())
            bdata = builder.bitcast(ba.data, (ir.HalfType() if half_scales else F32).as_pointer())
            minus8 = ir.Constant(V16F, [-8.0] * 16)
            wrows, srows, brows = [], [], []
            for i in range(rows):
                r = builder.add(r0v, ir.Constant(I64, i))
                wrows.append(builder.gep(wa.data, [builder.mul(r, row_bytes)]))
                srows.append(builder.gep(sdata, [builder.mul(r, n_groups)]))
                brows.append(builder.gep(bdata, [builder.mul(r, n_groups)]))
            zero = ir.Constant(V16F, [0.0] * 16)

            def step(base, accs, n_lanes, sym):
                """accs after the 8 * n_lanes weights at packed byte ``base`` (n_lanes 16 or 8)."""
                nb = n_lanes * 4
                if nb == WIDE:
                    load = lambda p, o: vload(builder, p, o, V64B)  # noqa: E731
                else:  # a half step: 32 bytes, the upper half zero
                    pad = ir.Constant(ir.VectorType(_I32, 64), list(range(32)) + [32] * 32)
                    v32z = ir.Constant(V32B, [0] * 32)
                    load = lambda p, o: builder.shuffle_vector(vload(builder, p, o, V32B), v32z, pad)  # noqa: E731
                lane0 = builder.udiv(base, ir.Constant(I64, 4))
                if n_lanes == 16:
                    ls = vload(builder, la.data, lane0, V16F)
                    xs = vload(builder, xa.data, lane0, V16F)
                else:
                    idx = ir.Constant(V16I, list(range(8)) + [8] * 8)
                    z8 = ir.Constant(V8F, [0.0] * 8)
                    ls = builder.shuffle_vector(vload(builder, la.data, lane0, V8F), z8, idx)
                    xs = builder.shuffle_vector(vload(builder, xa.data, lane0, V8F), z8, idx)
                xe, xo = load(ea.data, base), load(oa.data, base)
                if planes == 2:  # the low bytes: K/2 (= the packed row bytes) further on
                    lo_base = builder.add(base, row_bytes)
                    xe_lo, xo_lo = load(ea.data, lo_base), load(oa.data, lo_base)
                gidx = builder.udiv(builder.mul(base, ir.Constant(I64, 2)), ir.Constant(I64, group_size))
                out_accs = []
                if prefetch and nb == WIDE:
                    params = srows + ([] if sym else brows)
                    prefetch_ahead(builder, wrows, base, row_bytes, params if prefetch_params else [],
                                   prefetch * WIDE, rows, 2, ir.Constant(I64, group_size), n_groups)
                for i in range(rows):
                    b = load(wrows[i], base)
                    lo_nib, hi_nib = builder.and_(b, fifteen), builder.lshr(b, four)
                    d = nibble_pairs_dot(builder, isa, lo_nib, xe, hi_nib, xo)
                    if planes == 2:
                        d_lo = nibble_pairs_dot(builder, isa, lo_nib, xe_lo, hi_nib, xo_lo)
                        d = builder.add(builder.shl(d, ir.Constant(V16I, [8] * 16)), d_lo)
                    ws = lane_params(builder, srows[i], gidx, group_size, n_lanes, half_scales)
                    wb = (builder.fmul(ws, minus8) if sym
                          else lane_params(builder, brows[i], gidx, group_size, n_lanes, half_scales))
                    acc = builder.call(fma, [builder.sitofp(d, V16F), builder.fmul(ls, ws), accs[i]])
                    out_accs.append(builder.call(fma, [wb, xs, acc]))
                return out_accs

            def rows_loop(sym: bool) -> None:
                finals = wide_steps(builder, nstep, tail, rows, zero, lambda b, a, n: step(b, a, n, sym),
                                    "rowsi8s" if sym else "rowsi8")
                for i, f in enumerate(finals):
                    builder.store(hsum(builder, f), builder.gep(outa.data, [ir.Constant(I64, i)]))

            if symmetric is None:
                no_biases = builder.icmp_unsigned("==", builder.extract_value(ba.shape, 1), ir.Constant(I64, 0))
                with builder.if_else(no_biases) as (then, otherwise):
                    with then:
                        rows_loop(True)
                    with otherwise:
                        rows_loop(False)
            else:
                rows_loop(symmetric)
            return context.get_dummy_value()

        sig = types.none(w, r0, xqe, xqo, lane_scales, lane_sums, scales, biases, out)
        return sig, codegen

    return q4_rows_dot_i8


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _block_scale(xn, b, block):  # pragma: no cover - jitted
    """(max|x| / 127, its inverse or 0) of block b of ``block`` elements."""
    m = np.float32(0.0)
    for j in range(b * block, (b + 1) * block):
        m = max(m, abs(xn[j]))
    return m / np.float32(127.0), np.float32(127.0) / m if m > 0 else np.float32(0.0)


@njit(nogil=True, cache=True, inline="always")
def _lane_sums(xqe, xqo, lane_scales, lane_sums, wide):  # pragma: no cover - jitted
    """lane_sums[l] = the sum of lane l's 8 elements as quantised (lane scale x their integer sum),
    not as given. The kernels add bias x lane sum to scale x the nibbles' integer dot, so with the
    quantised sum a product's error is sum (scale q + bias) e = sum w e over the activations'
    rounding errors e: the weights' own, centred near zero. With the float sum it was sum scale q e,
    q in 0..15 around 8: several times the variance (llama.cpp's Q8_1 keeps the quantised sum for
    the same reason). Wide (16-bit, two planes): the values are 256 v + r, the scales a 256th."""
    half = xqe.shape[0] // 2
    for lane in range(lane_sums.shape[0]):
        acc = np.int32(0)
        for i in range(4 * lane, 4 * lane + 4):
            if wide:
                acc += (np.int32(xqe[i]) + np.int32(xqo[i])) * np.int32(256) + np.int32(xqe[half + i]) \
                    + np.int32(xqo[half + i])
            else:
                acc += np.int32(xqe[i]) + np.int32(xqo[i])
        lane_sums[lane] = lane_scales[lane] * np.float32(acc)


@njit(fastmath=True, nogil=True, cache=True)
def quantise_lanes(xn, block, xqe, xqo, lane_scales, lane_sums):  # pragma: no cover - jitted
    """xn [K] (K a multiple of 64) -> int8 even/odd halves [K/2], and per lane of 8 elements
    the activation scale of its block [K/8] and the sum of its 8 elements as quantised [K/8]
    (_lane_sums). block (8, 16 or 32 elements per scale, max|x| / 127, rounded to nearest)."""
    K = xn.shape[0]
    for b in range(K // block):
        s, inv = _block_scale(xn, b, block)
        for j in range(b * block, (b + 1) * block, 2):
            xqe[j // 2] = np.int8(np.int32(np.rint(xn[j] * inv)))
            xqo[j // 2] = np.int8(np.int32(np.rint(xn[j + 1] * inv)))
        for lane in range(b * block // 8, (b + 1) * block // 8):
            lane_scales[lane] = s
    _lane_sums(xqe, xqo, lane_scales, lane_sums, False)


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def split16(v):  # pragma: no cover - jitted
    """(q, r), integral float32s in int8's range, with v ~ q + r / 256 to the nearest 1/256
    (|v| <= 127): q = rint(v) and r the rounded remainder, except that a remainder rounding to
    128 (|v - q| ~ 1/2) carries into q, as -128 (then q <= 126). The 16-bit activations of the
    decode rows (quantise_lanes_wide) and of the prefill panels (int8panel) both split so."""
    q = np.rint(v)
    r = np.rint((v - q) * np.float32(256.0))
    carry = np.float32(1.0) if r > np.float32(127.0) else np.float32(0.0)
    return q + carry, r - np.float32(256.0) * carry


@njit(fastmath=True, nogil=True, cache=True)
def quantise_lanes_wide(xn, block, xqe, xqo, lane_scales, lane_sums):  # pragma: no cover - jitted
    """quantise_lanes on 16 bits, for make_rows_i8(planes=2): xqe/xqo [K] hold the int8 values v
    of the even / odd elements in [0, K/2) and the int8 remainders r in [K/2, K), x / scale ~ v +
    r / 256 (nearest: |error| <= scale / 512, scale = max|x| / 127 per block); lane_scales the
    block's scale / 256 (split16)."""
    K = xn.shape[0]
    half = K // 2
    for b in range(K // block):
        s, inv = _block_scale(xn, b, block)
        for j in range(b * block, b * block + block):
            q, r = split16(xn[j] * inv)
            dst = xqe if j % 2 == 0 else xqo
            dst[j // 2] = np.int8(np.int32(q))
            dst[half + j // 2] = np.int8(np.int32(r))
        for lane in range(b * block // 8, (b + 1) * block // 8):
            lane_scales[lane] = s / np.float32(256.0)
    _lane_sums(xqe, xqo, lane_scales, lane_sums, True)


ISA = detect_isa()
# steps of 64 packed bytes that each row is prefetched ahead, scales and biases included: on the
# 2-core Xeon (AVX-512 VNNI) the hardware prefetchers keep too few of a call's 12 streams (4 rows
# x bytes, scales, biases) in flight; one thread, 4096x11008 and 11008x4096 from DRAM, GB/s
# 10.1 -> 13.9 and 6.1 -> 10.2 (BENCHMARKS.md, "decode on the Xeon")
PREFETCH_STEPS = 16
# symmetric=None: weights without a bias array (GGUF Q4_0, affine.py) take the loop that reads no
# biases, 10% fewer bytes a row
_ROWS_I8 = {gs: make_rows_i8(ISA, gs, prefetch=PREFETCH_STEPS, prefetch_params=True, symmetric=None)
            for gs in (32, 64, 128)}
_k32, _k64, _k128 = _ROWS_I8[32], _ROWS_I8[64], _ROWS_I8[128]


@njit(nogil=True, cache=True, inline="always")
def q4_rows4_i8(packed, r0, xq, scales, biases, group_size, out):  # pragma: no cover - jitted
    """out[i] = row r0 + i (i < 4) of the 4-bit weight times the quantised input, biases included.
    xq = (even int8 [K/2], odd int8 [K/2], lane scales [K/8], lane sums [K/8]) (quantise_lanes).
    biases empty ([N, 0]): the weights are symmetric, each bias -8 x its scale (affine.py)."""
    if group_size == 32:
        _k32(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)
    elif group_size == 64:
        _k64(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)
    else:
        _k128(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)


# the same rows on 16-bit activations (down_proj in decode, decode_step.FAST_DOWN_WIDE)
_ROWS_I16 = {gs: make_rows_i8(ISA, gs, prefetch=PREFETCH_STEPS, prefetch_params=True, symmetric=None, planes=2)
             for gs in (32, 64, 128)}
_w32, _w64, _w128 = _ROWS_I16[32], _ROWS_I16[64], _ROWS_I16[128]


@njit(nogil=True, cache=True, inline="always")
def q4_rows4_i16(packed, r0, xq, scales, biases, group_size, out):  # pragma: no cover - jitted
    """q4_rows4_i8 on 16-bit activations: xq = (even [K], odd [K], lane scales, lane sums) of
    quantise_lanes_wide."""
    if group_size == 32:
        _w32(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)
    elif group_size == 64:
        _w64(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)
    else:
        _w128(packed, r0, xq[0], xq[1], xq[2], xq[3], scales, biases, out)
