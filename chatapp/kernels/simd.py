"""The row products of the packed-weight kernels, written in LLVM IR with 16-lane vectors.

Written as plain numba loops (the first version of qmatmul), LLVM's loop vectoriser reduced each
16-byte half of a block to a scalar before applying the group's scale: two horizontal
reductions per 64 weights. Here the partial products stay in a <16 x float> accumulator,
scaled per group (an FMA with the broadcast scale), and are reduced once per row: 1.6-1.8x
faster for every group size and scale dtype (measured interleaved on the same busy machine:
4-bit 4096x4096, 11-12 -> 18-22 G weights/s). The vectors
are generic LLVM types, so the code is legal on every target: LLVM splits them into what the
CPU has (one AVX-512 register, two AVX2 ones, four NEON ones).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)
_V16B = ir.VectorType(_I8, 16)


def _declare(module: ir.Module, name: str, fnty: ir.FunctionType):
    """The function ``name`` in ``module``, declared once (llvmlite cannot name vector intrinsics)."""
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, fnty, name=name)


def _splat(builder: ir.IRBuilder, value, vtype: ir.VectorType):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), [0] * vtype.count)
    return builder.shuffle_vector(one, undef, mask)


def _vload(builder, base_ptr, index, vtype):
    """Load a vector of ``vtype`` starting at element ``index`` of ``base_ptr`` (unaligned)."""
    p = builder.gep(base_ptr, [index])
    return builder.load(builder.bitcast(p, vtype.as_pointer()), align=1)


def _hsum(builder, v):
    """Sum of a <16 x float> by halving shuffles."""
    n = v.type.count
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half, n))))
        v = builder.fadd(lo, hi)
        n = half
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


@intrinsic
def q4_row_dot(typingctx, w, xe, xo, scales, group_size):
    """sum_g scales[g] * (q_g . x_g) for one row of 4-bit weights (biases not included).

    w: uint8 [K/2] (the row's packed bytes), xe/xo: float32 [K/2] (even/odd activations),
    scales: float32 or uint16 (float16 bits) [K/group_size]; K a multiple of 64."""
    arrays = (w, xe, xo, scales)
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays):
        return None
    if w.dtype != types.uint8 or xe.dtype != types.float32 or xo.dtype != types.float32:
        return None
    if scales.dtype not in (types.float32, types.uint16):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, ea, oa, sa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
        gs = args[4]
        n_bytes = builder.extract_value(wa.shape, 0)
        nblk = builder.udiv(n_bytes, ir.Constant(_I64, 32))
        # scale index per block: 2 blk (+1) for group 32, blk for 64, blk >> 1 for 128
        is32 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 32))
        is64 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 64))
        fifteen = ir.Constant(_V16B, [15] * 16)
        four = ir.Constant(_V16B, [4] * 16)
        fma = _declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]))

        def scale_at(i):
            p = builder.gep(sa.data, [i])
            v = builder.load(p)
            if half_scales:
                v = builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)
            return v

        entry = builder.block
        loop = builder.append_basic_block("q4row.loop")
        done = builder.append_basic_block("q4row.done")
        zero_acc = ir.Constant(_V16F, [0.0] * 16)
        has = builder.icmp_unsigned(">", nblk, ir.Constant(_I64, 0))
        builder.cbranch(has, loop, done)

        builder.position_at_end(loop)
        blk = builder.phi(_I64)
        acc = builder.phi(_V16F)
        blk.add_incoming(ir.Constant(_I64, 0), entry)
        acc.add_incoming(zero_acc, entry)
        base = builder.mul(blk, ir.Constant(_I64, 32))
        parts = []
        for h in range(2):
            off = builder.add(base, ir.Constant(_I64, 16 * h))
            b = _vload(builder, wa.data, off, _V16B)
            lo = builder.uitofp(builder.and_(b, fifteen), _V16F)
            hi = builder.uitofp(builder.lshr(b, four), _V16F)
            xe_v = _vload(builder, ea.data, off, _V16F)
            xo_v = _vload(builder, oa.data, off, _V16F)
            parts.append(builder.call(fma, [hi, xo_v, builder.fmul(lo, xe_v)]))
        two_blk = builder.mul(blk, ir.Constant(_I64, 2))
        s_first = builder.select(is32, two_blk, builder.select(is64, blk, builder.lshr(blk, ir.Constant(_I64, 1))))
        s0 = scale_at(s_first)
        # group 32: the second half has its own scale; otherwise it shares the first's
        s1 = scale_at(builder.select(is32, builder.add(two_blk, ir.Constant(_I64, 1)), s_first))
        acc1 = builder.call(fma, [parts[0], _splat(builder, s0, _V16F), acc])
        acc2 = builder.call(fma, [parts[1], _splat(builder, s1, _V16F), acc1])
        nxt = builder.add(blk, ir.Constant(_I64, 1))
        blk.add_incoming(nxt, builder.block)
        acc.add_incoming(acc2, builder.block)
        builder.cbranch(builder.icmp_unsigned("<", nxt, nblk), loop, done)

        builder.position_at_end(done)
        final = builder.phi(_V16F)
        final.add_incoming(zero_acc, entry)
        final.add_incoming(acc2, loop)
        return _hsum(builder, final)

    return types.float32(w, xe, xo, scales, group_size), codegen


@intrinsic
def q8_row_dot(typingctx, w, x, scales, group_size):
    """sum_g scales[g] * (q_g . x_g) for one row of 8-bit weights (biases not included).

    w: uint8 [K], x: float32 [K], scales: float32 or uint16 (float16 bits) [K/group_size];
    K a multiple of 32."""
    arrays = (w, x, scales)
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays):
        return None
    if w.dtype != types.uint8 or x.dtype != types.float32 or scales.dtype not in (types.float32, types.uint16):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, xa, sa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3]))
        gs = args[3]
        n_bytes = builder.extract_value(wa.shape, 0)
        nblk = builder.udiv(n_bytes, ir.Constant(_I64, 32))
        # blocks of 32 elements per scale: 1 (group 32), 2 (64) or 4 (128)
        shift = builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 32)), ir.Constant(_I64, 0),
                               builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 64)),
                                              ir.Constant(_I64, 1), ir.Constant(_I64, 2)))
        fma = _declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]))
        entry = builder.block
        loop = builder.append_basic_block("q8row.loop")
        done = builder.append_basic_block("q8row.done")
        zero_acc = ir.Constant(_V16F, [0.0] * 16)
        builder.cbranch(builder.icmp_unsigned(">", nblk, ir.Constant(_I64, 0)), loop, done)

        builder.position_at_end(loop)
        blk = builder.phi(_I64)
        acc = builder.phi(_V16F)
        blk.add_incoming(ir.Constant(_I64, 0), entry)
        acc.add_incoming(zero_acc, entry)
        base = builder.mul(blk, ir.Constant(_I64, 32))
        off = builder.add(base, ir.Constant(_I64, 16))
        w0 = builder.uitofp(_vload(builder, wa.data, base, _V16B), _V16F)
        w1 = builder.uitofp(_vload(builder, wa.data, off, _V16B), _V16F)
        part = builder.call(fma, [w1, _vload(builder, xa.data, off, _V16F),
                                  builder.fmul(w0, _vload(builder, xa.data, base, _V16F))])
        s = builder.load(builder.gep(sa.data, [builder.lshr(blk, shift)]))
        if half_scales:
            s = builder.fpext(builder.bitcast(s, ir.HalfType()), _F32)
        acc2 = builder.call(fma, [part, _splat(builder, s, _V16F), acc])
        nxt = builder.add(blk, ir.Constant(_I64, 1))
        blk.add_incoming(nxt, builder.block)
        acc.add_incoming(acc2, builder.block)
        builder.cbranch(builder.icmp_unsigned("<", nxt, nblk), loop, done)

        builder.position_at_end(done)
        final = builder.phi(_V16F)
        final.add_incoming(zero_acc, entry)
        final.add_incoming(acc2, loop)
        return _hsum(builder, final)

    return types.float32(w, x, scales, group_size), codegen
