"""Integer dot products for ``cpu.numerics = fast``: 4-bit weights against int8 activations.

The exact rows (rows4.py) convert every nibble to float and spend two FMAs per 16 weights; the
fused decode step is bound by those instructions (~8 ms a token for SmolLM2's 106M weights), not
by memory. Here the activation is quantised once per projection input to int8 per 32-element
block (scale max|x| / 127, round to nearest), and each 32 packed bytes (64 weights) of a row
cost one AND, one shift and two ``vpdpbusd`` (unsigned nibble x signed int8, four products summed
into each int32 lane), then one int->float conversion and one FMA with the block scales.

Layout: byte j of a 64-weight chunk holds weights 2j (low nibble) and 2j+1 (high nibble), so the
activation is split into even (``xqe``) and odd (``xqo``) int8 vectors in the same byte order;
int32 lane i of a chunk then sums bytes 4i..4i+3, i.e. weights 8i..8i+7 of the chunk: lanes 0-3
belong to the chunk's first 32-element block, lanes 4-7 to its second. ``lane_scales`` holds the
activation scale of each lane's block (8 floats per chunk, written by ``quantise_blocks``), and
the weight scale of each lane's group is spliced in per chunk (group size 32: two groups a chunk).

The instruction is picked from the CPU this process runs on (``int8_isa``): AVX-512 VNNI or
AVX-VNNI ``vpdpbusd``; AVX2 ``vpmaddubsw`` + ``vpmaddwd`` (same sums: a nibble times an int8 pair
stays far from int16 saturation, 2 x 15 x 127); otherwise plain vector IR that any target lowers.
Biases stay exact: the caller adds bias_g x (float sum of the group's activations).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .llvm import F32, I8
from .simd import I64, declare, hsum, scale_loader, vload

ROWS = 4
BLOCK = 32  # activation elements per int8 scale
ISAS = ("vnni", "avx2", "generic")
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_V32B = ir.VectorType(I8, 32)
_V8I = ir.VectorType(_I32, 8)
_V8F = ir.VectorType(F32, 8)


def cpu_features() -> dict:
    """The host CPU's features as LLVM names them ({'avx512vnni': True, ...})."""
    from llvmlite import binding as llvm

    try:
        return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}
    except RuntimeError:  # LLVM could not read them: assume nothing
        return {}


def detect_isa(features: dict | None = None) -> str:
    """The best integer dot instruction this CPU has: 'vnni', 'avx2' or 'generic'."""
    f = cpu_features() if features is None else features
    if f.get("avx512vnni") and f.get("avx512vl") or f.get("avxvnni"):
        return "vnni"
    if f.get("avx2"):
        return "avx2"
    return "generic"


ISA_NAMES = {"vnni": "VNNI vpdpbusd", "avx2": "AVX2 vpmaddubsw+vpmaddwd", "generic": "portable vector code"}


def _dot_i32(builder: ir.IRBuilder, isa: str, acc, u8, s8):
    """acc (<8 x i32>) + for each lane i: sum_{k<4} u8[4i+k] * s8[4i+k] (u8 unsigned, s8 signed)."""
    mod = builder.module
    if isa == "vnni":
        f = declare(mod, "llvm.x86.avx512.vpdpbusd.256", ir.FunctionType(_V8I, [_V8I, _V8I, _V8I]))
        return builder.call(f, [acc, builder.bitcast(u8, _V8I), builder.bitcast(s8, _V8I)])
    if isa == "avx2":
        v16s = ir.VectorType(_I16, 16)
        maddubs = declare(mod, "llvm.x86.avx2.pmadd.ub.sw", ir.FunctionType(v16s, [_V32B, _V32B]))
        maddwd = declare(mod, "llvm.x86.avx2.pmadd.wd", ir.FunctionType(_V8I, [v16s, v16s]))
        pairs = builder.call(maddubs, [u8, s8])
        return builder.add(acc, builder.call(maddwd, [pairs, ir.Constant(v16s, [1] * 16)]))
    v32i = ir.VectorType(_I32, 32)
    prod = builder.mul(builder.zext(u8, v32i), builder.sext(s8, v32i))
    for k in range(4):
        part = builder.shuffle_vector(prod, prod, ir.Constant(_V8I, [4 * i + k for i in range(8)]))
        acc = builder.add(acc, part)
    return acc


def _is(a, dtypes, ndim) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype in dtypes


def make_rows4_i8(isa: str):
    """The four-row int8 kernel for ``isa`` (one of ISAS); tests build the ones this CPU can run."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")

    @intrinsic
    def q4_rows4_dot_i8(typingctx, w, r0, xqe, xqo, lane_scales, scales, group_size, out):
        """out[i] ~ sum_g scales[r0+i, g] * (q_g . x_g) for i < 4 with x int8-quantised.

        w: uint8 [N, K/2]; xqe/xqo: int8 [K/2]; lane_scales: float32 [K/8] (quantise_blocks);
        scales: float32 or uint16 [N, K/gs]; out: float32 [>= 4]; K a multiple of 64."""
        if not (_is(w, (types.uint8,), 2) and _is(xqe, (types.int8,), 1) and _is(xqo, (types.int8,), 1)
                and _is(lane_scales, (types.float32,), 1) and _is(scales, (types.float32, types.uint16), 2)
                and _is(out, (types.float32,), 1)):
            return None
        half_scales = scales.dtype == types.uint16

        def codegen(context, builder, signature, args):
            wa, ea, oa, la, sa, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 2, 3, 4, 5, 7))
            r0v, gs = args[1], args[6]
            row_bytes = builder.extract_value(wa.shape, 1)
            n_groups = builder.extract_value(sa.shape, 1)
            nblk = builder.udiv(row_bytes, ir.Constant(I64, 32))
            is32 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 32))
            is64 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 64))
            fifteen, four = ir.Constant(_V32B, [15] * 32), ir.Constant(_V32B, [4] * 32)
            fma = declare(builder.module, "llvm.fma.v8f32", ir.FunctionType(_V8F, [_V8F] * 3))
            wrows, scalers = [], []
            for i in range(ROWS):
                r = builder.add(r0v, ir.Constant(I64, i))
                wrows.append(builder.gep(wa.data, [builder.mul(r, row_bytes)]))
                scalers.append(scale_loader(builder, builder.gep(sa.data, [builder.mul(r, n_groups)]), half_scales))
            entry = builder.block
            loop = builder.append_basic_block("rows4i8.loop")
            done = builder.append_basic_block("rows4i8.done")
            zero = ir.Constant(_V8F, [0.0] * 8)
            izero = ir.Constant(_V8I, [0] * 8)
            builder.cbranch(builder.icmp_unsigned(">", nblk, ir.Constant(I64, 0)), loop, done)
            builder.position_at_end(loop)
            blk = builder.phi(I64)
            accs = [builder.phi(_V8F) for _ in range(ROWS)]
            blk.add_incoming(ir.Constant(I64, 0), entry)
            for a in accs:
                a.add_incoming(zero, entry)
            base = builder.mul(blk, ir.Constant(I64, 32))
            xe = vload(builder, ea.data, base, _V32B)
            xo = vload(builder, oa.data, base, _V32B)
            ls = vload(builder, la.data, builder.mul(blk, ir.Constant(I64, 8)), _V8F)
            two_blk = builder.mul(blk, ir.Constant(I64, 2))
            first = builder.select(is32, two_blk, builder.select(is64, blk, builder.lshr(blk, ir.Constant(I64, 1))))
            second = builder.select(is32, builder.add(two_blk, ir.Constant(I64, 1)), first)
            new_accs = []
            for i in range(ROWS):
                b = vload(builder, wrows[i], base, _V32B)
                lo = builder.and_(b, fifteen)
                hi = builder.lshr(b, four)
                d = _dot_i32(builder, isa, _dot_i32(builder, isa, izero, lo, xe), hi, xo)
                s0 = builder.insert_element(ir.Constant(_V8F, ir.Undefined), scalers[i](first), ir.Constant(_I32, 0))
                s1 = builder.insert_element(s0, scalers[i](second), ir.Constant(_I32, 1))
                ws = builder.shuffle_vector(s1, s1, ir.Constant(_V8I, [0, 0, 0, 0, 1, 1, 1, 1]))
                new_accs.append(builder.call(fma, [builder.sitofp(d, _V8F), builder.fmul(ls, ws), accs[i]]))
            nxt = builder.add(blk, ir.Constant(I64, 1))
            blk.add_incoming(nxt, builder.block)
            for a, n in zip(accs, new_accs):
                a.add_incoming(n, builder.block)
            builder.cbranch(builder.icmp_unsigned("<", nxt, nblk), loop, done)
            builder.position_at_end(done)
            finals = [builder.phi(_V8F) for _ in range(ROWS)]
            for i, final in enumerate(finals):
                final.add_incoming(zero, entry)
                final.add_incoming(new_accs[i], loop)
            for i, final in enumerate(finals):
                builder.store(hsum(builder, final), builder.gep(outa.data, [ir.Constant(I64, i)]))
            return context.get_dummy_value()

        return types.none(w, r0, xqe, xqo, lane_scales, scales, group_size, out), codegen

    return q4_rows4_dot_i8


ISA = detect_isa()
q4_rows4_dot_i8 = make_rows4_i8(ISA)


@njit(fastmath=True, nogil=True, cache=True)
def quantise_blocks(xn, xqe, xqo, lane_scales):  # pragma: no cover - jitted
    """xn [K] (K a multiple of 64) -> int8 even/odd halves [K/2] and the lane scales [K/8]:
    per 32-element block, scale max|x| / 127 and x / scale rounded to nearest."""
    K = xn.shape[0]
    for b in range(K // BLOCK):
        m = np.float32(0.0)
        for j in range(b * BLOCK, (b + 1) * BLOCK):
            m = max(m, abs(xn[j]))
        s = m / np.float32(127.0)
        inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
        for j in range(b * BLOCK, (b + 1) * BLOCK, 2):
            xqe[j // 2] = np.int8(np.int32(np.rint(xn[j] * inv)))
            xqo[j // 2] = np.int8(np.int32(np.rint(xn[j + 1] * inv)))
        for k in range(4):  # a 64-element chunk's lanes 0-3 hold its first block, 4-7 its second
            lane_scales[(b // 2) * 8 + (b % 2) * 4 + k] = s
