"""Four rows of a 4- or 8-bit weight at once against one activation vector, in LLVM IR.

``simd.q4_row_dot``/``q8_row_dot`` reduce one row at a time: on short rows (SmolLM2's are 576
wide: nine blocks of 64 weights) their single accumulator makes each block wait for the
previous block's FMAs, and every block reloads the activations. Here four rows share each
activation load and keep four independent accumulators, so the FMAs of different rows overlap.
The sums are the same products as the row kernels', in the same order per row (only the rows
are interleaved), so results are bit-identical to them.

Each block also prefetches each row's bytes and scales PREFETCH_BYTES ahead (past a row's end:
the same place ROWS rows on, the next call's rows, not the next row of this call, which is being
read). A call reads 8 streams (4 rows x bytes, scales) and the Xeon's hardware prefetchers keep
too few of them in flight, worst on the short rows of K = 4096; a core's misses in flight are
what bound decode (BENCHMARKS.md, "Decode on the Xeon"). No arithmetic changes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import I64, V16B, V16F, declare_fma, hsum, is_c_array, prefetch_ahead, scale_loader, splat, vload

ROWS = 4
BLOCK_BYTES = 32  # packed bytes per loop step and row: 64 4-bit or 32 8-bit weights
PREFETCH_BYTES = 1024  # how far ahead each row's bytes (and its scales) are asked for


def _four_rows(builder: ir.IRBuilder, wa, sa, r0v, block, outa, weights_per_byte: int, group_size) -> None:
    """The loop both kernels run over rows r0v .. r0v+3 of packed ``wa`` and scales ``sa``:
    ``block(row_ptr, scales_ptr, blk, base, acc)`` returns a row's accumulator after the
    BLOCK_BYTES packed bytes at ``base`` (block ``blk``); the four sums are stored to ``outa``."""
    row_bytes = builder.extract_value(wa.shape, 1)
    n_groups = builder.extract_value(sa.shape, 1)
    rows = [builder.add(r0v, ir.Constant(I64, i)) for i in range(ROWS)]
    wrows = [builder.gep(wa.data, [builder.mul(r, row_bytes)]) for r in rows]
    srows = [builder.gep(sa.data, [builder.mul(r, n_groups)]) for r in rows]
    nblk = builder.udiv(row_bytes, ir.Constant(I64, BLOCK_BYTES))
    entry = builder.block
    loop = builder.append_basic_block("rows4.loop")
    done = builder.append_basic_block("rows4.done")
    zero = ir.Constant(V16F, [0.0] * 16)
    builder.cbranch(builder.icmp_unsigned(">", nblk, ir.Constant(I64, 0)), loop, done)
    builder.position_at_end(loop)
    blk = builder.phi(I64)
    accs = [builder.phi(V16F) for _ in range(ROWS)]
    blk.add_incoming(ir.Constant(I64, 0), entry)
    for a in accs:
        a.add_incoming(zero, entry)
    base = builder.mul(blk, ir.Constant(I64, BLOCK_BYTES))
    prefetch_ahead(builder, wrows, base, row_bytes, srows, PREFETCH_BYTES, ROWS, weights_per_byte, group_size,
                   n_groups)
    new_accs = [block(wrows[i], srows[i], blk, base, accs[i]) for i in range(ROWS)]
    nxt = builder.add(blk, ir.Constant(I64, 1))
    blk.add_incoming(nxt, builder.block)
    for a, n in zip(accs, new_accs):
        a.add_incoming(n, builder.block)
    builder.cbranch(builder.icmp_unsigned("<", nxt, nblk), loop, done)
    builder.position_at_end(done)
    finals = [builder.phi(V16F) for _ in range(ROWS)]  # phis first: LLVM wants them at the top
    for i, final in enumerate(finals):
        final.add_incoming(zero, entry)
        final.add_incoming(new_accs[i], loop)
    for i, final in enumerate(finals):
        builder.store(hsum(builder, final), builder.gep(outa.data, [ir.Constant(I64, i)]))


def _args_ok(w, x, scales, out) -> bool:
    return (is_c_array(w, (types.uint8,), 2) and all(is_c_array(a, (types.float32,), 1) for a in x)
            and is_c_array(scales, (types.float32, types.uint16), 2) and is_c_array(out, (types.float32,), 1))


@intrinsic
def q4_rows4_dot(typingctx, w, r0, xe, xo, scales, group_size, out):
    """out[i] = sum_g scales[r0+i, g] * (q_g . x_g) for i < 4 (biases not included).

    w: uint8 [N, K/2] (C order), xe/xo: float32 [K/2], scales: float32 or uint16 [N, K/gs],
    out: float32 [>= 4]; rows r0 .. r0+3 must exist; K a multiple of 64."""
    if not _args_ok(w, (xe, xo), scales, out):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, ea, oa, sa, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                for i in (0, 2, 3, 4, 6))
        r0v, gs = args[1], args[5]
        is32 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 32))
        is64 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 64))
        fifteen, four = ir.Constant(V16B, [15] * 16), ir.Constant(V16B, [4] * 16)
        fma = declare_fma(builder)

        def block(row, srow, blk, base, acc):
            scale = scale_loader(builder, srow, half_scales)
            offs = [base, builder.add(base, ir.Constant(I64, 16))]
            two_blk = builder.mul(blk, ir.Constant(I64, 2))
            first = builder.select(is32, two_blk, builder.select(is64, blk, builder.lshr(blk, ir.Constant(I64, 1))))
            second = builder.select(is32, builder.add(two_blk, ir.Constant(I64, 1)), first)
            parts = []
            for off in offs:  # the activation loads are the same for every row: LLVM loads them once
                b = vload(builder, row, off, V16B)
                lo = builder.uitofp(builder.and_(b, fifteen), V16F)
                hi = builder.uitofp(builder.lshr(b, four), V16F)
                parts.append(builder.call(fma, [hi, vload(builder, oa.data, off, V16F),
                                                builder.fmul(lo, vload(builder, ea.data, off, V16F))]))
            acc = builder.call(fma, [parts[0], splat(builder, scale(first), V16F), acc])
            return builder.call(fma, [parts[1], splat(builder, scale(second), V16F), acc])

        _four_rows(builder, wa, sa, r0v, block, outa, 2, gs)
        return context.get_dummy_value()

    return types.none(w, r0, xe, xo, scales, group_size, out), codegen


@intrinsic
def q8_rows4_dot(typingctx, w, r0, x, scales, group_size, out):
    """out[i] = sum_g scales[r0+i, g] * (q_g . x_g) for i < 4 (biases not included), 8-bit rows.

    w: uint8 [N, K] (C order), x: float32 [K], scales: float32 or uint16 [N, K/gs], out: float32
    [>= 4]; rows r0 .. r0+3 must exist; K a multiple of 32."""
    if not _args_ok(w, (x,), scales, out):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, xa, sa, outa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3, 5))
        r0v, gs = args[1], args[4]
        # blocks of 32 weights per scale: 1 (group 32), 2 (64) or 4 (128)
        shift = builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 32)), ir.Constant(I64, 0),
                               builder.select(builder.icmp_signed("==", gs, ir.Constant(gs.type, 64)),
                                              ir.Constant(I64, 1), ir.Constant(I64, 2)))
        fma = declare_fma(builder)

        def block(row, srow, blk, base, acc):  # q8_row_dot's block, term for term
            scale = scale_loader(builder, srow, half_scales)
            off = builder.add(base, ir.Constant(I64, 16))
            w0 = builder.uitofp(vload(builder, row, base, V16B), V16F)
            w1 = builder.uitofp(vload(builder, row, off, V16B), V16F)
            part = builder.call(fma, [w1, vload(builder, xa.data, off, V16F),
                                      builder.fmul(w0, vload(builder, xa.data, base, V16F))])
            return builder.call(fma, [part, splat(builder, scale(builder.lshr(blk, shift)), V16F), acc])

        _four_rows(builder, wa, sa, r0v, block, outa, 1, gs)
        return context.get_dummy_value()

    return types.none(w, r0, x, scales, group_size, out), codegen
