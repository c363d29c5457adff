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

from .llvm import F32, I8

I64 = ir.IntType(64)
V16F = ir.VectorType(F32, 16)
V16B = ir.VectorType(I8, 16)


def is_c_array(a, dtypes, ndim) -> bool:
    """Whether a typed argument is a C-contiguous array of ``ndim`` dims and one of ``dtypes``
    (the intrinsics' argument check)."""
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype in dtypes


def declare(module: ir.Module, name: str, fnty: ir.FunctionType):
    """The function ``name`` in ``module``, declared once (llvmlite cannot name vector intrinsics)."""
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, fnty, name=name)


def splat(builder: ir.IRBuilder, value, vtype: ir.VectorType):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), [0] * vtype.count)
    return builder.shuffle_vector(one, undef, mask)


def vload(builder, base_ptr, index, vtype):
    """Load a vector of ``vtype`` starting at element ``index`` of ``base_ptr`` (unaligned)."""
    p = builder.gep(base_ptr, [index])
    return builder.load(builder.bitcast(p, vtype.as_pointer()), align=1)


def hreduce(builder: ir.IRBuilder, fn, acc):
    """fn(a, b) folded across the 16 lanes of ``acc`` (a <16 x ...>) by a shuffle tree: lane 0's
    value (a vector max or min: ``fn`` builds the lane-wise operation)."""
    w = 8
    while w:
        idx = ir.Constant(ir.VectorType(ir.IntType(32), 16), [(i + w) % 16 for i in range(16)])
        acc = fn(acc, builder.shuffle_vector(acc, acc, idx))
        w //= 2
    return builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))


def hsum(builder, v):
    """Sum of a <16 x float> by halving shuffles."""
    n = v.type.count
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half, n))))
        v = builder.fadd(lo, hi)
        n = half
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _block_loop(builder: ir.IRBuilder, n_blocks, body):
    """sum over blocks 0 .. n_blocks-1 of a <16 x float> accumulator: ``body(blk, acc)`` returns
    the accumulator after block ``blk``. Emits the loop and returns its horizontal sum."""
    entry = builder.block
    loop = builder.append_basic_block("rowdot.loop")
    done = builder.append_basic_block("rowdot.done")
    zero = ir.Constant(V16F, [0.0] * 16)
    builder.cbranch(builder.icmp_unsigned(">", n_blocks, ir.Constant(I64, 0)), loop, done)
    builder.position_at_end(loop)
    blk = builder.phi(I64)
    acc = builder.phi(V16F)
    blk.add_incoming(ir.Constant(I64, 0), entry)
    acc.add_incoming(zero, entry)
    new_acc = body(blk, acc)
    nxt = builder.add(blk, ir.Constant(I64, 1))
    blk.add_incoming(nxt, builder.block)
    acc.add_incoming(new_acc, builder.block)
    builder.cbranch(builder.icmp_unsigned("<", nxt, n_blocks), loop, done)
    builder.position_at_end(done)
    final = builder.phi(V16F)
    final.add_incoming(zero, entry)
    final.add_incoming(new_acc, loop)
    return hsum(builder, final)


def prefetch_ahead(builder: ir.IRBuilder, rows: list, base, row_bytes, param_rows: list, distance: int,
                   n_rows: int, weights_per_byte: int, group_size, n_groups) -> None:
    """Prefetch byte ``base`` + ``distance`` of each packed row in ``rows`` and, in each of
    ``param_rows`` (a row's scales or biases, n_groups entries), the entry of the weight there;
    past a row's end, the same place ``n_rows`` - 1 rows further on: in a kernel that reads
    ``n_rows`` adjacent rows per call, the next call's rows, not this call's next row (being
    read now). Hints only: no arithmetic changes (the row kernels of rows4.py and int8dot.py)."""
    fn = declare(builder.module, "llvm.prefetch.p0i8",
                 ir.FunctionType(ir.VoidType(), [I8.as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]))
    more = ir.Constant(I64, n_rows - 1)
    ahead = builder.add(base, ir.Constant(I64, distance))
    wrap = builder.icmp_unsigned(">=", ahead, row_bytes)
    gs = builder.sext(group_size, I64) if group_size.type != I64 else group_size
    g_ahead = builder.udiv(builder.mul(ahead, ir.Constant(I64, weights_per_byte)), gs)
    ahead = builder.select(wrap, builder.add(ahead, builder.mul(row_bytes, more)), ahead)
    g_ahead = builder.select(wrap, builder.add(g_ahead, builder.mul(n_groups, more)), g_ahead)
    targets = [builder.gep(r, [ahead]) for r in rows]
    targets += [builder.bitcast(builder.gep(r, [g_ahead]), I8.as_pointer()) for r in param_rows]
    i32 = ir.IntType(32)
    for t in targets:
        builder.call(fn, [t, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def declare_fma(builder: ir.IRBuilder):
    return declare(builder.module, "llvm.fma.v16f32", ir.FunctionType(V16F, [V16F, V16F, V16F]))


def scale_loader(builder: ir.IRBuilder, scales_ptr, half_scales: bool):
    """scale(i) -> the float32 scale at index i (float16 bits converted)."""
    def load(i):
        v = builder.load(builder.gep(scales_ptr, [i]))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), F32) if half_scales else v
    return load


def _row_arrays(arrays, dtypes) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in d
               for a, d in zip(arrays, dtypes))


_SCALES = (types.float32, types.uint16)


@intrinsic
def q4_row_dot(typingctx, w, xe, xo, scales, group_size):
    """sum_g scales[g] * (q_g . x_g) for one row of 4-bit weights (biases not included).

    w: uint8 [K/2] (the row's packed bytes), xe/xo: float32 [K/2] (even/odd activations),
    scales: float32 or uint16 (float16 bits) [K/group_size]; K a multiple of 64."""
    if not _row_arrays((w, xe, xo, scales), ((types.uint8,), (types.float32,), (types.float32,), _SCALES)):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, ea, oa, sa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
        gs = args[4]
        nblk = builder.udiv(builder.extract_value(wa.shape, 0), ir.Constant(I64, 32))  # 32 bytes: 64 weights
        is32 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 32))
        is64 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 64))
        fifteen, four = ir.Constant(V16B, [15] * 16), ir.Constant(V16B, [4] * 16)
        fma, scale = declare_fma(builder), scale_loader(builder, sa.data, half_scales)

        def block(blk, acc):
            base = builder.mul(blk, ir.Constant(I64, 32))
            parts = []
            for h in range(2):
                off = builder.add(base, ir.Constant(I64, 16 * h))
                b = vload(builder, wa.data, off, V16B)
                lo = builder.uitofp(builder.and_(b, fifteen), V16F)
                hi = builder.uitofp(builder.lshr(b, four), V16F)
                parts.append(builder.call(fma, [hi, vload(builder, oa.data, off, V16F),
                                                builder.fmul(lo, vload(builder, ea.data, off, V16F))]))
            # scale index: 2 blk (+1 for the second half) with group 32, blk with 64, blk >> 1 with 128
            two_blk = builder.mul(blk, ir.Constant(I64, 2))
            first = builder.select(is32, two_blk, builder.select(is64, blk, builder.lshr(blk, ir.Constant(I64, 1))))
            second = builder.select(is32, builder.add(two_blk, ir.Constant(I64, 1)), first)
            acc = builder.call(fma, [parts[0], splat(builder, scale(first), V16F), acc])
            return builder.call(fma, [parts[1], splat(builder, scale(second), V16F), acc])

        return _block_loop(builder, nblk, block)

    return types.float32(w, xe, xo, scales, group_size), codegen


@intrinsic
def q8_row_dot(typingctx, w, x, scales, group_size):
    """sum_g scales[g] * (q_g . x_g) for one row of 8-bit weights (biases not included).

    w: uint8 [K], x: float32 [K], scales: float32 or uint16 (float16 bits) [K/group_size];
    K a multiple of 32."""
    if not _row_arrays((w, x, scales), ((types.uint8,), (types.float32,), _SCALES)):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, xa, sa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3]))
        gs = args[3]
        nblk = builder.udiv(builder.extract_value(wa.shape, 0), ir.Constant(I64, 32))  # 32 weights
        # blocks of 32 weights per scale: 1 (group 32), 2 (64) or 4 (128)
        shift = builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 32)), ir.Constant(I64, 0),
                               builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 64)),
                                              ir.Constant(I64, 1), ir.Constant(I64, 2)))
        fma, scale = declare_fma(builder), scale_loader(builder, sa.data, half_scales)

        def block(blk, acc):
            base = builder.mul(blk, ir.Constant(I64, 32))
            off = builder.add(base, ir.Constant(I64, 16))
            w0 = builder.uitofp(vload(builder, wa.data, base, V16B), V16F)
            w1 = builder.uitofp(vload(builder, wa.data, off, V16B), V16F)
            part = builder.call(fma, [w1, vload(builder, xa.data, off, V16F),
                                      builder.fmul(w0, vload(builder, xa.data, base, V16F))])
            return builder.call(fma, [part, splat(builder, scale(builder.lshr(blk, shift)), V16F), acc])

        return _block_loop(builder, nblk, block)

    return types.float32(w, x, scales, group_size), codegen


def _is_1d(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1 and a.dtype == dtype


@intrinsic
def dequant16(typingctx, packed, p, out, o, scale, bias, bits):
    """out[o:o + 16] = scale * q + bias for 16 quantised values in MLX's affine layout: 8 bits,
    the bytes packed[p:p + 16]; 4 bits, the bytes packed[p:p + 8] (value 2j in the low nibble of
    byte j). A numba loop doing this with runtime group sizes stayed scalar (~1 ns a value on Zen 1,
    ~8x this); here one vector load, convert and FMA per 16 values (the caller keeps in bounds)."""
    if not (_is_1d(packed, types.uint8) and _is_1d(out, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        pa = context.make_array(signature.args[0])(context, builder, args[0])
        oa = context.make_array(signature.args[2])(context, builder, args[2])
        p_i, o_i, s, b, nbits = args[1], args[3], args[4], args[5], args[6]
        v8 = ir.VectorType(I8, 8)
        is8 = builder.icmp_signed("==", nbits, ir.Constant(nbits.type, 8))
        with builder.if_else(is8) as (eight, four):
            with eight:
                q8 = vload(builder, pa.data, p_i, V16B)
                bb8 = builder.block
            with four:
                half = vload(builder, pa.data, p_i, v8)
                lo = builder.and_(half, ir.Constant(v8, [15] * 8))
                hi = builder.lshr(half, ir.Constant(v8, [4] * 8))
                mask = ir.Constant(ir.VectorType(ir.IntType(32), 16), [i // 2 + 8 * (i % 2) for i in range(16)])
                q4 = builder.shuffle_vector(lo, hi, mask)
                bb4 = builder.block
        q = builder.phi(V16B)
        q.add_incoming(q8, bb8)
        q.add_incoming(q4, bb4)
        vals = builder.call(declare_fma(builder), [builder.uitofp(q, V16F), splat(builder, s, V16F),
                                                   splat(builder, b, V16F)])
        dst = builder.gep(oa.data, [o_i])
        builder.store(vals, builder.bitcast(dst, V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(packed, p, out, o, types.float32, types.float32, bits), codegen
