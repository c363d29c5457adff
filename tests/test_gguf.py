"""GGUF files: tensor mapping (q/k permutation, packed quants, tied output), validation and the
one-line refusals, and how a --model spec finds its file (a file, a folder, a hub repo)."""

from __future__ import annotations

import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from chatapp.model.gguf import load_gguf
from chatapp.model.gguf_file import GGUFError, read_header
from chatapp.model.gguf_writer import F16, F32, Q4_0, Q4_1, Q8_0, nbytes_of, write_gguf, write_tensors
from tests.gguf_models import metadata, random_llama, write_model_gguf

PROMPT = mx.array([[5, 80, 120, 7, 33, 200, 9, 14, 99, 3, 64, 250]])


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))


@pytest.fixture(scope="module")
def reference():
    return random_llama(seed=1)


def test_undoing_llama_cpp_permutation_gives_the_unpermuted_models_logits(reference, tmp_path):
    write_model_gguf(tmp_path / "permuted.gguf", reference, permute=True)
    loaded = load_gguf(tmp_path / "permuted.gguf")
    assert loaded.config["rope_traditional"] is False
    np.testing.assert_allclose(logits(loaded.model), logits(reference), atol=2e-4, rtol=1e-4)
    # the check can fail: a file whose rows were never permuted comes out wrong (pairs mixed up)
    write_model_gguf(tmp_path / "plain.gguf", reference, permute=False)
    wrong = logits(load_gguf(tmp_path / "plain.gguf").model)
    assert np.abs(wrong - logits(reference)).max() > 0.1


@pytest.mark.parametrize("matrices,embedding", [(Q4_1, Q8_0), (Q4_0, F16), (Q8_0, Q4_1)])
def test_block_quants_stay_packed_and_compute_what_they_stand_for(reference, matrices, embedding, tmp_path):
    path = tmp_path / "q.gguf"
    values = write_model_gguf(path, reference, matrices=matrices, embedding=embedding)
    g = load_gguf(path)
    bits = {Q4_0: 4, Q4_1: 4, Q8_0: 8}
    q = g.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and q.bits == bits[matrices] and q.group_size == 32
    assert q.weight.dtype == mx.uint32  # packed: no float copy of a quantised weight
    emb = g.model.model.embed_tokens
    if embedding == F16:
        assert isinstance(emb, nn.Embedding) and emb.weight.dtype == mx.float16
    else:
        assert isinstance(emb, nn.QuantizedEmbedding) and emb.bits == bits[embedding]
    # a float model holding the values the blocks stand for gives the same logits
    dense = random_llama(seed=1)
    dense.update(tree_unflatten([(k, mx.array(v)) for k, v in values.items()]))
    got, want = logits(g.model), logits(dense)
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert f"{'Q4_0' if matrices == Q4_0 else 'Q4_1' if matrices == Q4_1 else 'Q8_0'} x" in g.notes[1]


def test_output_tensor_is_used_when_present_else_the_embedding_is_tied(tmp_path):
    untied = random_llama(seed=2, tied=False)
    write_model_gguf(tmp_path / "untied.gguf", untied)
    g = load_gguf(tmp_path / "untied.gguf")
    assert g.config["tie_word_embeddings"] is False and hasattr(g.model, "lm_head")
    np.testing.assert_allclose(logits(g.model), logits(untied), atol=2e-4, rtol=1e-4)
    assert "tied" not in g.notes[2]


def test_tokenizer_chat_template_and_eos_come_from_the_metadata(reference, tmp_path):
    write_model_gguf(tmp_path / "m.gguf", reference)
    tok = load_gguf(tmp_path / "m.gguf").tokenizer
    assert tok.encode("a t", add_special_tokens=False) == [tok.convert_tokens_to_ids("a"), 256]  # "Ġt" merged
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 257 and ids.count(258) == 1 and tok.eos_token_ids == {258}
    assert tok.decode(ids) == text


# ---- refusals: one line each ------------------------------------------------------------------------
def _tiny(tmp_path, name="t.gguf", meta=None, kind=F32):
    path = tmp_path / name
    if kind in (F32, F16, Q4_0, Q4_1, Q8_0):
        write_tensors(path, meta or metadata(), [("token_embd.weight", np.zeros((259, 256), np.float32), kind)])
    else:  # a type the writer cannot make: blocks of zeros of the right size
        shape = (256, 259)
        write_gguf(path, meta or metadata(), [("token_embd.weight", shape, kind)], [bytes(nbytes_of(shape, kind))])
    return path


def _refusal(path) -> str:
    with pytest.raises(GGUFError) as err:
        load_gguf(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_truncated_and_corrupt_files_are_refused(reference, tmp_path):
    good = tmp_path / "good.gguf"
    write_model_gguf(good, reference)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert "is truncated" in _refusal(cut)
    (tmp_path / "head.gguf").write_bytes(data[:300])
    assert "truncated" in _refusal(tmp_path / "head.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    assert "is not a GGUF file" in _refusal(tmp_path / "junk.gguf")
    bad_count = bytearray(data)
    bad_count[16:24] = struct.pack("<Q", 1 << 60)  # the metadata count
    (tmp_path / "count.gguf").write_bytes(bytes(bad_count))
    assert "is corrupt" in _refusal(tmp_path / "count.gguf")
    # inside the vocabulary (an array of strings, read by its own loop): cut mid-way, and one
    # string's length past the file
    tokens = data.index(b"tokenizer.ggml.tokens")
    (tmp_path / "vocab.gguf").write_bytes(data[:tokens + 200])
    assert "is truncated" in _refusal(tmp_path / "vocab.gguf")
    first = tokens + len("tokenizer.ggml.tokens") + 4 + 4 + 8  # value type, element type, count
    bad_string = bytearray(data)
    bad_string[first:first + 8] = struct.pack("<Q", 1 << 40)
    (tmp_path / "string.gguf").write_bytes(bytes(bad_string))
    assert "is corrupt (a string length count" in _refusal(tmp_path / "string.gguf")


def test_unsupported_architecture_types_and_vocabularies_are_refused(tmp_path):
    msg = _refusal(_tiny(tmp_path, "arch.gguf", metadata(arch="mamba")))
    assert "unsupported GGUF architecture 'mamba'" in msg and "llama" in msg and "gemma3" in msg
    msg = _refusal(_tiny(tmp_path, "k.gguf", kind=23))  # IQ4_XS
    assert "IQ4_XS (1 tensors)" in msg and "Q4_0, Q4_1, Q8_0" in msg and "Q4_K" in msg
    msg = _refusal(_tiny(tmp_path, "bert.gguf", metadata(**{"tokenizer.ggml.model": "bert"})))
    assert "'bert' vocabulary" in msg and "gpt2" in msg and "llama" in msg
    msg = _refusal(_tiny(tmp_path, "pre.gguf", metadata(**{"tokenizer.ggml.pre": "deepseek-coder"})))
    assert "pre-tokenizer 'deepseek-coder'" in msg and "smollm" in msg


def test_header_reader_counts_types(reference, tmp_path):
    write_model_gguf(tmp_path / "m.gguf", reference, matrices=Q4_1, embedding=Q8_0)
    h = read_header(tmp_path / "m.gguf")
    assert h.type_counts == {"Q8_0": 1, "Q4_1": 14, "F32": 5} and h.types_line().startswith("Q4_1 x14")


# --- reading tensors one at a time (chatapp.model.gguf_tensors) against mx.load ----------------


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype.size == 2 else a.view(mx.uint8))


@pytest.mark.parametrize("matrices,embedding", [(Q4_1, Q8_0), (Q4_0, F16), (Q8_0, Q4_1), (F16, Q4_0)])
def test_tensors_read_one_at_a_time_are_mx_loads_bit_for_bit(reference, matrices, embedding, tmp_path,
                                                             monkeypatch):
    """Same names, shapes, dtypes and bits as mx.load followed by the q/k un-permutation, for every
    type the reader takes, also when a tensor spans several read chunks."""
    pytest.importorskip("numba")
    import chatapp.model.gguf_tensors as gt
    from chatapp.model.gguf import config_from_header, map_weights, open_gguf, row_orders

    path = tmp_path / "m.gguf"
    write_model_gguf(path, reference, matrices=matrices, embedding=embedding)
    header = open_gguf(path)
    config = config_from_header(header)
    want = map_weights(mx.load(str(path)), config)
    monkeypatch.setattr(gt, "CHUNK_BYTES", 64)  # a few rows a chunk: the chunk seams are exercised
    got = map_weights(gt.read_tensors(header, row_orders(header, config)), config, unpermuted=True)
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        b = got[name]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        np.testing.assert_array_equal(_bits(b), _bits(a), err_msg=name)


def test_files_that_cannot_be_mapped_are_read_instead(reference, tmp_path, monkeypatch):
    """Where the file system refuses mmap (some network and FUSE mounts), the chunks are read with
    pread: the same arrays, bit for bit."""
    pytest.importorskip("numba")
    import mmap

    import chatapp.model.gguf_tensors as gt
    from chatapp.model.gguf import config_from_header, open_gguf, row_orders

    path = tmp_path / "m.gguf"
    write_model_gguf(path, reference, matrices=Q4_0, embedding=Q8_0)
    header = open_gguf(path)
    orders = row_orders(header, config_from_header(header))
    mapped = gt.read_tensors(header, orders)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    read = gt.read_tensors(header, orders)
    assert sorted(read) == sorted(mapped)
    for name, a in mapped.items():
        np.testing.assert_array_equal(_bits(read[name]), _bits(a), err_msg=name)


def test_the_loaders_two_routes_give_the_same_model(reference, tmp_path, monkeypatch):
    """load_gguf with numba (one tensor at a time) and without it (mx.load) load the same parameters."""
    pytest.importorskip("numba")
    from mlx.utils import tree_flatten

    import chatapp.model.gguf_tensors as gt

    path = tmp_path / "m.gguf"
    write_model_gguf(path, reference, matrices=Q4_0, embedding=Q8_0)
    direct = dict(tree_flatten(load_gguf(path).model.parameters()))
    monkeypatch.setattr(gt, "can_read", lambda: False)
    mapped = dict(tree_flatten(load_gguf(path).model.parameters()))
    assert sorted(direct) == sorted(mapped)
    for name, a in mapped.items():
        np.testing.assert_array_equal(_bits(direct[name]), _bits(a), err_msg=name)


def test_scale_times_minus_a_power_of_two_rounds_as_float32_to_float16_does():
    """MLX's Q4_0/Q8_0 biases (-8 and -128 x the float16 scale), computed on the half bits, for all
    65,536 of them: subnormals, overflow to infinity, infinities and NaNs included."""
    pytest.importorskip("numba")
    from numba import njit

    from chatapp.kernels.gguf_blocks import times_minus_pow2

    @njit
    def every(h, k, out):
        for i in range(h.shape[0]):
            out[i] = times_minus_pow2(np.int64(h[i]), k)

    h = np.arange(1 << 16, dtype=np.uint16)
    for k in (3, 7):
        got = np.empty_like(h)
        every(h, k, got)
        with np.errstate(all="ignore"):
            want = (h.view(np.float16).astype(np.float32) * np.float32(-(2**k))).astype(np.float16).view(np.uint16)
        np.testing.assert_array_equal(got, want)
