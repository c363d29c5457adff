"""The output head on int8 activations (``cpu.numerics = fast``): 8-bit rows, and 4-bit ones.

A decoded token ends with one product of the final hidden state and the vocabulary's rows:
SmolLM2's 49,152 x 576 Q8_0 head is 32 MB, a third of what its token reads. On float32
activations (qmatmul.matmul: each byte converted to float and an FMA per weight) two Zen 3
cores ran it at ~12 GB/s, a third of what they read from memory, in 2.5 ms of a ~7 ms token.
Here the input is quantised once to int8 per block of ``HEAD_ACT_BLOCK`` elements (llama.cpp's
Q8_0 x Q8_0 product on the same file does the same, per 32), and 64 bytes of a row cost one
integer dot instruction pair, a conversion and one or two FMAs: 2.5 -> 1.2-1.3 ms there.

8-bit rows (``make_q8_rows_i8``): MLX stores w = scale x q + bias with q unsigned (0..255).
- VNNI: ``vpdpbusd`` takes the unsigned bytes as they are against the signed activations (no
  saturation: four products summed into int32); the bias adds bias x the lane's sum of the
  activations as quantised, as int8dot's 4-bit rows do (``_lane_sums`` says why quantised).
- AVX2's ``vpmaddubsw`` sums pairs into int16 with saturation, and 2 x 255 x 127 does not fit.
  So the bytes are made signed (q - 128, an XOR of the top bit) and multiplied as llama.cpp
  does: |w| x (x with w's sign) (``vpsignb`` twice), whose pairs reach 2 x 128 x 127 < 2^15.
  Then w = scale x (q - 128) + (bias + 128 scale): the bias term is (bias + 128 scale) x the
  lane sum, and nothing at all for a symmetric weight (GGUF's Q8_0: bias = -128 scale, whose
  bias array affine.py drops, [N, 0]).
- Elsewhere: the same signed products in plain vector IR (sign-extended multiplies).

A lane is one int32 of the dot: 4 consecutive weights (the bytes are in natural order, no
even/odd split). Per lane the quantiser writes the activation scale of its block and the lane's
sum as quantised (``quantise_rows8``).

4-bit heads (an mlx-community 4-bit model's lm_head) take int8dot's rows as the layers do.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .int8dot import (
    ACT_BLOCK,
    ISA,
    ISAS,
    PREFETCH_STEPS,
    V16I,
    V32B,
    V64B,
    WIDE,
    _block_scale,
    _dot_i32,
    dot_i32_wide,
    lane_params,
    q4_rows4_i8,
    quantise_lanes,
    wide_steps,
)
from .llvm import F32
from .pool import chunk_done, chunks, claim, pool
from .simd import I64, V16F, declare, hsum, is_c_array, prefetch_ahead, vload

ROWS = 4  # rows per kernel call: they share each activation load
# activation elements per int8 scale: the decode's ACT_BLOCK, at no cost (the rows read a scale
# per lane of 4 either way). On SmolLM2, 3,072 tokens of the KJV text after a 1,024-token
# prefill, perplexity against exact: +0.21% so, +0.32% per 32 (llama.cpp's Q8_0 activations),
# +0.15% with the float head; without the prefill +0.01% (BENCHMARKS.md, stop 32)
HEAD_ACT_BLOCK = ACT_BLOCK
GROUP_SIZES = (32, 64, 128)
WEIGHTS_PER_LANE = 4  # 8-bit: the 4 bytes an int32 lane of the dot sums


def signed_products(isa: str) -> bool:
    """Whether the 8-bit rows multiply q - 128 (AVX2, portable) rather than q (VNNI)."""
    return isa not in ("vnni", "vnni512")


def _signed_dot(builder: ir.IRBuilder, isa: str, acc, w, x):
    """acc (<16 x i32>) + per lane i: sum_{k<4} w[4i+k] * x[4i+k], both signed <64 x i8>."""
    if isa == "avx2":
        psign = declare(builder.module, "llvm.x86.avx2.psign.b", ir.FunctionType(V32B, [V32B, V32B]))
        halves = []
        for h in range(2):
            idx = ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32 * h, 32 * h + 32)))
            a8 = ir.Constant(ir.VectorType(ir.IntType(32), 8), list(range(8 * h, 8 * h + 8)))
            wh, xh = builder.shuffle_vector(w, w, idx), builder.shuffle_vector(x, x, idx)
            # |w| as unsigned (|-128| = 0x80 = 128) times x carrying w's sign: the pair sums
            # of vpmaddubsw stay within 2 x 128 x 127, inside int16
            halves.append(_dot_i32(builder, isa, builder.shuffle_vector(acc, acc, a8),
                                   builder.call(psign, [wh, wh]), builder.call(psign, [xh, wh])))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(V16I, list(range(16))))
    v64i = ir.VectorType(ir.IntType(32), 64)
    prod = builder.mul(builder.sext(w, v64i), builder.sext(x, v64i))
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, ir.Constant(V16I, [4 * i + k for i in range(16)])))
    return acc


def make_q8_rows_i8(isa: str, group_size: int, rows: int = ROWS, prefetch: int = 0, signed: bool | None = None):
    """``rows`` rows of an 8-bit weight against int8 activations, biases included:

        out[i] = sum_l s[r0+i, g(l)] * ls[l] * (q_l . xq_l) + b'[r0+i, g(l)] * xs[l]

    over lanes l of 4 weights (ls: the activation scale of the lane's block, xs: the lane's sum
    as quantised; quantise_rows8 writes both), with q and b' as the module docstring says
    (signed_products). Biases empty ([N, 0]): the weight is symmetric (b = -128 s), so b' is 0
    (signed) or -128 s formed from the loaded scales (VNNI): the same value as reading it.
    Rows are K bytes, K a multiple of 32: 64 bytes a step, a last half step when K % 64 = 32.
    ``prefetch`` > 0: ask for each row's bytes and scales that many steps ahead. ``signed``: which
    of the two forms (None: the ISA's, signed_products); the portable code runs either, so the
    tests check VNNI's form on CPUs without VNNI (AVX2 would saturate unsigned)."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size {group_size}")
    signed = signed_products(isa) if signed is None else signed
    if isa == "avx2" and not signed:
        raise ValueError("avx2: vpmaddubsw saturates unsigned 8-bit weights; the signed form only")

    @intrinsic
    def q8_rows_dot_i8(typingctx, w, r0, xq, lane_scales, lane_sums, scales, biases, out):
        if not (is_c_array(w, (types.uint8,), 2) and is_c_array(xq, (types.int8,), 1)
                and is_c_array(lane_scales, (types.float32,), 1) and is_c_array(lane_sums, (types.float32,), 1)
                and is_c_array(scales, (types.float32, types.uint16), 2) and scales == biases
                and is_c_array(out, (types.float32,), 1)):
            return None
        half_scales = scales.dtype == types.uint16

        def codegen(context, builder, signature, args):
            wa, xa, la, xs_arr, sa, ba, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                                for i in (0, 2, 3, 4, 5, 6, 7))
            r0v = args[1]
            row_bytes = builder.extract_value(wa.shape, 1)
            n_groups = builder.extract_value(sa.shape, 1)
            nstep = builder.udiv(row_bytes, ir.Constant(I64, WIDE))
            tail = builder.icmp_unsigned("!=", builder.urem(row_bytes, ir.Constant(I64, WIDE)),
                                         ir.Constant(I64, 0))
            fma = declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(V16F, [V16F] * 3))
            elt = ir.HalfType() if half_scales else F32
            sdata, bdata = builder.bitcast(sa.data, elt.as_pointer()), builder.bitcast(ba.data, elt.as_pointer())
            top = ir.Constant(V64B, [-128] * 64)
            offset = ir.Constant(V16F, [128.0 if signed else -128.0] * 16)
            wrows, srows, brows = [], [], []
            for i in range(rows):
                r = builder.add(r0v, ir.Constant(I64, i))
                wrows.append(builder.gep(wa.data, [builder.mul(r, row_bytes)]))
                srows.append(builder.gep(sdata, [builder.mul(r, n_groups)]))
                brows.append(builder.gep(bdata, [builder.mul(r, n_groups)]))
            zero = ir.Constant(V16F, [0.0] * 16)
            izero = ir.Constant(V16I, [0] * 16)

            def step(base, accs, n_lanes, sym):
                """accs after the 4 * n_lanes weights at byte ``base`` (n_lanes 16 or 8)."""
                if n_lanes == 16:
                    load = lambda p, o: vload(builder, p, o, V64B)  # noqa: E731
                else:  # a half step: 32 bytes, the upper half zero
                    pad = ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(32)) + [32] * 32)
                    z32 = ir.Constant(V32B, [0] * 32)
                    load = lambda p, o: builder.shuffle_vector(vload(builder, p, o, V32B), z32, pad)  # noqa: E731
                lane0 = builder.udiv(base, ir.Constant(I64, WEIGHTS_PER_LANE))
                if n_lanes == 16:
                    ls, xs = vload(builder, la.data, lane0, V16F), vload(builder, xs_arr.data, lane0, V16F)
                else:
                    idx = ir.Constant(V16I, list(range(8)) + [8] * 8)
                    z8 = ir.Constant(ir.VectorType(F32, 8), [0.0] * 8)
                    ls = builder.shuffle_vector(vload(builder, la.data, lane0, ir.VectorType(F32, 8)), z8, idx)
                    xs = builder.shuffle_vector(vload(builder, xs_arr.data, lane0, ir.VectorType(F32, 8)), z8, idx)
                x = load(xa.data, base)
                gidx = builder.udiv(base, ir.Constant(I64, group_size))
                if prefetch and n_lanes == 16:
                    prefetch_ahead(builder, wrows, base, row_bytes, srows + ([] if sym else brows),
                                   prefetch * WIDE, rows, 1, ir.Constant(I64, group_size), n_groups)
                out_accs = []
                for i in range(rows):
                    q = load(wrows[i], base)
                    if signed:
                        d = _signed_dot(builder, isa, izero, builder.xor(q, top), x)
                    else:
                        d = dot_i32_wide(builder, isa, izero, q, x)
                    ws = lane_params(builder, srows[i], gidx, group_size, n_lanes, half_scales, WEIGHTS_PER_LANE)
                    acc = builder.call(fma, [builder.sitofp(d, V16F), builder.fmul(ls, ws), accs[i]])
                    if not (sym and signed):
                        if sym:  # VNNI: b = -128 s
                            wb = builder.fmul(ws, offset)
                        else:
                            wb = lane_params(builder, brows[i], gidx, group_size, n_lanes, half_scales,
                                             WEIGHTS_PER_LANE)
                            if signed:  # b' = b + 128 s
                                wb = builder.call(fma, [ws, offset, wb])
                        acc = builder.call(fma, [wb, xs, acc])
                    out_accs.append(acc)
                return out_accs

            def rows_loop(sym: bool) -> None:
                finals = wide_steps(builder, nstep, tail, rows, zero, lambda b, a, n: step(b, a, n, sym),
                                    "q8rowsi8s" if sym else "q8rowsi8")
                for i, f in enumerate(finals):
                    builder.store(hsum(builder, f), builder.gep(outa.data, [ir.Constant(I64, i)]))

            no_biases = builder.icmp_unsigned("==", builder.extract_value(ba.shape, 1), ir.Constant(I64, 0))
            with builder.if_else(no_biases) as (then, otherwise):
                with then:
                    rows_loop(True)
                with otherwise:
                    rows_loop(False)
            return context.get_dummy_value()

        sig = types.none(w, r0, xq, lane_scales, lane_sums, scales, biases, out)
        return sig, codegen

    return q8_rows_dot_i8


@njit(fastmath=True, nogil=True, cache=True)
def quantise_rows8(xn, block, xq, lane_scales, lane_sums):  # pragma: no cover - jitted
    """xn [K] -> int8 xq [K] in natural order (``block`` elements per scale, max|x| / 127, rounded
    to nearest), and per lane of 4 elements its block's scale and its sum as quantised [K/4]."""
    K = xn.shape[0]
    for b in range(K // block):
        s, inv = _block_scale(xn, b, block)
        for j in range(b * block, (b + 1) * block):
            xq[j] = np.int8(np.int32(np.rint(xn[j] * inv)))
        for lane in range(b * block // WEIGHTS_PER_LANE, (b + 1) * block // WEIGHTS_PER_LANE):
            lane_scales[lane] = s
    for lane in range(K // WEIGHTS_PER_LANE):
        acc = np.int32(0)
        for i in range(WEIGHTS_PER_LANE * lane, WEIGHTS_PER_LANE * lane + WEIGHTS_PER_LANE):
            acc += np.int32(xq[i])
        lane_sums[lane] = lane_scales[lane] * np.float32(acc)


_Q8_ROWS = {gs: make_q8_rows_i8(ISA, gs, prefetch=PREFETCH_STEPS) for gs in GROUP_SIZES}
_k32, _k64, _k128 = _Q8_ROWS[32], _Q8_ROWS[64], _Q8_ROWS[128]


@njit(nogil=True, cache=True, inline="always")
def q8_rows4_i8(packed, r, xq8, scales, biases, group_size, tmp):  # pragma: no cover - jitted
    """tmp = rows r .. r + 3 of an 8-bit weight times the input quantised by quantise_rows8, xq8 =
    (int8 [K], lane scales [K/4], lane sums [K/4]), biases included: the decode step's 8-bit
    layers (a Q8_0 or Q6_K matrix, or a widened 5-bit one) on numerics fast."""
    if group_size == 32:
        _k32(packed, r, xq8[0], xq8[1], xq8[2], scales, biases, tmp)
    elif group_size == 64:
        _k64(packed, r, xq8[0], xq8[1], xq8[2], scales, biases, tmp)
    else:
        _k128(packed, r, xq8[0], xq8[1], xq8[2], scales, biases, tmp)


@njit(nogil=True, cache=True, inline="always")
def _rows4(packed, bits, r, xq, scales, biases, group_size, tmp):  # pragma: no cover - jitted
    """tmp = rows r .. r + 3 of the weight times the quantised input (xq: quantise_rows8's three
    arrays in slots 0, 2 and 3 for 8 bits, quantise_lanes' four for 4 bits)."""
    if bits == 4:
        q4_rows4_i8(packed, r, xq, scales, biases, group_size, tmp)
    else:
        q8_rows4_i8(packed, r, (xq[0], xq[2], xq[3]), scales, biases, group_size, tmp)


@njit(fastmath=True, nogil=True, cache=True)
def _head_rows(ctl, chunk, packed, scales, biases, bits, group_size, xq, out):  # pragma: no cover - jitted
    """out[r] = row r times the quantised input, four rows a call; chunks are multiples of four
    rows, and a last chunk that is not ends with the weight's last four rows (recomputed rows get
    the same values)."""
    N = packed.shape[0]
    n_chunks = (N + chunk - 1) // chunk
    tmp = np.empty(ROWS, np.float32)
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        r = c * chunk
        end = min(N, r + chunk)
        while r + ROWS <= end:
            _rows4(packed, bits, r, xq, scales, biases, group_size, tmp)
            for i in range(ROWS):
                out[r + i] = tmp[i]
            r += ROWS
        if r < end:
            _rows4(packed, bits, N - ROWS, xq, scales, biases, group_size, tmp)
            for i in range(ROWS):
                out[N - ROWS + i] = tmp[i]
        chunk_done(ctl)


def unsupported(bits: int, group_size: int, in_features: int, out_features: int) -> str | None:
    """None when FastHead takes such a weight, else why not (one phrase)."""
    if bits not in (4, 8):
        return f"{bits}-bit head (int8 head: 4 and 8 bits)"
    if group_size not in GROUP_SIZES:
        return f"head group size {group_size} (int8 head: 32, 64, 128)"
    multiple = 64 if bits == 4 else HEAD_ACT_BLOCK
    if in_features % multiple or in_features % group_size:
        return f"head input width {in_features} is not a multiple of {max(multiple, group_size)}"
    if out_features < ROWS:
        return f"a head of {out_features} rows"
    return None


class FastHead:
    """Logits of a normed hidden state on int8 activations: ``head(xn)`` -> float32 [N]. Holds
    the quantised input's buffers (one token at a time: the decoder's step is not reentrant)."""

    def __init__(self, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
                 block: int = HEAD_ACT_BLOCK):
        K = packed.shape[1] * 8 // bits
        why = unsupported(bits, group_size, K, packed.shape[0])
        if why is not None:
            raise ValueError(why)
        if K % block:
            raise ValueError(f"activation block {block} does not divide the head's input width {K}")
        self.weight = (packed, scales, biases)
        self.bits, self.group_size, self.block = bits, group_size, block
        if bits == 4:  # int8dot's layout: even and odd halves, lanes of 8
            self.xq = (np.empty(K // 2, np.int8), np.empty(K // 2, np.int8),
                       np.empty(K // 8, np.float32), np.empty(K // 8, np.float32))
        else:  # xq[1] unused: the 8-bit rows read natural order
            self.xq = (np.empty(K, np.int8), np.empty(0, np.int8),
                       np.empty(K // WEIGHTS_PER_LANE, np.float32), np.empty(K // WEIGHTS_PER_LANE, np.float32))
        # ~64 chunks of rows (a multiple of four): an idle thread finds work, claiming costs nothing
        self.chunk = max(16, -(-packed.shape[0] // 64 // ROWS) * ROWS)

    def quantise(self, xn: np.ndarray) -> None:
        xq = self.xq
        if self.bits == 4:
            quantise_lanes(xn, self.block, *xq)
        else:
            quantise_rows8(xn, self.block, xq[0], xq[2], xq[3])

    def __call__(self, xn: np.ndarray) -> np.ndarray:
        xn = np.ascontiguousarray(xn, dtype=np.float32)
        self.quantise(xn)
        packed, scales, biases = self.weight
        out = np.empty(packed.shape[0], np.float32)
        pool().run(_head_rows, chunks(packed.shape[0], self.chunk), self.chunk, packed, scales, biases,
                   self.bits, self.group_size, self.xq, out)
        return out
