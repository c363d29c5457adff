"""Prefill products on integers (``cpu.numerics = fast``): a GEMM microkernel, 16 rows x 8 tokens,
on int8 or 16-bit activations.

The former tile (4 rows x 4 tokens on the row layout) paid per row, token and 128 weights two
``vpdpbusd`` plus a conversion, a multiply and two FMAs (the per-8-element activation scale and
the bias) and a horizontal sum per result: ~1.7x the float tile. Here, as llama.cpp and BLIS do,
each claim of 16 rows is repacked once (``pack_panel``, into a panel of ``K/8 x 16`` dwords that
stays in L2: no permanent copy) so that one 64-byte load holds 4 packed bytes (8 weights) of each
of the 16 rows; an AND and a shift give the even and odd weights, and every token's 4 int8
activations of those positions are broadcast to a ``vpdpbusd`` against all 16 rows. The int32
accumulators (one vector per token: 16 rows) run over a whole scale *unit* (``unit`` natural
elements: the activation block, at most the weight group), and only then is each converted and
scaled: one conversion, one multiply (row scales x token scale), one FMA, and one more FMA for the
bias (row biases x the token's sum over the unit as quantised: int8dot._lane_sums says why). With units
of 32 that is 8 ``vpdpbusd`` per 4 float operations, 16 with units of 64; no horizontal sums, and
each result vector is 16 consecutive outputs of a token.

Activations (``quantise_panel_tokens``): from prefill_step's de-interleaved rows (even elements,
then odd), int8 per ``block`` natural elements (max|x| / 127, nearest), stored step-major
``[K/8, Tp, 4]`` so a token block's broadcasts are consecutive dwords, and per unit and token the
scale and the unit's sum as quantised ``[K/unit, Tp]``. Tokens past T are zero (their results are not read).

16-bit activations (``planes`` 2, for down_proj on request, whose input silu(gate) x up has the
widest range; on int8 it had cost SmolLM2 +0.56-0.62% perplexity until the unit sums were of the
quantised activations, +0.11% since): each value is split as ``hi + lo / 256``,
both int8 (``hi`` the int8 value above, ``lo`` the rounded remainder), and each plane gets its own
``vpdpbusd`` against the same unpacked weight bytes; per unit the two int32 sums are combined as
``(hi << 8) + lo`` before the one conversion. That is the MACs of ``vpdpwssd`` (int16 pairs) without
widening the 4-bit weights to int16, and the 8-token, 16-row block stays in registers (16 int32 +
8 float accumulators). Measured on the Xeon, 512 rows x 11008 x 256 tokens on one core: 16-bit
~125 GFLOP/s, int8 ~220, the float tile ~55; int8 blocks of 8 (another way to narrow the range)
~100, with 190x the 16-bit version's error.

The token rows of the activation arrays are padded (``panel_token_rows``) so that a kernel call's
loads, one per 8-weight step, are not a power of two apart: with 256 tokens (1 KiB apart) they fell
on a few cache sets and the int8 product ran at ~0.6x.

The instruction comes from int8dot.ISA (detected, never assumed); without AVX-512 VNNI the same
IR lowers through dot_i32_wide's AVX-VNNI, AVX2 or portable forms.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .affine import bias_at
from .int8dot import ISA, ISAS, V16I, V64B, dot_i32_wide, split16
from .llvm import as_f32
from .panel_avx2 import make_avx2_panel_tile
from .panel_ir import UnitLoop, panel_args, panel_args_ok, scaled_unit
from .simd import I64, V16F, splat

PANEL_ROWS = 16  # rows per panel: one int32 lane each
# tokens per kernel call: 8 int32 + 8 float accumulators, 16 of the 32 zmm (6, 8, 10 and 12 tokens
# measured within noise of each other on a busy Xeon; 8 divides the usual chunk sizes)
PANEL_TOKENS = 8
# natural elements per int8 activation scale in the prefill (llama.cpp's Q8_0 block); decode keeps
# int8dot.ACT_BLOCK. Perplexity of each: BENCHMARKS.md
PREFILL_ACT_BLOCK = 32


@njit(nogil=True, cache=True, inline="always")
def panel_unit(block: int, group_size: int) -> int:
    """Natural elements the int32 accumulators run over before scaling: the activation block,
    at most the weight group (both powers of two, so one divides the other)."""
    return min(block, group_size)


def make_panel_tile(isa: str, unit: int, group_size: int, tokens: int = PANEL_TOKENS, planes: int = 1):
    """out[j * 16 + i] = panel row i times token t0 + j (j < tokens), biases included.

    panel: uint32 [K/8, 16] (pack_panel); pscale/pbias: float32 [K/group_size, 16]; xe/xo: int8
    [K/8, Tp, 4 * planes] (quantise_panel_tokens: even / odd elements; with 2 planes the high
    bytes, then the low ones); ts/tsum: float32 [K/unit, Tp]; out: float32 [>= tokens * 16];
    tokens t0 .. t0 + tokens - 1 must exist (< Tp). planes 2: the activations are 16-bit, as
    ``hi * 256 + lo`` (both int8), each plane one ``vpdpbusd`` against the same weight bytes, and
    per unit the two int32 sums are combined as ``(hi << 8) + lo`` before the one conversion."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")
    if unit % 8 or group_size % unit:
        raise ValueError(f"unit {unit} must be a multiple of 8 dividing the group {group_size}")
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    if isa == "avx2":  # no int8 dot instruction and 16 registers: its own tile (panel_avx2.py)
        return make_avx2_panel_tile(unit, group_size, tokens, planes)
    ksteps = unit // 8  # dword steps (8 weights each) per unit
    units_per_group = group_size // unit

    @intrinsic
    def q4_panel_tile(typingctx, panel, pscale, pbias, xe, xo, ts, tsum, t0, out):
        if not panel_args_ok(panel, pscale, pbias, xe, xo, ts, tsum, out):
            return None

        def codegen(context, builder, signature, args):
            sa, ba, ta, ua, outa, t0v, n_units, tp, pan, xe32, xo32 = panel_args(context, builder, signature, args)
            fifteen, four = ir.Constant(V64B, [15] * 64), ir.Constant(V64B, [4] * 64)
            izero = ir.Constant(V16I, [0] * 16)

            def load_vec(ptr, index, vtype, align):
                p = builder.gep(ptr, [index])
                return builder.load(builder.bitcast(p, vtype.as_pointer()), align=align)

            def bcast_i32(ptr, index):
                v = builder.load(builder.gep(ptr, [index]), align=1)
                return builder.bitcast(splat(builder, v, V16I), V64B)

            units = UnitLoop(builder, n_units, tokens, V16F, "panel")
            u = units.u
            # reset per unit: the scales apply to a unit's sum; one chain per token and plane (a
            # second chain for the odd weights measured no faster)
            iaccs = [[izero] * tokens for _ in range(planes)]
            for s_local in range(ksteps):
                s = builder.add(builder.mul(u, ir.Constant(I64, ksteps)), ir.Constant(I64, s_local))
                w = builder.bitcast(load_vec(pan, builder.mul(s, ir.Constant(I64, 16)), V16I, 1), V64B)
                lo, hi = builder.and_(w, fifteen), builder.lshr(w, four)
                tok0 = builder.add(builder.mul(s, tp), t0v)
                for j in range(tokens):
                    idx = builder.add(tok0, ir.Constant(I64, j))
                    if planes > 1:
                        idx = builder.mul(idx, ir.Constant(I64, planes))
                    for p in range(planes):
                        ip = builder.add(idx, ir.Constant(I64, p)) if p else idx
                        iaccs[p][j] = dot_i32_wide(builder, isa, iaccs[p][j], lo, bcast_i32(xe32, ip))
                        iaccs[p][j] = dot_i32_wide(builder, isa, iaccs[p][j], hi, bcast_i32(xo32, ip))
            g = builder.udiv(u, ir.Constant(I64, units_per_group)) if units_per_group > 1 else u
            ws = load_vec(sa.data, builder.mul(g, ir.Constant(I64, 16)), V16F, 1)
            wb = load_vec(ba.data, builder.mul(g, ir.Constant(I64, 16)), V16F, 1)
            p0 = builder.add(builder.mul(u, tp), t0v)
            finals = units.close(scaled_unit(builder, iaccs, ws, wb, ta, ua, p0, units.faccs))
            for j, final in enumerate(finals):
                dst = builder.gep(outa.data, [ir.Constant(I64, 16 * j)])
                builder.store(final, builder.bitcast(dst, V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.none(panel, pscale, pbias, xe, xo, ts, tsum, t0, out), codegen

    return q4_panel_tile


# the (unit, group) pairs a prefill can meet: units of 8 .. 128 within groups of 32, 64, 128
_TILES = {(u, g): make_panel_tile(ISA, u, g) for g in (32, 64, 128) for u in (8, 16, 32, 64, 128) if u <= g}
_p8_32, _p16_32, _p32_32 = _TILES[8, 32], _TILES[16, 32], _TILES[32, 32]
_p8_64, _p16_64, _p32_64, _p64_64 = _TILES[8, 64], _TILES[16, 64], _TILES[32, 64], _TILES[64, 64]
_p8_128, _p16_128, _p32_128, _p64_128, _p128_128 = (_TILES[8, 128], _TILES[16, 128], _TILES[32, 128],
                                                    _TILES[64, 128], _TILES[128, 128])


@njit(nogil=True, cache=True, inline="always")
def _tile_g32(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 32:
        _p32_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _p16_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _p8_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _tile_g64(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 64:
        _p64_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 32:
        _p32_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _p16_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _p8_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _tile_g128(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 128:
        _p128_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 64:
        _p64_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 32:
        _p32_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _p16_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _p8_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _q4_panel_tile1(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    if group_size == 32:
        _tile_g32(unit, pan, xq, t0, out)
    elif group_size == 64:
        _tile_g64(unit, pan, xq, t0, out)
    else:
        _tile_g128(unit, pan, xq, t0, out)


# the same with 16-bit activations on two int8 planes
_TILES2 = {(u, g): make_panel_tile(ISA, u, g, planes=2) for g in (32, 64, 128) for u in (8, 16, 32, 64, 128)
           if u <= g}
_w8_32, _w16_32, _w32_32 = _TILES2[8, 32], _TILES2[16, 32], _TILES2[32, 32]
_w8_64, _w16_64, _w32_64, _w64_64 = _TILES2[8, 64], _TILES2[16, 64], _TILES2[32, 64], _TILES2[64, 64]
_w8_128, _w16_128, _w32_128, _w64_128, _w128_128 = (_TILES2[8, 128], _TILES2[16, 128], _TILES2[32, 128],
                                                    _TILES2[64, 128], _TILES2[128, 128])


@njit(nogil=True, cache=True, inline="always")
def _tile2_g32(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 32:
        _w32_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _w16_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _w8_32(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _tile2_g64(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 64:
        _w64_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 32:
        _w32_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _w16_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _w8_64(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _tile2_g128(unit, pan, xq, t0, out):  # pragma: no cover - jitted
    if unit == 128:
        _w128_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 64:
        _w64_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 32:
        _w32_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    elif unit == 16:
        _w16_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)
    else:
        _w8_128(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, out)


@njit(nogil=True, cache=True, inline="always")
def _q4_panel_tile2(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    if group_size == 32:
        _tile2_g32(unit, pan, xq, t0, out)
    elif group_size == 64:
        _tile2_g64(unit, pan, xq, t0, out)
    else:
        _tile2_g128(unit, pan, xq, t0, out)


@njit(nogil=True, cache=True, inline="always")
def q4_panel_tile(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    """out[j * 16 + i] = panel row i times token t0 + j (j < PANEL_TOKENS), biases included;
    pan = (panel, pscale, pbias) of pack_panel, xq = (xe, xo, ts, tsum) of quantise_panel_tokens
    (one plane: int8 activations; two: 16-bit)."""
    if xq[0].shape[2] == 8:
        _q4_panel_tile2(pan, xq, t0, group_size, unit, out)
    else:
        _q4_panel_tile1(pan, xq, t0, group_size, unit, out)


@njit(nogil=True, cache=True)
def panel_rows(pan, xq, T, group_size, unit, out):  # pragma: no cover - jitted
    """out[t * 16 + i] = panel row i times token t for every t < T (q4_panel_tile on each block
    of PANEL_TOKENS; out holds panel_token_rows(T) x 16). Not inlined, so that its 24 unrolled
    tiles compile once, not at each of prefill_step's call sites (a cold first start spent
    ~11 s more on those copies); one call per 16-row claim costs nothing measurable, where a call
    per tile cost ~10% of the prefill."""
    for t in range(0, T, PANEL_TOKENS):
        q4_panel_tile(pan, xq, t, group_size, unit, out[t * PANEL_ROWS:])


@njit(nogil=True, cache=True)
def pack_panel(packed, scales, biases, r0, n, panel, pscale, pbias):  # pragma: no cover - jitted
    """Rows r0 .. r0 + n - 1 (n <= 16) of a 4-bit weight into the panel: panel[s, i] = packed
    bytes 4s .. 4s + 3 of row r0 + i (as one dword), pscale/pbias[g, i] its group g's scale and
    bias as float32; rows n .. 15 zero (their results are zero and not read)."""
    steps = panel.shape[0]
    rows32 = packed.view(np.uint32)
    for i in range(PANEL_ROWS):
        if i < n:
            r = r0 + i
            for s in range(steps):
                panel[s, i] = rows32[r, s]
            for g in range(pscale.shape[0]):
                pscale[g, i] = as_f32(scales[r, g])
                pbias[g, i] = bias_at(scales, biases, 4, r, g)
        else:
            for s in range(steps):
                panel[s, i] = 0
            for g in range(pscale.shape[0]):
                pscale[g, i] = 0.0
                pbias[g, i] = 0.0


@njit(nogil=True, cache=True, inline="always")
def panel_token_rows(T: int) -> int:
    """The token rows Tp of quantise_panel_tokens' arrays for T tokens: a multiple of PANEL_TOKENS,
    and not of 32, so that a kernel call's loads, Tp x 4 bytes apart per plane, do not all fall
    on the same few cache sets (T = 256: Tp 264; int8 products of 11008 x 256 tokens measured
    1.6x faster than with Tp 256)."""
    tp = (T + PANEL_TOKENS - 1) // PANEL_TOKENS * PANEL_TOKENS
    return tp + PANEL_TOKENS if tp % 32 == 0 else tp


@njit(fastmath=True, nogil=True, cache=True)
def quantise_panel_tokens(xp, block, unit, xe, xo, ts, tsum):  # pragma: no cover - jitted
    """xp [T, K] de-interleaved (even elements, then odd) -> xe/xo int8 [K/8, Tp, 4 * planes]
    (element 4s + c of the even / odd half of token t at [s, t, c]) quantised per ``block``
    natural elements (max|x| / 127, nearest), and per unit of ``unit`` natural elements and token
    the block's scale ts and the unit's sum as quantised tsum [K/unit, Tp] (ts x its integer
    sum). Two planes (xe.shape[2] 8): 16-bit activations, x / scale ~ v + r / 256 with v the
    int8 value above at [s, t, c] and r the int8 remainder at [s, t, 4 + c] (nearest: |error| <=
    scale / 512), ts the scale / 256.
    Tokens T .. Tp - 1 untouched.

    Each token's values are rounded into contiguous rows first (split16 on two planes), then
    moved into the step-major layout a dword (4 elements) at a time, not element by element. On
    SmolLM2 this function was ~14% of a fast prefill on a Zen 2 (perf); one thread, 576 x 128
    tokens: 0.21 -> 0.18 ms, 11008 x 256 on two planes: 13.4 -> 11.1 ms. What is left is the
    short per-block loops (16 elements a half)."""
    T, K = xp.shape
    half = K // 2
    hb = block // 2
    hu = unit // 2
    two = xe.shape[2] == 8
    rows = np.empty((4, half), np.int8)  # even values, odd values, even remainders, odd remainders
    words = rows.view(np.int32)  # [4, K / 8]: dword s of each holds elements 4s .. 4s + 3
    e32, o32 = xe.view(np.int32), xo.view(np.int32)  # [K/8, Tp, planes]
    for t in range(T):
        for b in range(K // block):
            m = np.float32(0.0)
            for j in range(b * hb, (b + 1) * hb):
                m = max(m, abs(xp[t, j]), abs(xp[t, half + j]))
            s = m / np.float32(127.0)
            inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
            for u in range(b * block // unit, (b + 1) * block // unit):
                ts[u, t] = s / np.float32(256.0) if two else s
            for h in range(2):
                for j in range(b * hb, (b + 1) * hb):
                    v = xp[t, h * half + j] * inv
                    if two:
                        q, r = split16(v)
                        rows[2 + h, j] = np.int8(np.int32(r))
                    else:
                        q = np.rint(v)
                    rows[h, j] = np.int8(np.int32(q))
        for w in range(half // 4):
            e32[w, t, 0] = words[0, w]
            o32[w, t, 0] = words[1, w]
            if two:
                e32[w, t, 1] = words[2, w]
                o32[w, t, 1] = words[3, w]
        for u in range(K // unit):  # the unit's sum as quantised (int8dot._lane_sums says why)
            acc = np.int32(0)
            for j in range(u * hu, (u + 1) * hu):
                v = np.int32(rows[0, j]) + np.int32(rows[1, j])
                if two:  # 256 v + r, against a scale of a 256th
                    v = v * np.int32(256) + np.int32(rows[2, j]) + np.int32(rows[3, j])
                acc += v
            tsum[u, t] = ts[u, t] * np.float32(acc)
