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
from .panel_avx2 import avx2_panel_tile
from .panel_ir import PANEL_ROWS, PANEL_TOKENS, UnitLoop, panel_args, panel_args_ok, scaled_unit
from .simd import I64, V16F, declare, splat

# natural elements per int8 activation scale in the prefill (llama.cpp's Q8_0 block); decode keeps
# int8dot.ACT_BLOCK. Perplexity of each: BENCHMARKS.md
PREFILL_ACT_BLOCK = 32
# 8-bit rows (Q8_0, Q6_K, widened 5-bit) take the panel where the product of a byte 0..255 and an
# int8 is exact: vpdpbusd or the portable lowering. AVX2's vpmaddubsw saturates its int16 pair sums
# past 128 x 127 x 2, so there 8-bit rows stay on the float tile.
PANEL8 = ISA != "avx2"


@njit(nogil=True, cache=True, inline="always")
def panel_unit(block: int, group_size: int) -> int:
    """Natural elements the int32 accumulators run over before scaling: the activation block,
    at most the weight group (both powers of two, so one divides the other)."""
    return min(block, group_size)


def make_panel_tile(isa: str, bits: int = 4, tokens: int = PANEL_TOKENS, planes: int = 1):
    """out[j * 16 + i] = panel row i times token t0 + j (j < tokens), biases included.

    Arguments (panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group, out): panel uint32
    [K/8, 16] of 4-bit rows, or [K/8, 32] of 8-bit ones (pack_panel); pscale/pbias: float32
    [K/group, 16]; xe/xo: int8 [K/8, Tp, 4 * planes] (quantise_panel_tokens: even / odd
    elements; with 2 planes the high bytes, then the low ones); ts/tsum: float32 [K/unit, Tp];
    out: float32 [>= tokens * 16]; tokens t0 .. t0 + tokens - 1 must exist (< Tp); unit and
    group powers of two, 8 <= unit <= group. planes 2: the activations are 16-bit, as
    ``hi * 256 + lo`` (both int8), each plane one ``vpdpbusd`` against the same weight bytes, and
    per unit the two int32 sums are combined as ``(hi << 8) + lo`` before the one conversion.

    The unit and the group are arguments, the steps of a unit a loop: one tile serves every
    pair. Until stop 46 each (unit, group) pair had its own tile with the unit's steps unrolled:
    40 tiles, whose compilation cost a cold first start seconds, and no faster (the loop's
    compare and branch run beside 16 ``vpdpbusd`` a step)."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")
    if isa == "avx2":
        raise ValueError("AVX2 has its own tiles, one per unit and group (panel_avx2.py)")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    row_dwords = PANEL_ROWS * bits // 4  # a step's dwords: 16 of nibbles, or 16 of even bytes and 16 of odd

    @intrinsic
    def panel_tile(typingctx, panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group, out):
        if not panel_args_ok(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group, out):
            return None

        def codegen(context, builder, signature, args):
            sa, ba, ta, ua, outa, t0v, unitv, groupv, n_units, tp, pan, xe32, xo32 = panel_args(
                context, builder, signature, args)
            fifteen, four = ir.Constant(V64B, [15] * 64), ir.Constant(V64B, [4] * 64)
            izero = ir.Constant(V16I, [0] * 16)
            cttz = declare(builder.module, "llvm.cttz.i64", ir.FunctionType(I64, [I64, ir.IntType(1)]))

            def c(v):
                return ir.Constant(I64, v)

            def load_vec(ptr, index, vtype):
                p = builder.gep(ptr, [index])
                return builder.load(builder.bitcast(p, vtype.as_pointer()), align=1)

            def bcast_i32(ptr, index):
                v = builder.load(builder.gep(ptr, [index]), align=1)
                return builder.bitcast(splat(builder, v, V16I), V64B)

            ksteps = builder.lshr(unitv, c(3))  # dword steps (8 weights each) per unit
            # unit -> group: a shift, both powers of two (a division per unit measured slower)
            group_shift = builder.call(cttz, [builder.udiv(groupv, unitv), ir.Constant(ir.IntType(1), 1)])
            units = UnitLoop(builder, n_units, tokens, V16F, "panel")
            u = units.u
            # the unit's steps: int32 sums reset per unit (the scales apply to a unit's sum), one
            # chain per token and plane (a second chain for the odd weights measured no faster)
            head = builder.block
            body = builder.append_basic_block("panel.steps")
            builder.branch(body)
            builder.position_at_end(body)
            sl = builder.phi(I64)
            sl.add_incoming(c(0), head)
            chains = [[builder.phi(V16I) for _ in range(tokens)] for _ in range(planes)]
            for row in chains:
                for phi in row:
                    phi.add_incoming(izero, head)
            iaccs = [list(row) for row in chains]
            s = builder.add(builder.mul(u, ksteps), sl)
            at = builder.mul(s, c(row_dwords))
            if bits == 4:  # the low nibbles are the even elements, the high ones the odd
                w = builder.bitcast(load_vec(pan, at, V16I), V64B)
                lo, hi = builder.and_(w, fifteen), builder.lshr(w, four)
            else:  # pack_panel put the even bytes first, then the odd
                lo = builder.bitcast(load_vec(pan, at, V16I), V64B)
                hi = builder.bitcast(load_vec(pan, builder.add(at, c(PANEL_ROWS)), V16I), V64B)
            tok0 = builder.add(builder.mul(s, tp), t0v)
            for j in range(tokens):
                idx = builder.add(tok0, c(j))
                if planes > 1:
                    idx = builder.mul(idx, c(planes))
                for p in range(planes):
                    ip = builder.add(idx, c(p)) if p else idx
                    iaccs[p][j] = dot_i32_wide(builder, isa, iaccs[p][j], lo, bcast_i32(xe32, ip))
                    iaccs[p][j] = dot_i32_wide(builder, isa, iaccs[p][j], hi, bcast_i32(xo32, ip))
            nxt = builder.add(sl, c(1))
            sl.add_incoming(nxt, builder.block)
            for row, new in zip(chains, iaccs):
                for phi, v in zip(row, new):
                    phi.add_incoming(v, builder.block)
            steps_done = builder.append_basic_block("panel.steps.done")
            builder.cbranch(builder.icmp_unsigned("<", nxt, ksteps), body, steps_done)
            builder.position_at_end(steps_done)
            g = builder.lshr(u, group_shift)
            ws = load_vec(sa.data, builder.mul(g, c(16)), V16F)
            wb = load_vec(ba.data, builder.mul(g, c(16)), V16F)
            p0 = builder.add(builder.mul(u, tp), t0v)
            finals = units.close(scaled_unit(builder, iaccs, ws, wb, ta, ua, p0, units.faccs))
            for j, final in enumerate(finals):
                dst = builder.gep(outa.data, [c(16 * j)])
                builder.store(final, builder.bitcast(dst, V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.none(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group, out), codegen

    return panel_tile


# one tile per weight width and activation planes (on AVX2 never run: panel_avx2's serve there,
# and 8-bit rows stay on floats; made with the portable lowering so that they compile anywhere)
_TILE_ISA = "generic" if ISA == "avx2" else ISA
_t4_1, _t4_2 = make_panel_tile(_TILE_ISA, 4), make_panel_tile(_TILE_ISA, 4, planes=2)
_t8_1, _t8_2 = make_panel_tile(_TILE_ISA, 8), make_panel_tile(_TILE_ISA, 8, planes=2)


@njit(nogil=True, cache=True, inline="always")
def _vector_tile(pan, xq, t0, group_size, unit, out):  # pragma: no cover - jitted
    panel, pscale, pbias = pan
    xe, xo, ts, tsum = xq
    if panel.shape[1] == 2 * PANEL_ROWS:
        if xe.shape[2] == 8:
            _t8_2(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group_size, out)
        else:
            _t8_1(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group_size, out)
    elif xe.shape[2] == 8:
        _t4_2(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group_size, out)
    else:
        _t4_1(panel, pscale, pbias, xe, xo, ts, tsum, t0, unit, group_size, out)


# out[j * 16 + i] = panel row i times token t0 + j (j < PANEL_TOKENS), biases included; pan =
# (panel, pscale, pbias) of pack_panel (4-bit rows, or 8-bit ones where PANEL8), xq = (xe, xo,
# ts, tsum) of quantise_panel_tokens (one plane: int8 activations; two: 16-bit)
panel_tile = avx2_panel_tile if ISA == "avx2" else _vector_tile


@njit(nogil=True, cache=True)
def panel_rows(pan, xq, T, group_size, unit, out):  # pragma: no cover - jitted
    """out[t * 16 + i] = panel row i times token t for every t < T (panel_tile on each block
    of PANEL_TOKENS; out holds panel_token_rows(T) x 16). Not inlined, so that its tiles compile
    once, not at each of prefill_step's call sites (a cold first start spent ~11 s more on those
    copies when there were 24); one call per 16-row claim costs nothing measurable, where a call
    per tile cost ~10% of the prefill."""
    for t in range(0, T, PANEL_TOKENS):
        panel_tile(pan, xq, t, group_size, unit, out[t * PANEL_ROWS:])


@njit(nogil=True, cache=True)
def pack_panel(packed, scales, biases, bits, r0, n, panel, pscale, pbias):  # pragma: no cover - jitted
    """Rows r0 .. r0 + n - 1 (n <= 16) of a 4- or 8-bit weight into the panel, pscale/pbias[g, i]
    each row's group g scale and bias as float32; rows n .. 15 zero (their results are zero and
    not read). 4-bit: panel [K/8, 16], panel[s, i] = packed bytes 4s .. 4s + 3 of row r0 + i (as
    one dword: the even elements in the low nibbles). 8-bit: panel [K/8, 32], panel[s, i] = the
    bytes of elements 8s, 8s + 2, 8s + 4, 8s + 6 of row r0 + i, panel[s, 16 + i] those of
    8s + 1, ..., 8s + 7: the tile's even and odd weights as the nibbles give them."""
    steps = panel.shape[0]
    width = panel.shape[1]
    # step-major: each step's 16 (or 32) dwords are one or two cache lines written whole, the 16
    # rows read as 16 sequential streams; row by row, every write had touched another line:
    # 0.13 -> 0.055 ns a weight (1536 x 576, 4-bit), which a prefill of a few tokens pays in full
    if bits == 4:
        rows32 = packed.view(np.uint32)
        for s in range(steps):
            for i in range(n):
                panel[s, i] = rows32[r0 + i, s]
            for i in range(n, width):
                panel[s, i] = 0
    else:
        rows64 = packed.view(np.uint64)
        for s in range(steps):
            for i in range(n):
                e, o = _even_odd_bytes(rows64[r0 + i, s])
                panel[s, i] = e
                panel[s, PANEL_ROWS + i] = o
            for i in range(n, PANEL_ROWS):
                panel[s, i] = 0
                panel[s, PANEL_ROWS + i] = 0
    for i in range(PANEL_ROWS):
        for g in range(pscale.shape[0]):
            if i < n:
                pscale[g, i] = as_f32(scales[r0 + i, g])
                pbias[g, i] = bias_at(scales, biases, bits, r0 + i, g)
            else:
                pscale[g, i] = 0.0
                pbias[g, i] = 0.0


@njit(nogil=True, cache=True, inline="always")
def _even_odd_bytes(x):  # pragma: no cover - jitted
    """The bytes 0, 2, 4, 6 and 1, 3, 5, 7 of a little-endian uint64, each four as one uint32."""
    return _gather_even_bytes(x), _gather_even_bytes(x >> np.uint64(8))


@njit(nogil=True, cache=True, inline="always")
def _gather_even_bytes(x):  # pragma: no cover - jitted
    """Bytes 0, 2, 4, 6 of a little-endian uint64 as one uint32 (bytes 0 .. 3)."""
    v = x & np.uint64(0x00FF00FF00FF00FF)
    v = (v | (v >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return np.uint32((v | (v >> np.uint64(16))) & np.uint64(0xFFFFFFFF))


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
