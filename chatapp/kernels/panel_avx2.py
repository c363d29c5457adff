"""The prefill panel tile (int8panel.py) for CPUs whose int8 product is AVX2's ``vpmaddubsw``.

With VNNI one ``vpdpbusd`` takes 64 (or 32) nibble x int8 products into int32 lanes, and the
16-row x 8-token tile keeps 8 int32 and 8 float accumulators in 16 of the 32 zmm registers.
AVX2 has no such instruction and 16 ymm registers. The generic lowering of the same tile
(``vpmaddubsw`` to int16 pairs, ``vpmaddwd`` by ones to int32, ``vpaddd``: three instructions
per 32 products) needs 32 ymm accumulators and spills; on a Zen 2 core it ran at ~47 GMAC/s.

Here the int16 pair sums are added up in int16 across a unit's steps, and widened once per unit:
a nibble pair against int8 activations is at most 2 x 15 x 128 = 3,840 in magnitude, so up to 8
of them (4 dword steps, 32 natural elements: the default prefill activation block) stay inside
int16 (30,720 < 32,767). A longer unit widens every 4 steps into an int32 sum. Per step and
token that is one ``vpmaddubsw`` and one ``vpaddw`` per 32 products, and per unit one ``vpmaddwd``
per token.

The tile runs as passes of 8 rows (one ymm of the panel's dwords) x ``token_group`` tokens
over the whole K, so that the int16 sums, the float accumulators, the unpacked weights and a
broadcast (nearly) fit the 16 registers. The panel's weights (L1/L2-resident) are read once per
pass. The results are the same integer sums as the VNNI tile's, scaled in the same order, so
they are bit-identical to it.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .llvm import F32, I8
from .panel_ir import PANEL_TOKENS, UnitLoop, panel_args, panel_args_ok, scaled_unit
from .simd import I64, declare, splat

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
V32B = ir.VectorType(I8, 32)
V16S = ir.VectorType(_I16, 16)
V8I = ir.VectorType(_I32, 8)
V8F = ir.VectorType(F32, 8)
HALF_ROWS = 8  # rows per pass: one ymm of int32 lanes
INT16_STEPS = 4  # dword steps whose int16 pair sums cannot overflow (see above)


def token_group(planes: int) -> int:
    """Tokens per pass. Zen 2, one core, 16 x 4096 panel x 256 tokens, GMAC/s: int8 63.8 with
    4 tokens, 64.9 with 8; 16-bit 30.9 with 2, 32.3 with 4 (11008 wide: 24.0, 27.9). LLVM spills
    a little at 8 (8 int16 + 8 float sums) and the loads it adds cost less than a second pass."""
    return 8 if planes == 1 else 4


def make_avx2_panel_tile(unit: int, group_size: int, tokens: int, planes: int):
    """int8panel.make_panel_tile's contract (the same arguments and results), on AVX2, for 4-bit
    rows and one (unit, group) pair: the unit's steps unrolled, the int16 sums widened every
    INT16_STEPS (the unit and group arguments are not read)."""
    if unit % 8 or group_size % unit:
        raise ValueError(f"unit {unit} must be a multiple of 8 dividing the group {group_size}")
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    ksteps = unit // 8
    units_per_group = group_size // unit
    group = min(token_group(planes), tokens)
    if tokens % group:
        raise ValueError(f"tokens {tokens} must be a multiple of {group}")

    @intrinsic
    def q4_panel_tile_avx2(typingctx, panel, pscale, pbias, xe, xo, ts, tsum, t0, unit_arg, group_arg, out):
        if not panel_args_ok(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit_arg, group_arg, out):
            return None

        def codegen(context, builder, signature, args):
            # unit and group are this tile's own (made for one pair): their arguments are not read
            sa, ba, ta, ua, outa, t0v, _, _, n_units, tp, pan, xe32, xo32 = panel_args(context, builder, signature,
                                                                                       args)
            xs = (xe32, xo32)
            mod = builder.module
            maddubs = declare(mod, "llvm.x86.avx2.pmadd.ub.sw", ir.FunctionType(V16S, [V32B, V32B]))
            maddwd = declare(mod, "llvm.x86.avx2.pmadd.wd", ir.FunctionType(V8I, [V16S, V16S]))
            fifteen, four = ir.Constant(V32B, [15] * 32), ir.Constant(V32B, [4] * 32)
            ones = ir.Constant(V16S, [1] * 16)
            szero, izero = ir.Constant(V16S, [0] * 16), ir.Constant(V8I, [0] * 8)

            def c(v):
                return ir.Constant(I64, v)

            def load8(ptr, index, vtype):
                p = builder.gep(ptr, [index])
                return builder.load(builder.bitcast(p, vtype.as_pointer()), align=1)

            def bcast(ptr, index):
                v = builder.load(builder.gep(ptr, [index]), align=1)
                return builder.bitcast(splat(builder, v, V8I), V32B)

            def one_pass(half: int, tok: int) -> None:
                """Rows 8 half .. 8 half + 7 times tokens t0 + tok .. + group - 1, over all units."""
                units = UnitLoop(builder, n_units, group, V8F, "panel2")
                u = units.u
                wide = [[izero] * group for _ in range(planes)]  # int32 sums of a unit's earlier steps
                short = [[szero] * group for _ in range(planes)]  # int16 sums of the current 4 steps
                first_token = builder.add(t0v, c(tok))
                for s_local in range(ksteps):
                    s = builder.add(builder.mul(u, c(ksteps)), c(s_local))
                    w = builder.bitcast(load8(pan, builder.add(builder.mul(s, c(16)), c(HALF_ROWS * half)), V8I),
                                        V32B)
                    nibbles = (builder.and_(w, fifteen), builder.and_(builder.lshr(w, four), fifteen))
                    tok0 = builder.add(builder.mul(s, tp), first_token)
                    for j in range(group):
                        idx = builder.mul(builder.add(tok0, c(j)), c(planes))
                        for p in range(planes):
                            ip = builder.add(idx, c(p)) if p else idx
                            for nib, x in zip(nibbles, xs):
                                short[p][j] = builder.add(short[p][j], builder.call(maddubs, [nib, bcast(x, ip)]))
                    if (s_local + 1) % INT16_STEPS == 0 or s_local == ksteps - 1:
                        for p in range(planes):
                            for j in range(group):
                                pair = builder.call(maddwd, [short[p][j], ones])
                                wide[p][j] = pair if wide[p][j] is izero else builder.add(wide[p][j], pair)
                                short[p][j] = szero
                g = builder.udiv(u, c(units_per_group)) if units_per_group > 1 else u
                prow = builder.add(builder.mul(g, c(16)), c(HALF_ROWS * half))
                ws, wb = load8(sa.data, prow, V8F), load8(ba.data, prow, V8F)
                p0 = builder.add(builder.mul(u, tp), first_token)
                finals = units.close(scaled_unit(builder, wide, ws, wb, ta, ua, p0, units.faccs))
                for j, final in enumerate(finals):
                    dst = builder.gep(outa.data, [c(16 * (tok + j) + HALF_ROWS * half)])
                    builder.store(final, builder.bitcast(dst, V8F.as_pointer()), align=4)

            for tok in range(0, tokens, group):
                for half in range(2):
                    one_pass(half, tok)
            return context.get_dummy_value()

        return types.none(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit_arg, group_arg, out), codegen

    return q4_panel_tile_avx2


# the (unit, group) pairs a prefill can meet, one tile each (the unit is unrolled: see the module
# docstring): units of 8 .. 128 within groups of 32, 64, 128
_TILES = {(u, g): make_avx2_panel_tile(u, g, PANEL_TOKENS, 1) for g in (32, 64, 128) for u in (8, 16, 32, 64, 128)
          if u <= g}
_p8_32, _p16_32, _p32_32 = _TILES[8, 32], _TILES[16, 32], _TILES[32, 32]
_p8_64, _p16_64, _p32_64, _p64_64 = _TILES[8, 64], _TILES[16, 64], _TILES[32, 64], _TILES[64, 64]
_p8_128, _p16_128, _p32_128, _p64_128, _p128_128 = (_TILES[8, 128], _TILES[16, 128], _TILES[32, 128],
                                                    _TILES[64, 128], _TILES[128, 128])


@njit(nogil=True, cache=True, inline="always")
def _tile_g32(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 32:
        _p32_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _p16_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _p8_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _tile_g64(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 64:
        _p64_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 32:
        _p32_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _p16_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _p8_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _tile_g128(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 128:
        _p128_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 64:
        _p64_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 32:
        _p32_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _p16_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _p8_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _avx2_tile1(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    if group_size == 32:
        _tile_g32(unit, group_size, pan, xq, t0, out)
    elif group_size == 64:
        _tile_g64(unit, group_size, pan, xq, t0, out)
    else:
        _tile_g128(unit, group_size, pan, xq, t0, out)


# the same with 16-bit activations on two int8 planes
_TILES2 = {(u, g): make_avx2_panel_tile(u, g, PANEL_TOKENS, 2) for g in (32, 64, 128) for u in (8, 16, 32, 64, 128)
           if u <= g}
_w8_32, _w16_32, _w32_32 = _TILES2[8, 32], _TILES2[16, 32], _TILES2[32, 32]
_w8_64, _w16_64, _w32_64, _w64_64 = _TILES2[8, 64], _TILES2[16, 64], _TILES2[32, 64], _TILES2[64, 64]
_w8_128, _w16_128, _w32_128, _w64_128, _w128_128 = (_TILES2[8, 128], _TILES2[16, 128], _TILES2[32, 128],
                                                    _TILES2[64, 128], _TILES2[128, 128])


@njit(nogil=True, cache=True, inline="always")
def _tile2_g32(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 32:
        _w32_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _w16_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _w8_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _tile2_g64(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 64:
        _w64_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 32:
        _w32_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _w16_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _w8_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _tile2_g128(unit, group_size, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 128:
        _w128_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 64:
        _w64_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 32:
        _w32_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    elif unit == 16:
        _w16_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)
    else:
        _w8_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, group_size, out)


@njit(nogil=True, cache=True, inline="always")
def _avx2_tile2(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    if group_size == 32:
        _tile2_g32(unit, group_size, pan, xq, t0, out)
    elif group_size == 64:
        _tile2_g64(unit, group_size, pan, xq, t0, out)
    else:
        _tile2_g128(unit, group_size, pan, xq, t0, out)


@njit(nogil=True, cache=True, inline="always")
def avx2_panel_tile(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    """int8panel.panel_tile on AVX2 (4-bit rows only): the tile made for this unit and group."""
    if xq[0].shape[2] == 8:
        _avx2_tile2(pan, xq, t0, group_size, unit, out)
    else:
        _avx2_tile1(pan, xq, t0, group_size, unit, out)
