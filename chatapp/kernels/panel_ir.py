"""What the prefill panel tiles (int8panel.py's for VNNI and portable code, panel_avx2.py's for
AVX2) share in their generated code: the arguments, the loop over scale units, and each unit's
scaling. One copy of the scaling keeps their results the same bits: the same integer sums,
converted and scaled in the same order, whatever the vector width."""

from __future__ import annotations

from llvmlite import ir
from numba import types

from .simd import I64, declare, is_c_array, splat

_I32 = ir.IntType(32)

PANEL_ROWS = 16  # rows per panel: one int32 lane each
# tokens per kernel call: 8 int32 + 8 float accumulators, 16 of the 32 zmm (6, 8, 10 and 12 tokens
# measured within noise of each other on a busy Xeon; 8 divides the usual chunk sizes)
PANEL_TOKENS = 8


def panel_args_ok(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group, out) -> bool:
    """The argument types every panel tile takes (int8panel.make_panel_tile's contract)."""
    return (is_c_array(panel, (types.uint32,), 2) and is_c_array(pscale, (types.float32,), 2)
            and is_c_array(pbias, (types.float32,), 2) and is_c_array(xe, (types.int8,), 3)
            and is_c_array(xo, (types.int8,), 3) and is_c_array(ts, (types.float32,), 2)
            and is_c_array(tsum, (types.float32,), 2) and is_c_array(out, (types.float32,), 1)
            and all(isinstance(a, types.Integer) and a.bitwidth == 64 for a in (t0, unit, group)))


def panel_args(context, builder, signature, args) -> tuple:
    """What a panel tile's codegen reads of its arguments: the scale, bias, token-scale, token-sum
    and output arrays, t0, unit and group, the units (K / unit) and token rows Tp, and the panel and
    the two activation planes as int32 pointers (one dword: 4 weights' bytes or 4 activations)."""
    pa, sa, ba, ea, oa, ta, ua, outa = (context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 1, 2, 3, 4, 5, 6, 10))
    i32p = _I32.as_pointer()
    return (sa, ba, ta, ua, outa, args[7], args[8], args[9], builder.extract_value(ta.shape, 0),
            builder.extract_value(ta.shape, 1), builder.bitcast(pa.data, i32p), builder.bitcast(ea.data, i32p),
            builder.bitcast(oa.data, i32p))


class UnitLoop:
    """The loop over a tile's scale units, ``n`` float accumulators of ``vtype`` carried across
    them: ``UnitLoop(...)`` leaves the builder in the body (``u`` the unit, ``faccs`` the sums so
    far), ``close(new)`` ends it and returns the final sums (zero when there are no units)."""

    def __init__(self, builder: ir.IRBuilder, n_units, n: int, vtype: ir.VectorType, name: str):
        self.builder, self.n_units, self.vtype = builder, n_units, vtype
        self.zero = ir.Constant(vtype, [0.0] * vtype.count)
        self.entry = builder.block
        self.loop = builder.append_basic_block(f"{name}.loop")
        self.done = builder.append_basic_block(f"{name}.done")
        builder.cbranch(builder.icmp_unsigned(">", n_units, ir.Constant(I64, 0)), self.loop, self.done)
        builder.position_at_end(self.loop)
        self.u = builder.phi(I64)
        self.u.add_incoming(ir.Constant(I64, 0), self.entry)
        self.faccs = [builder.phi(vtype) for _ in range(n)]
        for f in self.faccs:
            f.add_incoming(self.zero, self.entry)

    def close(self, new: list) -> list:
        b = self.builder
        latch = b.block  # the body's last block: the loop's own, or one after loops nested in it
        nxt = b.add(self.u, ir.Constant(I64, 1))
        self.u.add_incoming(nxt, latch)
        for f, n in zip(self.faccs, new):
            f.add_incoming(n, latch)
        b.cbranch(b.icmp_unsigned("<", nxt, self.n_units), self.loop, self.done)
        b.position_at_end(self.done)
        finals = [b.phi(self.vtype) for _ in new]
        for final, n in zip(finals, new):
            final.add_incoming(self.zero, self.entry)
            final.add_incoming(n, latch)
        return finals


def scaled_unit(builder: ir.IRBuilder, planes: list, ws, wb, ta, ua, p0, faccs: list) -> list:
    """Each token j's accumulator after a unit: faccs[j] + float(isum) x (row scales ws x token
    scale) + row biases wb x the token's sum as quantised, the token's scale and sum at ``p0`` + j of ts
    and tsum. ``planes``: the int32 sums per token of the one plane, or of the high and the low
    plane of 16-bit activations, combined as (hi << 8) + lo (|hi sum| <= 255 x 128 x unit with
    8-bit weights, < 2^23 for units of 128: shifted by 8 it fits in int32)."""
    ftype = faccs[0].type
    fma = declare(builder.module, f"llvm.fma.v{ftype.count}f32", ir.FunctionType(ftype, [ftype] * 3))
    if len(planes) == 1:
        isums = planes[0]
    else:
        eight = ir.Constant(planes[0][0].type, [8] * ftype.count)
        isums = [builder.add(builder.shl(h, eight), lo) for h, lo in zip(planes[0], planes[1])]
    new = []
    for j, (isum, facc) in enumerate(zip(isums, faccs)):
        p = builder.add(p0, ir.Constant(I64, j))
        tsv = splat(builder, builder.load(builder.gep(ta.data, [p])), ftype)
        smv = splat(builder, builder.load(builder.gep(ua.data, [p])), ftype)
        acc = builder.call(fma, [builder.sitofp(isum, ftype), builder.fmul(ws, tsv), facc])
        new.append(builder.call(fma, [wb, smv, acc]))
    return new
