"""Four rows of a 4-bit weight at once against one activation vector, in LLVM IR.

``simd.q4_row_dot`` reduces one row at a time: on short rows (SmolLM2's are 576 wide: nine
blocks of 64 weights) its single accumulator makes each block wait for the previous block's two
FMAs, and every block reloads the activations. Here four rows share each activation load and
keep four independent accumulators, so the FMAs of different rows overlap. The sums are the
same products as q4_row_dot's, in the same order per row (only the rows are interleaved), so
results are bit-identical to it.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .llvm import I8
from .simd import I64, V16B, V16F, declare, declare_fma, hsum, is_c_array, scale_loader, splat, vload

_I32 = ir.IntType(32)

ROWS = 4
# bytes of each row prefetched ahead, scales included (past a row's end: the row ROWS further
# on, the next call's). The 2-core Xeon's hardware prefetchers keep too few of the 8 streams
# in flight; prefetching changes no arithmetic (BENCHMARKS.md, "decode on the Xeon")
PREFETCH_BYTES = 1024


def prefetch_ahead(builder, rows: list, offset, row_len, scale_rows: list, group_size, n_scales) -> None:
    """Prefetch byte ``offset`` + PREFETCH_BYTES of each row in ``rows`` (row_len bytes long;
    past the end the same place ROWS rows on) and its scale in ``scale_rows`` (one per
    ``group_size`` weights, n_scales a row)."""
    fn = declare(builder.module, "llvm.prefetch.p0i8",
                 ir.FunctionType(ir.VoidType(), [I8.as_pointer(), _I32, _I32, _I32]))
    ahead = builder.add(offset, ir.Constant(I64, PREFETCH_BYTES))
    wrap = builder.icmp_unsigned(">=", ahead, row_len)
    ahead = builder.select(wrap, builder.add(ahead, builder.mul(row_len, ir.Constant(I64, ROWS - 1))), ahead)
    s_ahead = builder.udiv(builder.mul(builder.add(offset, ir.Constant(I64, PREFETCH_BYTES)), ir.Constant(I64, 2)),
                           builder.sext(group_size, I64) if group_size.type != I64 else group_size)
    s_ahead = builder.select(wrap, builder.add(s_ahead, builder.mul(n_scales, ir.Constant(I64, ROWS - 1))), s_ahead)
    targets = [builder.gep(r, [ahead]) for r in rows]
    targets += [builder.bitcast(builder.gep(r, [s_ahead]), I8.as_pointer()) for r in scale_rows]
    for t in targets:
        builder.call(fn, [t, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


@intrinsic
def q4_rows4_dot(typingctx, w, r0, xe, xo, scales, group_size, out):
    """out[i] = sum_g scales[r0+i, g] * (q_g . x_g) for i < 4 (biases not included).

    w: uint8 [N, K/2] (C order), xe/xo: float32 [K/2], scales: float32 or uint16 [N, K/gs],
    out: float32 [>= 4]; rows r0 .. r0+3 must exist; K a multiple of 64."""
    if not (is_c_array(w, (types.uint8,), 2) and is_c_array(xe, (types.float32,), 1)
            and is_c_array(xo, (types.float32,), 1)
            and is_c_array(scales, (types.float32, types.uint16), 2) and is_c_array(out, (types.float32,), 1)):
        return None
    half_scales = scales.dtype == types.uint16

    def codegen(context, builder, signature, args):
        wa, ea, oa, sa, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                for i in (0, 2, 3, 4, 6))
        r0v, gs = args[1], args[5]
        row_bytes = builder.extract_value(wa.shape, 1)
        n_groups = builder.extract_value(sa.shape, 1)
        nblk = builder.udiv(row_bytes, ir.Constant(I64, 32))
        is32 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 32))
        is64 = builder.icmp_signed("==", gs, ir.Constant(gs.type, 64))
        fifteen, four = ir.Constant(V16B, [15] * 16), ir.Constant(V16B, [4] * 16)
        fma = declare_fma(builder)
        wrows, scalers, srows = [], [], []
        for i in range(ROWS):
            r = builder.add(r0v, ir.Constant(I64, i))
            wrows.append(builder.gep(wa.data, [builder.mul(r, row_bytes)]))
            srows.append(builder.gep(sa.data, [builder.mul(r, n_groups)]))
            scalers.append(scale_loader(builder, srows[-1], half_scales))
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
        base = builder.mul(blk, ir.Constant(I64, 32))
        offs = [base, builder.add(base, ir.Constant(I64, 16))]
        xs = [(vload(builder, ea.data, off, V16F), vload(builder, oa.data, off, V16F)) for off in offs]
        two_blk = builder.mul(blk, ir.Constant(I64, 2))
        first = builder.select(is32, two_blk, builder.select(is64, blk, builder.lshr(blk, ir.Constant(I64, 1))))
        second = builder.select(is32, builder.add(two_blk, ir.Constant(I64, 1)), first)
        prefetch_ahead(builder, wrows, base, row_bytes, srows, gs, n_groups)
        new_accs = []
        for i in range(ROWS):
            parts = []
            for h in range(2):
                b = vload(builder, wrows[i], offs[h], V16B)
                lo = builder.uitofp(builder.and_(b, fifteen), V16F)
                hi = builder.uitofp(builder.lshr(b, four), V16F)
                parts.append(builder.call(fma, [hi, xs[h][1], builder.fmul(lo, xs[h][0])]))
            acc = builder.call(fma, [parts[0], splat(builder, scalers[i](first), V16F), accs[i]])
            new_accs.append(builder.call(fma, [parts[1], splat(builder, scalers[i](second), V16F), acc]))
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
        return context.get_dummy_value()

    return types.none(w, r0, xe, xo, scales, group_size, out), codegen

