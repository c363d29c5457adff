"""A tokenizer from a GGUF file's metadata, wrapped as mlx-lm's TokenizerWrapper.

Two vocabulary types are built, each as a Hugging Face ``tokenizers`` pipeline that reproduces
the reference tokenizer's ids exactly:

* ``gpt2``: byte-level BPE (``tokenizer.ggml.tokens`` + ``merges``), pre-tokenised as
  ``tokenizer.ggml.pre`` says (llama.cpp's names: ``gpt2``/``default``, ``smollm`` (digits one by
  one), ``llama-bpe`` (Llama 3)).
* ``llama``: SentencePiece BPE (tokens + scores + types, byte fallback), encoded as SentencePiece
  does (see :mod:`chatapp.model.spm_rules`).

Control tokens (type 3) are special tokens (parsed out of template text, never split);
user-defined ones (type 4) are added tokens. BOS/EOS and whether BOS is added come from the file;
so does the chat template (``tokenizer.chat_template``).
"""

from __future__ import annotations

from typing import Any

from .gguf_file import GGUFError, GGUFHeader
from .spm_rules import SPM_WORDS, score_ordered_merges
from .tokenizer_cache import cached_tokenizer_path, from_file, save

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokeniser names -> the split regex run before byte-level BPE (None: GPT-2's own,
# which ByteLevel(use_regex=True) applies), and whether digits are split one by one first.
_GPT2 = None
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2/2.5/3: Llama 3's split with digits one at a time
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    # name: (split regex, digits one by one, ignore_merges)
    "default": (_GPT2, False, False),
    "gpt2": (_GPT2, False, False),
    "gpt-2": (_GPT2, False, False),
    "smollm": (_GPT2, True, False),
    "llama-bpe": (_LLAMA3, False, True),
    "llama3": (_LLAMA3, False, True),
    "qwen2": (_QWEN2, False, False),
}
VOCAB_TYPES = ("gpt2", "llama")


def vocab_summary(header: GGUFHeader) -> str:
    """'gpt2 (pre smollm), 49152 tokens': for the notes and --show-config."""
    kind = header.get("tokenizer.ggml.model", "?")
    pre = header.get("tokenizer.ggml.pre")
    n = len(header.get("tokenizer.ggml.tokens") or [])
    return f"{kind}{f' (pre {pre})' if pre else ''}, {n} tokens"


def check_vocabulary(header: GGUFHeader, where: str) -> None:
    """GGUFError (one line) when the file's vocabulary cannot be built; nothing is built."""
    kind = header.get("tokenizer.ggml.model")
    if kind is None or not header.get("tokenizer.ggml.tokens"):
        raise GGUFError(f"{where} holds no vocabulary (tokenizer.ggml.model/tokens): chatapp needs the tokenizer "
                        "in the file")
    if kind not in VOCAB_TYPES:
        raise GGUFError(f"{where} has a {kind!r} vocabulary, which chatapp cannot build: it builds "
                        "gpt2 (byte-level BPE) and llama (SentencePiece) vocabularies")
    if kind == "gpt2":
        pre = header.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{where} asks for the pre-tokenizer {pre!r}, which chatapp does not know: it knows "
                            f"{', '.join(PRE_TOKENIZERS)}")
        if not header.get("tokenizer.ggml.merges"):
            raise GGUFError(f"{where} has a gpt2 vocabulary without merges (tokenizer.ggml.merges)")
    elif not header.get("tokenizer.ggml.scores"):
        raise GGUFError(f"{where} has a llama vocabulary without scores (tokenizer.ggml.scores)")


def _token(tokens: list[str], header: GGUFHeader, key: str) -> str | None:
    i = header.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _types(header: GGUFHeader, n: int) -> list[int]:
    types = list(header.get("tokenizer.ggml.token_type") or [])
    return types + [NORMAL] * (n - len(types))


def _gpt2_backend(header: GGUFHeader):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(header.get("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in header.get("tokenizer.ggml.merges")]
    split, digits, ignore_merges = PRE_TOKENIZERS[header.get("tokenizer.ggml.pre", "default")]
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False,
                       ignore_merges=ignore_merges)
    backend = Tokenizer(model)
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    backend.decoder = decoders.ByteLevel()
    return backend, tokens


def _llama_backend(header: GGUFHeader):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = list(header.get("tokenizer.ggml.tokens"))
    scores = list(header.get("tokenizer.ggml.scores"))
    types = _types(header, len(tokens))
    normal = {t: (i, float(scores[i])) for i, t in enumerate(tokens) if types[i] == NORMAL}
    unk = _token(tokens, header, "unknown") or next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    model = models.BPE({t: i for i, t in enumerate(tokens)}, score_ordered_merges(normal), unk_token=unk,
                       fuse_unk=True, byte_fallback=any(k == BYTE for k in types))
    backend = Tokenizer(model)
    steps = []
    if header.get("tokenizer.ggml.remove_extra_whitespaces", False):
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if header.get("tokenizer.ggml.add_space_prefix", True):
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    # Llama's SentencePiece models split at whitespace and keep runs of spaces as pieces
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(SPM_WORDS[True]), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return backend, tokens


def build_tokenizer(header: GGUFHeader, where: str) -> Any:
    """mlx-lm's TokenizerWrapper over a fast tokenizer built from the file's metadata, or read
    from chatapp's cache where this vocabulary was built before (tokenizer_cache.py)."""
    check_vocabulary(header, where)
    from mlx_lm import tokenizer_utils as tu
    from transformers import PreTrainedTokenizerFast

    kind = header.get("tokenizer.ggml.model")
    tokens = header.get("tokenizer.ggml.tokens")
    bos, eos = _token(tokens, header, "bos"), _token(tokens, header, "eos")
    add_bos = bool(header.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(header.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    options = dict(bos_token=bos, eos_token=eos, unk_token=_token(tokens, header, "unknown"),
                   pad_token=_token(tokens, header, "padding"), chat_template=header.get("tokenizer.chat_template"),
                   add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    cached = cached_tokenizer_path(header)
    fast = from_file(cached, PreTrainedTokenizerFast, **options)
    if fast is None:
        backend = _pipeline(header, where, kind, bos if add_bos else None, eos if add_eos else None)
        if save(backend, cached):
            fast = from_file(cached, PreTrainedTokenizerFast, **options)
        if fast is None:
            fast = PreTrainedTokenizerFast(tokenizer_object=backend, **options)
    eos_ids = [int(header.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")
               if header.get(f"tokenizer.ggml.{k}_token_id") is not None]
    detok = tu.BPEStreamingDetokenizer if kind == "gpt2" else tu.SPMStreamingDetokenizer
    # the wrapper asks for the whole vocabulary twice as a new dict (0.31 s each for Gemma 3's
    # 262k pieces): once is enough while it is made
    vocab = fast.get_vocab()
    fast.get_vocab = lambda: vocab
    try:
        return tu.TokenizerWrapper(fast, detok, eos_token_ids=eos_ids)
    finally:
        del fast.get_vocab


def _pipeline(header: GGUFHeader, where: str, kind: str, bos: str | None, eos: str | None) -> Any:
    """The ``tokenizers`` pipeline of the file's vocabulary, its control and user-defined
    tokens, and the BOS / EOS it adds (None: not added)."""
    from tokenizers import AddedToken, processors

    try:
        backend, tokens = _gpt2_backend(header) if kind == "gpt2" else _llama_backend(header)
    except Exception as err:  # noqa: BLE001 - a vocabulary the tokenizers library rejects
        raise GGUFError(f"{where}: its {kind} vocabulary cannot be built ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''})") from err
    types = _types(header, len(tokens))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    if bos or eos:
        specials = [(t, tokens.index(t)) for t in {bos, eos} if t]
        backend.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    return backend
