"""Sampling settings, stop handling, and the events a turn streams to its caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from cache.layers import position

from .events import TurnDone
from .sampling import HostSampler


@dataclass(frozen=True)
class GenerationSettings:
    temp: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 512
    repetition_penalty: float = 1.0
    ignore_eos: bool = False  # run to max_tokens: end-of-sequence tokens are never sampled

    @property
    def _top_p(self) -> float:
        # top_p of 1.0 means "off" to the samplers as 0.0 does
        return 0.0 if self.top_p >= 1.0 else self.top_p

    def sampler(self) -> Callable[[mx.array], mx.array]:
        """mlx-lm's sampler for these settings."""
        return make_sampler(temp=self.temp, top_p=self._top_p, min_p=self.min_p, top_k=self.top_k)

    def host_sampler(self) -> HostSampler:
        """The same rules in numpy, for logits in host memory (sampling.py)."""
        return HostSampler(self.temp, self._top_p, self.min_p, self.top_k, self.seed)

    def processors(self) -> list:
        if self.repetition_penalty and self.repetition_penalty != 1.0:
            return make_logits_processors(repetition_penalty=self.repetition_penalty)
        return []


def reply_end_ids(tokenizer, format_stop_ids: set[int]) -> set[int]:
    """The tokens that end a reply: the tokenizer's EOS, the prompt format's end of turn
    (``format_stop_ids``: <|im_end|> for chatml), and a BOS in the middle of a reply, which starts
    a new document (TinyStories models separate stories with it) rather than being shown as "<s>"."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or []) | set(format_stop_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and bos not in (getattr(tokenizer, "pad_token_id", None),):
        ids.add(bos)
    return ids


class TokenPicker:
    """The next token from a position's logits [1, vocab], as the generation settings say: end
    tokens banned under ignore_eos (as llama.cpp's --ignore-eos does, rather than generating and
    hiding them: a hidden token sits in the cache but not in the reply's text, so the next turn's
    rendering would stop matching the cache there), the logits processors (repetition penalty)
    over the recent tokens, then mlx-lm's sampler on the log-probabilities. ``observe``: what
    decode_tokens calls with each token fed, where processors need the history (else None).

    ``host``: the logits are in host memory and each step runs synchronously (the fused native
    step): with no processors, the same rules run in numpy (sampling.HostSampler), ~5 ms a token
    cheaper than MLX's CPU graph at the default settings."""

    def __init__(self, gen: GenerationSettings, eos_ids, recent: list[int], host: bool = False):
        if gen.seed is not None:
            mx.random.seed(gen.seed)
        self._sampler, self._processors = gen.sampler(), gen.processors()
        self._history = mx.array(recent[-64:]) if self._processors else None
        self._banned = sorted(eos_ids) if gen.ignore_eos else []
        self._ban = None
        self._host = gen.host_sampler() if host and not self._processors else None
        self.observe = self._observe if self._processors else None

    def __call__(self, lg: mx.array) -> mx.array:
        if self._host is not None:
            x = np.array(lg, dtype=np.float32).reshape(-1)
            x[self._banned] = -np.inf
            return mx.array([self._host(x)], dtype=mx.uint32)
        if self._banned:
            if self._ban is None:
                self._ban = mx.zeros((lg.shape[-1],), lg.dtype)
                self._ban[mx.array(self._banned)] = -mx.inf
            lg = lg + self._ban
        for p in self._processors:
            lg = p(self._history, lg)
        return self._sampler(lg - mx.logsumexp(lg, axis=-1, keepdims=True))

    def _observe(self, y: mx.array) -> None:
        self._history = mx.concatenate([self._history, y])


# ---- events a turn yields ---------------------------------------------------------------------
def run_turn(events) -> TurnDone | None:
    """Drain a turn's event stream and return its TurnDone (for callers that do not stream)."""
    done = None
    for ev in events:
        if isinstance(ev, TurnDone):
            done = ev
    return done


class StopMatcher:
    """Holds back text that could be the start of a stop string, so none is ever shown."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything accepted so far
        self.shown = 0  # how much of it has been released

    def feed(self, segment: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to show now, stopped)."""
        self.text += segment
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                return self._release(len(self.text)), True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._release(len(self.text) - hold), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return out


# ---- the token-level decode loop ----------------------------------------------------------------
def decode_tokens(model, caches: list, logits: mx.array, sample: Callable[[mx.array], mx.array], max_tokens: int,
                  *, cancelled: Callable[[], bool] = lambda: False,
                  observe: Callable[[mx.array], None] | None = None,
                  sync: bool = False) -> Iterator[tuple[int, bool, int]]:
    """Sample from ``logits``, then step the model one token at a time over ``caches``
    (as mlx-lm's ``generate_step`` sits under ``stream_generate``).

    Yields ``(token, fed, context)``: ``fed`` says the token goes into the caches (every one but
    the ``max_tokens``-th, whose successor is never needed), ``context`` the cache length a
    step attended over. The next step is scheduled before a token is handed out, so the model
    runs while the caller handles it. With ``sync`` (a native decode step, which runs inside
    the model call rather than lazily) that would hold each token back by a whole step, so the
    step runs when the caller asks for the next token instead: a token the caller stops at (an
    end token) never enters the caches. ``observe(y)`` sees each token fed back before the next
    sample (repetition penalties); the loop ends, before scheduling another step, once
    ``cancelled()``. The caller stops reading at an end token or stop string, and after a token
    that was not fed.
    """
    context = 0

    def step(y: mx.array) -> mx.array:
        nonlocal context
        context = position(caches) + 1
        nxt = model(y[None], cache=caches)[:, -1, :]
        if observe is not None:
            observe(y)
        y_next = sample(nxt)
        mx.async_eval(y_next)
        return y_next

    y = sample(logits)
    mx.async_eval(y)
    n = 0
    while not cancelled():
        fed = n + 1 < max_tokens
        if fed and not sync:
            y_next = step(y)  # runs while the caller handles this token
        yield y.item(), fed, context
        if not fed:
            return
        if sync:
            y_next = step(y)
        n += 1
        y = y_next
