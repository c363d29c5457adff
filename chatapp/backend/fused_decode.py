"""The decode step of a Llama-style model in one native call per token (CPU backend).

MLX's CPU backend pays a dispatch for each op: a 1-token step of SmolLM2-135M runs ~210
quantised products (most under 1024x1024, on MLX's slow ``quantized_matmul``) and ~300
element-wise ops, ~130 ms a token where llama.cpp takes ~10. ``FusedDecoder.step`` runs the
token through `chatapp.kernels.decode_step.token_step` (per layer: norms, the 7 projections on
the packed weights, RoPE, attention over the cache's buffers read in place, the MLP) in one
call, then the output head on the packed kernel. The kernel writes the new K/V rows into the
cache buffers in place (by address) and the caches count them (``wrote_in_place``), except
where a view handed out of the buffers (a snapshot, the prefix store, ``state``) covers that row,
which only happens after a ``trim``: that row goes through the cache's own ``update_and_fetch``
(MLX's slice update, copy-on-write). So the cache, its state, trimming and the prefix store see
exactly what the MLX step would have written, and no snapshot changes. The buffers are
float16 where ``cpu.kv_dtype`` says so (auto: where the CPU has F16C): ``adopt`` gives empty
caches that dtype before anything writes them, and the kernels read and write float16 bits
(kernels/half.py); caches that already hold float32 rows are read as float32.

``FusedDecoder.prefill`` runs a chunk whose caller wants its last position only, over every
segmented cache (prealloc and each policy over it: sinks, a recent window, a quantised middle
read as stored, scored votes; fused_support.cache_refusal). fused_install.py decides which of a
model's calls take these routes. Only models whose decoder layers are exactly Llama's math
(fused_support.fused_unsupported) are fused.
"""

from __future__ import annotations

import copy
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cache.layers import settle

from .fused_layers import FusedLayer, packed_weights, read_layer, read_norm
from .fused_positions import LayerAngles, positions, windows
from .fused_settings import (
    DOWN_CHOICES,
    FAST_DOWN_DEFAULT,
    FAST_HEAD_DEFAULT,
    FAST_SCORES_DEFAULT,
    HEAD_CHOICES,
    KV_HOST,
    KV_MX,
    SCORES_CHOICES,
    resolve_kv_dtype,
    resolve_numerics,
)
from .fused_support import (
    PROJECTIONS,
    WIDENED_BITS,
    attention_head_dim,
    embed_scale,
    inner_model,
    mlp_activation,
    text_model,
)
from .kv_native import NativeRowOps


def _one_scale_dtype(projections: list[list[tuple]]) -> list[list[tuple]]:
    """Each projection's (packed, scales, biases) of every layer, all with one scales dtype: a
    typed list holds one type, and the prefill kernel takes q, k and v (and gate and up) through
    one variable. Where they differ (a Q4_K_M file: Q4_K's float32 scales, Q5_0's and Q8_0's
    float16), float16 bits are widened to float32 (exact; 2 more bytes per 32 weights)."""
    if len({w[1].dtype for ws in projections for w in ws}) == 1:
        return projections

    def f32(a: np.ndarray) -> np.ndarray:
        return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a

    return [[(packed, f32(scales), f32(biases)) for packed, scales, biases in ws] for ws in projections]


class FusedDecoder:
    """The per-layer weights as the kernel reads them, and the token step."""

    # False: every new K/V row goes through update_and_fetch, as before rows were written in
    # place (the benches' same-run baseline: chatapp bench cpu --model ... peer chatapp-append)
    write_in_place = True
    # chunks each projection of the token step is cut into; 0: CHUNKS_PER_THREAD per pool thread
    # (the tests set others: the result is the same bits for any)
    chunks = 0

    def __init__(self, model: nn.Module, numerics: str = "exact", kv_dtype: str = "float32"):
        model = text_model(model)
        inner = inner_model(model)
        # the dtype of the K/V buffers this decoder gives the caches it meets empty (adopt):
        # float16 halves the bytes a long-context step streams and the cache's memory
        self.kv_dtype = resolve_kv_dtype(kv_dtype)
        # fast: 4-bit rows against int8 activations (kernels/int8dot.py; its ISA picked at import)
        self.fast = resolve_numerics(numerics) == "fast"
        # prefill chunks (run under last_position_only) through kernels/prefill_step.py too
        self.prefill_chunks = True
        self.layers: list[FusedLayer] = [read_layer(layer) for layer in inner.layers]
        # the matrices read widened to a byte a value (fused_layers.widened), for the plan's line
        self.widened = sum(layer[p][n].bits in WIDENED_BITS for layer in inner.layers for p, n in PROJECTIONS)
        attn = inner.layers[0]["self_attn"]
        last = inner.layers[-1]
        self.group_size = int(packed_weights(last["self_attn"]["q_proj"]).group_size)
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attention_head_dim(attn)
        self.scale = np.float32(attn.scale)
        self.traditional = bool(attn.rope.traditional)
        # the embeddings' multiplier (Gemma 3: sqrt(hidden)), the MLP's activation
        self.embed_scale = embed_scale(model)
        self.gelu = mlp_activation(inner.layers[0]["mlp"]) == "gelu"
        self.final_norm, self.final_eps = read_norm(inner["norm"]), np.float32(inner["norm"].eps)
        embed = inner["embed_tokens"]
        self.embed = embed
        tied = "lm_head" not in model
        head = embed if tied else model["lm_head"]
        quantised = isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear))
        self.head_packed = packed_weights(head) if quantised else None
        self.head_dense = None if self.head_packed is not None else np.asarray(head["weight"].astype(mx.float32))
        self._int8_head = self._make_int8_head()
        self.embed_packed = packed_weights(embed) if isinstance(embed, nn.QuantizedEmbedding) else None
        dim = inner.layers[0]["input_layernorm"]["weight"].shape[0]
        hidden = packed_weights(last["mlp"]["gate_proj"]).out_features
        hd = self.n_heads * self.head_dim
        kd = self.n_kv_heads * self.head_dim
        self.dim = dim
        self._q = np.empty(hd, np.float32)
        self._k = np.empty(kd, np.float32)
        self._v = np.empty(kd, np.float32)
        self._k_out = np.empty(kd, np.float32)
        from chatapp.kernels.group_attention import part_size

        # room for the splits of the full-precision rows and as many of a quantised middle's
        self._part = np.empty(2 * part_size(self.n_heads, self.n_kv_heads, self.head_dim), np.float32)
        self._act = np.empty(hidden, np.float32)
        self._ob = np.empty(dim, np.float32)  # the sandwich norms' inputs (Gemma 3)
        if any(layer.eps != self.layers[0].eps for layer in self.layers):
            raise ValueError("fused decode: layers with different norm eps")
        self._stack(self.layers)
        self.set_fast(self.fast)

    def _stack(self, layers: list[FusedLayer]) -> None:
        """What token_step and prefill_step take of ``layers``: the weights as typed lists (built
        once, by cached code), norms and bits stacked, and the per-layer K/V addresses."""
        from chatapp.kernels.typed_lists import typed_list

        self.layers = layers
        per_projection = _one_scale_dtype([[layer.weights[j] for layer in layers] for j in range(len(PROJECTIONS))])
        self._lists = [typed_list(ws) for ws in per_projection]
        self._attn_norms = np.stack([layer.attn_norm for layer in layers])
        self._mlp_norms = np.stack([layer.mlp_norm for layer in layers])
        self._bits = np.stack([layer.bits for layer in layers])
        self._eps = layers[0].eps
        widths = {layer.qkv_bias.shape[0] for layer in layers}
        if len(widths) != 1:
            raise ValueError("fused decode: some layers' q/k/v projections have biases and some not")
        self._qkv_bias = np.stack([layer.qkv_bias for layer in layers])
        if len({layer.qk_norm.shape[0] for layer in layers}) != 1:
            raise ValueError("fused decode: some layers normalise their queries and keys and some not")
        self._qk_norm = np.stack([layer.qk_norm for layer in layers])
        if len({layer.post_norm.shape[0] for layer in layers}) != 1:
            raise ValueError("fused decode: some layers have sandwich norms and some not")
        self._post_norm = np.stack([layer.post_norm for layer in layers])
        # each layer's RoPE (Gemma 3: local and global bases), and the caches' flushes and
        # evictions, in place on the host views this decoder keeps, with the RoPE of their layer
        self.angles = LayerAngles(np.stack([layer.inv_freq for layer in layers]))
        ops = [NativeRowOps(f, self.traditional) for f in self.angles.freqs]
        self._row_ops = [ops[k] for k in self.angles.kind]
        self.row_ops = self._row_ops[0]  # layer 0's (every layer's but in Gemma 3's two RoPEs)
        n, kd = len(layers), self._k.shape[0]
        self._k_all = np.empty((n, kd), np.float32)
        self._v_all = np.empty((n, kd), np.float32)
        self._kv_addr = np.empty((n, 2), np.int64)
        self._kv_size = np.empty(n, np.int64)
        self._kv_stride = np.empty(n, np.int64)
        self._write_kv = np.zeros(n, np.int64)
        # a quantised middle's six buffers per layer (decode_step.token_step's q_addr ...), the
        # angles of its queries, and the roped queries each layer hands back
        self._q_addr = np.zeros((n, 6), np.int64)
        self._q_size = np.zeros((n, 6), np.int64)
        self._q_stride = np.zeros((n, 6), np.int64)
        half = self.head_dim // 2
        self._cos_q = np.ones((n, half), np.float32)
        self._sin_q = np.zeros((n, half), np.float32)
        self._q_out = np.empty((n, self.n_heads * self.head_dim), np.float32)

    def first_layers(self, n: int) -> "FusedDecoder":
        """A decoder of this one's first ``n`` layers, sharing their weights and numerics: the
        warm-up's. Its steps call the same kernels with the same argument types (numba compiles
        or loads them once per process), reading n / L of the weights: on the 32 layers of a 7B
        model the whole-model warm-up took 1.8 s of a later start, and one layer takes ~0.1 s."""
        part = copy.copy(self)
        part._stack(self.layers[:n])
        part.fast_mask, part.prefill_mask = self.fast_mask[:n].copy(), self.prefill_mask[:n].copy()
        return part

    def warm_up(self, before_prefill: Callable[[], None] | None = None) -> None:
        """Run a step and a two-token prefill on scratch caches (see install_fused_decode)."""
        from cache import CacheSettings, PreallocKVCache

        scratch = [PreallocKVCache(CacheSettings()) for _ in self.layers]
        if before_prefill is not None:
            self.step(0, scratch)
            before_prefill()
        self.prefill(mx.array([0, 0]), scratch)
        self.step(0, scratch)
        del scratch
        mx.clear_cache()  # the scratch caches' chunk of K/V per layer

    def dropped_bias_bytes(self) -> int:
        """Bytes of bias arrays the model holds that this decoder does not read (symmetric
        weights, kernels/affine.py): what a decoded token reads less than the modules hold."""
        return sum(s.nbytes for layer in self.layers for _, s, b in layer.weights if b.shape[1] == 0)

    def set_fast(self, fast: bool, act_block: int = 0, last_exact: bool = True, prefill_block: int = 0,
                 decode_down: str = FAST_DOWN_DEFAULT, prefill_down: str = FAST_DOWN_DEFAULT,
                 head: str = FAST_HEAD_DEFAULT, prefill_scores: str = FAST_SCORES_DEFAULT) -> None:
        """Which products run on int8 activations: per layer a mask of decode_step.FAST_* bits,
        with the activation block (elements per int8 scale; 0: int8dot.ACT_BLOCK) above them, and
        ``last_exact`` keeping the last layer on float32 activations. ``prefill_block``: the
        elements per int8 scale of the prefill's products (kernels/int8panel.py; 0: its
        PREFILL_ACT_BLOCK), which may be coarser than the decode's: the panel kernel scales once
        per block (or group). ``decode_down`` / ``prefill_down``: down_proj, whose input silu(gate)
        x up has the widest range, on ``int8`` activations like the rest, on ``wide`` 16-bit ones
        (decode_step.FAST_DOWN_WIDE, prefill_step.PREFILL_DOWN_WIDE: ~1/256 of int8's rounding at
        about twice its integer work) or ``exact`` float32 ones. ``head``: the output head on
        ``int8`` activations (kernels/int8head.py, where its kernels take the head's weight) or
        ``exact`` float32 ones. ``prefill_scores``: the prefill chunk's attention scores on
        ``int8`` (u8 key rows against int8 query lanes, kernels/chunk_scores_int.py, where the CPU
        has vpdpbusd) or ``exact`` floats.

        Until stop 31 the kernels added each bias times the float sum of its activations, while
        the scales multiplied the quantised ones, so a product's error weighed each rounding with
        the unsigned nibble (0..15) rather than the weight; down_proj on int8 then cost SmolLM2
        +0.82% perplexity on 3,072 tokens of the KJV text and had to stay exact. With the sums as
        quantised (int8dot._lane_sums) every product on int8 costs +0.05% there and -0.01% on
        ../shared/docs/architecture.md, against exact, and decodes ~20% faster than down_proj
        exact (BENCHMARKS.md, stop 31)."""
        from chatapp.kernels.decode_step import FAST_ALL, FAST_ATTN, FAST_BLOCK_SHIFT, FAST_DOWN, FAST_DOWN_WIDE
        from chatapp.kernels.prefill_step import PREFILL_DOWN_WIDE

        for name, value in (("decode_down", decode_down), ("prefill_down", prefill_down)):
            if value not in DOWN_CHOICES:
                raise ValueError(f"{name} must be one of {', '.join(DOWN_CHOICES)}, not {value!r}")
        if head not in HEAD_CHOICES:
            raise ValueError(f"head must be one of {', '.join(HEAD_CHOICES)}, not {head!r}")
        if prefill_scores not in SCORES_CHOICES:
            raise ValueError(f"prefill_scores must be one of {', '.join(SCORES_CHOICES)}, not {prefill_scores!r}")
        if act_block not in (0, 8, 16, 32):
            raise ValueError(f"act_block must be 8, 16 or 32, not {act_block}")
        if prefill_block not in (0, 8, 16, 32, 64, 128) or prefill_block and any(
                k % prefill_block for k in (self.dim, self.n_heads * self.head_dim, self._act.shape[0])):
            raise ValueError(f"prefill_block must be 8, 16, 32, 64 or 128 dividing the inputs, not {prefill_block}")
        self.prefill_block = prefill_block
        self.int8_head = fast and head == "int8"
        n = len(self.layers)
        self.fast = fast
        assert PREFILL_DOWN_WIDE == FAST_DOWN_WIDE  # one table of down_proj's bits serves both phases
        down_bits = {"int8": FAST_DOWN, "wide": FAST_DOWN_WIDE, "exact": 0}
        decode = FAST_ALL & ~FAST_DOWN | down_bits[decode_down]
        self.fast_mask = np.full(n, (decode | act_block << FAST_BLOCK_SHIFT) if fast else 0, np.int64)
        if fast and last_exact and n > 1:
            self.fast_mask[-1] = 0
        # the prefill's mask: the same products and block in the layers with int8 ones, down_proj
        # and the scores as asked
        keep = ~(FAST_DOWN | FAST_DOWN_WIDE | (FAST_ATTN if prefill_scores == "exact" else 0))
        self.prefill_mask = np.where(self.fast_mask != 0, self.fast_mask & keep | down_bits[prefill_down],
                                     0).astype(np.int64)

    def embedding(self, token: int) -> np.ndarray:
        """The token's embedding row as float32, times the model's embedding scale (what the
        first layer receives)."""
        row = self._embedding_row(token)
        return row * self.embed_scale if self.embed_scale is not None else row

    def _embedding_row(self, token: int) -> np.ndarray:
        """What the embedding layer returns for ``token``, float32."""
        if self.embed_packed is None:
            return np.asarray(self.embed["weight"][token].astype(mx.float32)).copy()
        pw = self.embed_packed

        def f32(a):
            return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)

        row = pw.packed[token]
        if pw.bits == 4:
            q = np.empty(row.shape[0] * 2, np.float32)
            q[0::2], q[1::2] = row & 15, row >> 4
        else:
            q = row.astype(np.float32)
        g = pw.group_size
        s, b = f32(pw.scales[token]), f32(pw.biases[token])
        return (q.reshape(-1, g) * s[:, None] + b[:, None]).reshape(-1).astype(np.float32)

    def adopt(self, caches: list) -> None:
        """Give the caches that hold no buffers yet this decoder's K/V dtype, so that what
        writes them first (this step, or the model's own call) makes them in it; caches that
        hold rows keep theirs (a restored float32 state is read as float32)."""
        dtype = KV_MX[self.kv_dtype]
        for c, ops in zip(caches, self._row_ops):
            if c.full.keys is None:
                c.full.dtype = dtype
            c.native = ops

    def _cache_buffers(self, caches: list, n_new: int) -> np.ndarray:
        """Room for ``n_new`` more rows in every layer's buffers, and their addresses, sizes and
        head strides in ``_kv_addr``/``_kv_size``/``_kv_stride``; returns the rows each layer's
        buffers hold [L] (a sliding window's fewer than a full layer's; the buffers' dtype,
        float32 or float16, is ``caches[0].full.keys.dtype``).

        Each buffer's host view and address are kept on the buffer (``FullBuffer.pinned``) while
        its arrays stay the same, which is every decode step once rows are written in place; MLX
        writes (appends, growth) drop them first, so MLX may reuse the buffer."""
        KVH, D = self.n_kv_heads, self.head_dim
        self.adopt(caches)
        unpinned = []
        z = mx.zeros((1, KVH, 1, D))  # the rows' shape; reserve takes the buffers' dtype
        for c in caches:
            full = c.full
            if full.keys is None:  # first buffers: nothing old to free, made with the others below
                full.reserve(n_new, z, z)
            elif full.length + n_new > full.capacity:
                full.reserve(n_new, z, z)
                # one layer at a time: growing all at once would hold every layer's old buffers,
                # zeros and new buffers together (MLX's peak +96 MiB on 8 layers of a 7B model at
                # 256 -> 512 tokens in float16, where the new buffers are 64)
                mx.eval(full.keys, full.values)
                mx.clear_cache()  # its old buffers, which no cache of this size will take again soon
            if full.pinned is None:
                unpinned.append(full)
        if unpinned:
            mx.eval(*[a for full in unpinned for a in (full.keys, full.values)])
            for full in unpinned:
                # the buffers are contiguous [1, kv_heads, capacity, D]: heads capacity * D apart
                kf, vf = np.asarray(full.keys), np.asarray(full.values)
                if np.shares_memory(kf, vf):  # the kernel would write K over V: never let it
                    raise RuntimeError("fused decode: a cache's keys and values share one buffer")
                full.pinned = (kf, vf, kf.ctypes.data, vf.ctypes.data, kf.size, full.capacity * D)
        n_cached = np.array([c.full.length for c in caches], np.int64)
        dtype = caches[0].full.keys.dtype
        for i, c in enumerate(caches):
            full = c.full
            if full.keys.dtype != dtype:
                raise ValueError("fused decode: the layers' caches hold K/V of different dtypes")
            _, _, self._kv_addr[i, 0], self._kv_addr[i, 1], self._kv_size[i], self._kv_stride[i] = full.pinned
        return n_cached

    def _make_int8_head(self):
        """The head's product on int8 activations (kernels/int8head.py), or None where its kernels
        do not take the head (a float head, a bit width they lack)."""
        from chatapp.kernels.affine import drop_symmetric_biases
        from chatapp.kernels.int8head import FastHead, unsupported

        pw = self.head_packed
        if pw is None or unsupported(pw.bits, pw.group_size, pw.in_features, pw.out_features):
            return None
        return FastHead(*drop_symmetric_biases(pw.packed, pw.scales, pw.biases, pw.bits), pw.bits, pw.group_size)

    def _head(self, x: np.ndarray) -> np.ndarray:
        """Logits [vocab] of the final hidden state ``x`` [dim]."""
        from chatapp.kernels.decode_step import rms_norm

        xn = rms_norm(x, self.final_norm, self.final_eps)
        if self.int8_head and self._int8_head is not None:
            return self._int8_head(xn)
        if self.head_packed is not None:
            from chatapp.kernels.qmatmul import matmul

            return matmul(self.head_packed, xn[None])[0]
        return self.head_dense @ xn

    def step(self, token: int, caches: list) -> np.ndarray:
        """Logits [vocab] (float32) for ``token`` after the caches' tokens; appends its K/V."""
        from chatapp.kernels.decode_step import CHUNKS_PER_THREAD, CTL_SIZE, token_step
        from chatapp.kernels.pool import pool

        KVH, D = self.n_kv_heads, self.head_dim
        settle(caches)  # quantise or evict what is due before the buffers are read
        n_cached = self._cache_buffers(caches, 1)
        n_quant, q_bits, q_group, scales_like = self._quant_buffers(caches)
        write = self._write_kv
        for i, c in enumerate(caches):
            write[i] = self.write_in_place and c.full.writable_in_place(1)
        # the token's position in each layer: right after every token held (compacted where a
        # policy evicts), or every token seen (a sliding window)
        position = positions(caches)
        cos, sin = self.angles.step(position)
        if n_quant.any():
            self._middle_angles(caches, position)
        x = self.embedding(token)
        pool().broadcast(token_step, np.zeros(CTL_SIZE * len(self.layers), np.int64), x, self._attn_norms,
                         self._mlp_norms, self._eps, *self._lists, self._bits, self.group_size, cos, sin,
                         self.traditional, self.n_heads, KVH, self._kv_addr, self._kv_size, self._kv_stride,
                         n_cached, self.scale, self._q, self._k, self._v_all, self._k_all, self._part, self._act,
                         self.fast_mask, write, _kv_like(caches),
                         self.chunks or CHUNKS_PER_THREAD * pool().threads, self._q_addr, self._q_size,
                         self._q_stride, n_quant, q_bits, q_group, self._cos_q, self._sin_q, scales_like,
                         self._q_out, self._qkv_bias, self._qk_norm, windows(caches), self._post_norm, self.gelu,
                         self._ob)
        k_new = v_new = queries = None
        for i, c in enumerate(caches):
            if write[i]:
                c.wrote_in_place(1)
            else:
                # a row a snapshot may still hold (after a trim): through MLX, which copies the buffer
                if k_new is None:
                    k_new, v_new = mx.array(self._k_all), mx.array(self._v_all)
                c.absorb(k_new[i].reshape(1, KVH, 1, D), v_new[i].reshape(1, KVH, 1, D))
            if c.keeps_queries:
                if queries is None:  # one copy a step (the scratch is overwritten by the next)
                    queries = self._q_out.reshape(len(caches), self.n_heads, D).copy()
                c.keep_queries(queries[i], float(self.scale))
        return self._head(x)

    def _quant_buffers(self, caches: list) -> tuple[np.ndarray, int, int, np.ndarray]:
        """The caches' quantised middles for token_step: their buffers' addresses, sizes and head
        strides in ``_q_addr``/``_q_size``/``_q_stride``; returns (rows held, bits, group size, an
        empty array of the scales' kernel type). The host views are kept on each buffer
        (``QuantBuffer.pinned``) until its arrays change (a flush or an eviction: every
        evict_chunk tokens). No middle: zeros, and the scales' type the K/V dtype gives them. The
        rows held are per layer [L] (a sliding window's layer holds no middle)."""
        from chatapp.kernels.half import KV_NUMPY

        n_quant = np.array([c.quant.length if c.quant is not None else 0 for c in caches], np.int64)
        kv_like = _kv_like(caches)
        if not n_quant.any():
            self._q_addr[:] = 0
            self._q_size[:] = 0
            native = kv_like.dtype == np.uint16 and _half_scales_native()
            return n_quant, 8, 32, np.empty(0, KV_NUMPY["float16"] if native else np.float32)
        kinds = set()
        first = None
        for i, c in enumerate(caches):
            q = c.quant
            if q is None or not q.length:
                self._q_addr[i] = self._q_size[i] = 0
                continue
            first = q if first is None else first
            if q.pinned is None:
                q.pinned = _pin_quant(q)
            views, addrs, sizes, strides = q.pinned
            self._q_addr[i], self._q_size[i], self._q_stride[i] = addrs, sizes, strides
            kinds.add((q.bits, q.group_size, views[1].dtype.str))
        if len(kinds) != 1:
            raise ValueError("fused decode: the layers' quantised middles differ in bits, groups or scale dtype")
        bits, group, _ = kinds.pop()
        return n_quant, bits, group, np.empty(0, first.pinned[0][1].dtype)

    def _middle_angles(self, caches: list, position: np.ndarray) -> None:
        """cos/sin of each layer's middle: its keys sit the cache's ``delta_q`` further on."""
        self.angles.step(position + np.array([c.delta_q for c in caches], np.int64), (self._cos_q, self._sin_q))

    def prefill(self, tokens: mx.array, caches: list, every_position: bool = False) -> np.ndarray:
        """Logits [vocab] of the last of ``tokens`` [T] after the caches' tokens (``every_position``:
        [T, vocab], each row through the same head, as bench quality scores); appends the
        chunk's K/V (kernels/prefill_step.py: every layer in one native call, float32; with
        numerics fast the products of prefill_mask on int8 activations, down_proj's on 16-bit
        ones, kernels/int8panel.py)."""
        from chatapp.kernels.pool import pool
        from chatapp.kernels.prefill_step import LAYER_CTL, prefill_step, rope_rows

        T = int(tokens.shape[0])
        KVH, D, L = self.n_kv_heads, self.head_dim, len(self.layers)
        settle(caches)  # quantise or evict what is due before the buffers are read
        emb = self.embed(tokens)
        if self.embed_scale is not None:  # (in the embedding's dtype, as the model's code multiplies)
            emb = emb * mx.array(self.embed_scale, mx.bfloat16).astype(emb.dtype)
        emb = emb.astype(mx.float32) if emb.dtype != mx.float32 else emb
        mx.eval(emb)
        x = np.array(emb, np.float32)  # the kernel updates it in place
        del emb  # (freed with MLX's cache below)
        # a quantised middle is read as stored, block by block (prefill_attention._fill_block:
        # dequantised and turned back by its rotation delta in cache-resident scratch); the chunk's
        # rows go after the sinks and window in the full-precision buffers, as a decode step's do
        n_full = self._cache_buffers(caches, T)
        n_quant, q_bits, q_group, scales_like = self._quant_buffers(caches)
        n_cached = n_full + n_quant  # per layer
        starts = positions(caches)
        cos_u, sin_u = self._unrotation_angles(caches)
        # the kernel's scratch below is numpy's (a few [T, hidden] float32 arrays per thread and
        # shared), which MLX's buffer cache cannot serve: what that cache holds idle now (the
        # embedding's temporaries, a previous turn's caches: 22-30 MiB on 8 layers of a 7B model)
        # would only add to the peak
        mx.clear_cache()
        cos, sin = self.angles.table(starts, T)  # [L, T, D/2]
        hd, kd = self.n_heads * D, KVH * D
        host = _kv_like(caches).dtype
        # the kernel writes the chunk's K/V rows into the cache buffers themselves where no view
        # handed out covers them (as step does): no [layers, T, kv] copy of them (32 MiB for 256
        # tokens of a 7B model's 8 layers in float16, 128 MiB for all 32) on top of the buffers
        in_place = self.write_in_place and all(c.full.writable_in_place(T) for c in caches)
        if in_place:
            k_out = v_out = np.empty((L, 0, kd), host)
        else:
            # else into these MLX arrays (through numpy views of their buffers), which the
            # cache appends read without a copy (in the cache's dtype: float16 as uint16 bits)
            dtype = caches[0].full.keys.dtype
            k_all, v_all = mx.zeros((L, T, kd), dtype), mx.zeros((L, T, kd), dtype)
            mx.eval(k_all, v_all)
            k_out = np.frombuffer(memoryview(k_all), host).reshape(L, T, kd)
            v_out = np.frombuffer(memoryview(v_all), host).reshape(L, T, kd)
        # the chunk's last queries for the caches that keep them (a scored cache's votes), as
        # MLX's route hands them to attend(): roped, the step's scale apart
        n_keep = min(T, max(c.chunk_queries_kept for c in caches))
        q_keep = np.empty((L, n_keep, hd), np.float32)
        pool().broadcast(prefill_step, np.zeros(LAYER_CTL * L, np.int64), x, self._attn_norms, self._mlp_norms,
                         self._eps, *self._lists, self._bits, self.group_size, cos, sin, self.traditional,
                         self.n_heads, KVH, self._kv_addr, self._kv_size, self._kv_stride, n_cached, self.scale,
                         np.empty((T, hd), np.float32), np.empty((T, kd), np.float32),
                         np.empty((T, kd), np.float32), k_out, v_out,
                         np.empty((T, hd), np.float32), np.empty((T, self._act.shape[0]), np.float32),
                         self.prefill_mask, q_keep, self._q_addr, self._q_size, self._q_stride, n_quant, q_bits,
                         q_group, cos_u, sin_u, scales_like, self._qkv_bias, self._qk_norm, windows(caches),
                         self._post_norm, self.gelu, np.empty((T, self.dim), np.float32), self.prefill_block,
                         every_position)
        del k_out, v_out
        if n_keep:
            kept = q_keep.reshape(L, n_keep, self.n_heads, D)
            if self._qk_norm.shape[1]:  # kept before the q norm (Qwen3), which comes before RoPE
                w = self._qk_norm[:, None, None, :D]
                kept = kept / np.sqrt(np.mean(kept * kept, axis=-1, keepdims=True) + self._eps) * w
            for i, c in enumerate(caches):
                if c.chunk_queries_kept:
                    roped = rope_rows(kept[i], cos[i, T - n_keep:], sin[i, T - n_keep:], self.traditional)
                    c.keep_chunk_queries(roped, float(self.scale), T)
        if in_place:
            for c in caches:
                c.wrote_in_place(T)
        else:
            k_new = k_all.reshape(L, T, KVH, D).transpose(0, 2, 1, 3)
            v_new = v_all.reshape(L, T, KVH, D).transpose(0, 2, 1, 3)
            for i, c in enumerate(caches):
                c.absorb(k_new[i][None], v_new[i][None])
        return np.stack([self._head(row) for row in x]) if every_position else self._head(x[-1])

    def _unrotation_angles(self, caches: list) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [L, D/2] that turn each layer's middle keys back by its rotation delta (to their
        compacted positions, as ``content()`` gives them): the prefill's queries have many
        positions, so the keys move, not the queries as in a decode step (_middle_angles)."""
        from chatapp.kernels.decode_step import rope_angles

        n, half = len(caches), self.head_dim // 2
        cos, sin = np.ones((n, half), np.float32), np.zeros((n, half), np.float32)
        for i, c in enumerate(caches):
            if c.quant is not None and c.quant.length and c.delta_q:
                cos[i], sin[i] = rope_angles(-c.delta_q, self.angles.freqs_of(i))
        return cos, sin


def _half_scales_native() -> bool:
    from chatapp.kernels import half_scales_native

    return half_scales_native()


def _pin_quant(q) -> tuple:
    """Host views of a quantised middle's six buffers ([1, kv_heads, capacity, width] each: packed
    uint32 words read as bytes, scales and biases as the kernels read them) with their addresses,
    element counts and head strides; the views keep the arrays alive."""
    from chatapp.kernels.attention import heads_view

    from .kv_native import host_scales

    views, addrs, sizes, strides = [], [], [], []
    for packed, scales, biases in (q.keys, q.values):
        mx.eval(packed, scales, biases)
        for j, a in enumerate((packed, scales, biases)):
            h = np.asarray(a)[0].view(np.uint8) if j == 0 else host_scales(a)[0]
            flat, stride = heads_view(h)
            views.append(flat)
            addrs.append(flat.ctypes.data)
            sizes.append(flat.size)
            strides.append(stride)
    return tuple(views), np.array(addrs, np.int64), np.array(sizes, np.int64), np.array(strides, np.int64)


def _kv_like(caches: list) -> np.ndarray:
    """The empty array whose dtype tells the kernels the caches' buffer element type."""
    return np.empty(0, KV_HOST[caches[0].full.keys.dtype])
