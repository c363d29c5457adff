"""The session manager: one conversation, its per-layer caches, and the policy across turns.

Each turn renders the whole conversation, compares the token ids with those the cache
already represents, trims the cache back to the common prefix and prefills only the rest. So a
new turn costs its new tokens, and regenerate / edit-last-message cost only what changed (the rule
is engine/reuse.py).

Everything here runs on one thread (MLX streams belong to threads); ``cancel()`` is the one
method meant to be called from another thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Iterator

import mlx.core as mx

from cache import (
    CacheConfigError,
    CacheSettings,
    convert_caches,
    make_caches,
    model_geometry,
    reserve_tokens,
)
from cache.layers import is_ours, settle, uniform
from cache.settings import AUTO, AUTO_STARTS_AS, DIALOG_KNOBS, knob_values, starting_mode
from chatapp.backend.fused_install import steps_synchronously
from chatapp.backend.qlinear import last_position_only
from chatapp.prompt.conversation import Conversation, Message, common_prefix
from chatapp.prompt.formats import PromptFormat
from chatapp.prompt.render_match import render_as_generated

from .cache_view import session_view
from .events import Admission, PrefillProgress, SessionInfo, Switched, TokenEvent, TurnDone
from .generate import GenerationSettings, StopMatcher, TokenPicker, decode_tokens, reply_end_ids
from .memory import read_gauges
from .prefix import PrefixSource, warm_start
from .reuse import trim_to_prompt
from .route import decode_route
from .stats import CacheView, StepStat, TurnStats

FULL_PREFILL_STEP = 512  # prefill chunk for caches that never evict
LIVE_VIEW_EVERY = 8  # tokens between cache measurements while a reply streams


class Session:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        cache_settings: CacheSettings | None = None,
        mode: str = AUTO,
        long_after: int = 2048,
        generation: GenerationSettings | None = None,
        system: str = "",
        raw: bool = False,
        prompt_format: PromptFormat | None = None,
        format_choice=None,
        model_id: str = "",
        cancel: threading.Event | None = None,
        notices: list[str] | None = None,
        gauges: bool = True,
        eos_ids: set[int] | None = None,
    ):
        """``format_choice`` (prompt.choice.FormatChoice) says which format and why; ``cancel`` is
        the event that stops a running reply (a copy of the session may share its owner's);
        ``notices`` are load-time lines for the user (a GGUF's conversions, the CPU plan);
        ``gauges=False`` skips MLX's memory gauges during turns (benchmarks price them);
        ``eos_ids`` replaces the tokens that end a reply (None: the tokenizer's and the format's;
        an empty set: none, for benchmarks that decode a fixed length)."""
        self.model = model
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.geometry = model_geometry(model)
        self.base_settings = cache_settings or CacheSettings()
        self.requested_mode = mode
        self.long_after = long_after
        self.generation = generation or GenerationSettings()
        # The prompt format (prompt.formats); None: the tokenizer's template, else plain (raw: --raw).
        self.format = prompt_format or PromptFormat.for_tokenizer(tokenizer, raw=raw)
        self.format_choice = format_choice  # prompt.choice.FormatChoice: which format and why, when chosen
        self.conversation = Conversation.start(system)
        self.notices: list[str] = []
        self.history: list[TurnStats] = []  # every finished turn, for comparisons and plots
        self._cancel = cancel if cancel is not None else threading.Event()
        self._first_visible = 0
        self._sparsity: float | None = None  # the last full view's attention sparsity
        # Leading tokens (the system prompt) the evicting modes never evict.
        self.pinned = self._system_tokens()
        self.settings = self._settings_for(starting_mode(mode))
        self.notices.extend(notices or [])  # after the settings' own notes, as they came before
        self.caches = make_caches(model, self.settings, self.geometry)
        self.cached: list[int] = []  # token ids the caches represent, evicted ones included
        # True while the caches hold every token as a full-precision prefill from empty would
        # (no lossy conversion since they were filled); the prefix store only keeps such K/V.
        self.kv_exact = True
        self.reprefill_reason = ""  # why the last turn could not reuse the caches (mixed layer kinds)
        self.restored = 0  # leading cached tokens a restore (prefix store, snapshot) put in (cache_map)
        self.prefix_source: PrefixSource | None = None  # the prefix store, when one is attached
        self.gauges = gauges  # read MLX's memory gauges during turns (benchmarks turn it off to price them)
        # Tokens that end a reply (generate.reply_end_ids), unless the caller names them.
        self.eos_ids = set(eos_ids) if eos_ids is not None else reply_end_ids(tokenizer, self.format.stop_token_ids)

    # ---- settings and modes -------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.settings.mode

    def _settings_for(self, mode: str, **changes) -> CacheSettings:
        settings = self.base_settings.with_(mode=mode, **changes).pinning(self.pinned)
        settings, notes = settings.fitted(self.geometry.max_positions)
        self.notices.extend(n for n in notes if n not in self.notices)
        return settings

    def _long_mode(self) -> str:
        """The policy for long conversations: window-quant, or window where KV cannot be quantised."""
        try:
            from cache import check_settings

            check_settings(self._settings_for("window-quant"), self.geometry)
            return "window-quant"
        except CacheConfigError as e:
            note = f"auto policy uses window instead of window-quant: {e}"
            if note not in self.notices:
                self.notices.append(note)
            return "window"

    def switch_mode(self, mode: str, **changes) -> Switched:
        """Switch the cache mode (and settings) now: convert the live cache, or re-prefill.
        A request of its own for a front end that drives the Session directly (``--no-tui``'s
        ``/mode``, the benches): it starts with a clear cancel flag, then :meth:`switch`."""
        self.start_request()
        return self.switch(mode, **changes)

    def switch(self, mode: str, **changes) -> Switched:
        """Switch the cache mode within a request already running, keeping its cancel flag: the
        engine worker's ``SwitchMode`` (the worker cleared the flag as the request began), a turn's
        auto policy, a restore. The report (:class:`Switched`) is the worker's event too, once it
        adds the session's description (``info``)."""
        if mode == AUTO:
            target = self._long_mode() if len(self.cached) > self.long_after else AUTO_STARTS_AS
        else:
            target = mode
        base = self.base_settings.with_(**changes) if changes else self.base_settings
        settings, notes = base.with_(mode=target).pinning(self.pinned).fitted(self.geometry.max_positions)
        start = time.perf_counter()
        conv = convert_caches(self.caches, self.model, settings)  # raises CacheConfigError first
        self.caches, self.settings = conv.caches, settings
        self.base_settings, self.requested_mode = base, mode
        self.notices.extend(n for n in notes if n not in self.notices)
        self.kv_exact = self.kv_exact and not conv.lossy
        if conv.action == "reprefill":
            tokens, self.cached = self.cached, []
            self.kv_exact, self.restored = True, 0
            if tokens:
                self.prefill(tokens)
            if len(self.cached) < len(tokens):  # cancelled between two chunks; the caches hold what ran
                reason = (f"cancelled after {len(self.cached)} of {len(tokens)} tokens; "
                          "the next turn prefills the rest")
                return Switched(target, "stopped", reason, time.perf_counter() - start, notes)
            return Switched(target, "reprefilled", conv.reason, time.perf_counter() - start, notes)
        return Switched(target, conv.action, conv.reason, time.perf_counter() - start, notes)

    def _apply_policy(self, upcoming: int) -> Switched | None:
        """Auto mode: AUTO_STARTS_AS while short, the long-history policy once past ``long_after``."""
        if self.requested_mode != AUTO or self.settings.evicts or upcoming <= self.long_after:
            return None
        report = self.switch(AUTO)
        self.requested_mode = AUTO
        return report

    def _system_tokens(self) -> int:
        """Tokens of the system prompt that opens the conversation (0 when there is none)."""
        msgs = self.conversation.messages
        if not msgs or msgs[0].role != "system" or not msgs[0].content:
            return 0
        return len(self.format.tokens(Conversation(msgs[:1]), generation_prompt=False))

    def pin_system_prompt(self) -> None:
        """Pin the system prompt in the evicting caches (CacheSettings.pinning): applied to the
        settings at once, and to the caches while they are empty (a new conversation)."""
        n = self._system_tokens()
        if n == self.pinned:
            return
        self.pinned = n
        if not self.cached:
            self.settings = self._settings_for(self.settings.mode)
            self._reset_caches()

    def _prefill_step(self) -> int:
        return self.settings.evict_chunk if self.settings.evicts else FULL_PREFILL_STEP

    # ---- conversation operations ----------------------------------------------------------------
    def admit(self, text: str) -> Admission:
        """The policy for a user message before it is sent: one that would take the conversation
        past the model's trained context is refused when the cache mode keeps every token, or
        (auto mode) makes the session take its long-history policy now; one longer than an
        evicting cache keeps gets a note saying what the model will see. Nothing is ever cut
        silently. ``text`` is not added to the conversation."""
        notes: list[str] = []
        conv = self.conversation.copy()
        conv.add("user", text)
        try:
            total = len(self.format.tokens(conv))
        except Exception as e:  # noqa: BLE001 - e.g. a chat template that refuses the order of roles
            reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            return Admission(False, f"message not sent: the chat template refuses the conversation ({reason})")
        max_pos = self.geometry.max_positions
        if max_pos and total > max_pos and self.settings.budget is None:
            report = self.use_long_policy()
            if report is None:
                return Admission(False, (
                    f"message not sent: with it the conversation is {total} tokens, more than the model's "
                    f"context of {max_pos}, and cache mode {self.mode} keeps every token "
                    "(use --cache-mode window, window-quant or auto)"))
            notes.append(f"the conversation ({total} tokens) is longer than the model's context ({max_pos}): "
                         f"{report.line()}")
        if self.settings.budget is not None:
            messages = self.conversation.messages
            before = len(self.format.tokens(self.conversation, generation_prompt=False)) if messages else 0
            own = total - before
            keep = self.settings.budget
            if own > keep:
                notes.append(
                    f"this message is about {own} tokens, more than the {keep} the {self.mode} cache keeps: "
                    f"the model will see the first {self.settings.sinks} tokens of the conversation and the "
                    f"last {keep - self.settings.sinks} (the whole message is kept in the transcript)")
        return Admission(True, "", notes)

    def send(self, text: str) -> Iterator:
        self.conversation.add("user", text)
        return self.reply()

    def regenerate(self) -> Iterator:
        if self.conversation.last and self.conversation.last.role == "assistant":
            self.conversation.messages.pop()
        return self.reply()

    def edit_last(self, text: str) -> Iterator:
        i = self.conversation.last_index("user")
        if i is None:
            raise ValueError("there is no user message to edit")
        del self.conversation.messages[i + 1 :]
        self.conversation.messages[i].content = text
        return self.reply()

    def new_chat(self, system: str | None = None) -> None:
        keep = system if system is not None else next(
            (m.content for m in self.conversation.messages if m.role == "system"), "")
        self.conversation = Conversation.start(keep)
        self.cached = []
        self.pin_system_prompt()
        self._reset_caches()

    def load_conversation(self, conversation: Conversation) -> None:
        """Make ``conversation`` the session's (a saved one, a prepared history). The caches are
        left as they are: the next turn keeps what they share with it and prefills the rest."""
        self.conversation = conversation

    def set_system(self, text: str) -> tuple[list[int], int]:
        """Make ``text`` the conversation's system prompt ("" removes it) and empty the caches.

        Every later token attends to the system prompt, so the caches could keep only the
        template's first few tokens; empty caches let the next turn warm-start from the prefix
        store when this system prompt was used before. Returns the tokens the next turn prefills
        (none when the system prompt is all there is) and how many leading ones the old caches shared.
        """
        conv = self.conversation.copy()
        msgs = conv.messages
        if msgs and msgs[0].role == "system":
            if text:
                msgs[0].content = text
            else:
                del msgs[0]
        elif text:
            msgs.insert(0, Message("system", text))
        tokens = self.format.tokens(conv, generation_prompt=False) if len(msgs) > (1 if text else 0) else []
        kept = common_prefix(self.cached, tokens)
        self.conversation = conv
        self._reset_caches()
        self.pin_system_prompt()  # the caches are empty: the new system prompt is pinned at once
        return tokens, kept

    def keep_interrupted(self, text: str, seq: int) -> None:
        """A reply abandoned mid-way (its reader stopped): keep ``text``, what was shown of it, as
        an interrupted reply at message ``seq``, unless the conversation already moved on."""
        if text and len(self.conversation.messages) == seq:
            self.conversation.add("assistant", text, interrupted=True)

    def attach_prefixes(self, source: PrefixSource | None) -> None:
        """Take the stored prefixes of ``source`` (the prefix store) when a turn starts from empty caches."""
        self.prefix_source = source

    def set_generation(self, **changes) -> None:
        """Change sampling settings (temp, top_p, seed, max_tokens, ...) from the next turn on."""
        self.generation = dataclasses.replace(self.generation, **changes)

    def _reset_caches(self) -> None:
        self.cached, self.restored = [], 0
        self.caches = make_caches(self.model, self.settings, self.geometry)
        self.kv_exact = True

    def cancel(self) -> None:
        """Stop the running reply between two tokens (safe from any thread)."""
        self._cancel.set()

    def start_request(self) -> None:
        """A request that runs model work starts: forget a cancel meant for an earlier one.

        A cancel stops what runs when it is set; one that arrives as a reply ends (Esc after the
        last token, or a reply cancelled with a mode switch queued behind it) must not stop the
        next request. :meth:`reply` and :meth:`switch_mode` call it, for front ends that drive a
        Session directly (``--no-tui``'s ``/mode``, the benches); the engine worker, which builds
        its sessions on its own cancel flag, clears that flag before every request itself."""
        self._cancel.clear()

    @property
    def cancel_token(self):
        """The event that stops this session's replies (given at construction, or its own)."""
        return self._cancel

    # ---- one turn -----------------------------------------------------------------------------
    def reply(self) -> Iterator[PrefillProgress | TokenEvent | TurnDone]:
        """Generate the assistant's reply to the conversation as it stands, streaming events."""
        self.start_request()
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        prompt = self.format.tokens(self.conversation)
        if not self.cached:
            self.pin_system_prompt()
        stats = TurnStats(prompt_tokens=len(prompt))
        warm_start(self, prompt, stats)  # empty caches: take what the prefix store holds of the prompt
        switch = self._apply_policy(len(prompt))
        if switch:
            stats.notices.append(switch.line())
        if self.settings.budget is None and self.geometry.max_positions and len(prompt) > self.geometry.max_positions:
            stats.notices.append(
                f"the conversation ({len(prompt)} tokens) is longer than the model's trained context "
                f"({self.geometry.max_positions}); {self.mode} keeps every token, so quality will degrade: "
                "use window or window-quant (or auto) to keep positions inside it"
            )
        stats.mode = self.mode
        self.reprefill_reason = ""
        reuse = self._reuse(prompt)
        if self.reprefill_reason:
            stats.notices.append(self.reprefill_reason)
        stats.reused_tokens = reuse
        rest = prompt[reuse:]
        stats.prefill_tokens = len(rest)
        self._reserve(len(rest))
        t_prefill = time.perf_counter()
        logits = None
        for item in self._prefill(rest, stats, step=self._prefill_step()):
            if isinstance(item, PrefillProgress):
                yield item
            else:
                logits = item
            if self._cancel.is_set():
                break
        stats.prefill_seconds = time.perf_counter() - t_prefill
        if logits is None:  # cancelled during prefill
            stats.finish = "cancelled"
            self._finish(stats, t0, "", interrupted=True)
            yield TurnDone("", stats)
            return
        self._reserve(0)  # a first turn's caches had no rows to reserve from before its prefill
        yield from self.decode(logits, stats, t0)

    def _reserve(self, prefill: int) -> None:
        """Room in the caches for this turn's prefill and a whole reply before the turn starts
        (within the trained context): a cache that grows mid-reply stalls the stream while it
        copies every row held (SegmentedKVCache.reserve); here that wait joins the prefill's.
        Caches without rows yet reserve nothing: a first turn calls this again after its prefill."""
        ahead = self.generation.max_tokens
        if self.geometry.max_positions:
            ahead = max(0, min(ahead, self.geometry.max_positions - len(self.cached) - prefill))
        if reserve_tokens(self.caches, prefill + ahead):
            mx.clear_cache()  # the old buffers: no cache of this size will take them again soon

    def _reuse(self, prompt: list[int]) -> int:
        """Trim the caches back to the longest prefix they share with ``prompt`` (engine/reuse.py);
        return its length (0: they start over, and ``reprefill_reason`` may say why)."""
        sinks = self.settings.sinks if self.settings.evicts else 0
        reuse = trim_to_prompt(self.caches, self.cached, prompt, sinks)
        if reuse.restart:
            self.reprefill_reason = reuse.reason
            self._reset_caches()
            return 0
        if len(self.cached) > reuse.tokens:
            del self.cached[reuse.tokens:]
            self.restored = min(self.restored, reuse.tokens)
        return reuse.tokens

    def prefill(self, tokens: list[int]) -> mx.array | None:
        """Run ``tokens`` into the caches after what they hold (in the mode's chunks, untimed, no
        events); returns the logits of the last position (None for no tokens)."""
        logits = None
        for item in self._prefill(tokens, TurnStats(), step=self._prefill_step()):
            if not isinstance(item, PrefillProgress):
                logits = item
        return logits

    def _prefill(self, tokens: list[int], stats: TurnStats, step: int):
        """Run ``tokens`` through the model in chunks; yields progress, then the last logits."""
        done = 0
        logits = None
        while done < len(tokens):
            chunk = tokens[done : done + step]
            with last_position_only():  # only logits[:, -1] is read: the CPU head skips the rest
                out = self.model(mx.array([chunk]), cache=self.caches)
            done += len(chunk)
            self.cached.extend(chunk)
            if done < len(tokens):
                # the chunk's pending writes; our caches' buffers as they are (their ``state``
                # would hand out views, keeping the next flush off the in-place route)
                mx.eval([c.buffers() if is_ours(c) else c.state for c in self.caches])
                if self.gauges:
                    stats.cache = self.cache_view(scan_messages=False)
                    self._read_memory(stats)
                yield PrefillProgress(done, len(tokens), stats)
                if self._cancel.is_set():
                    return
            else:
                logits = out[:, -1, :]
                mx.eval(logits)
        if logits is not None:
            yield logits

    def decode(self, logits: mx.array, stats: TurnStats, t0: float) -> Iterator[TokenEvent | TurnDone]:
        """The text-level decode: the reply from ``logits`` (the prompt's last position) as
        TokenEvents, then TurnDone; the token loop underneath is :func:`generate.decode_tokens`.
        ``t0`` is when the turn started (TTFT counts from it)."""
        gen = self.generation
        # A native decode step (backend.fused_decode) runs inside the model call rather than
        # lazily: scheduled before a token is read, it would hold that token back by one step.
        # Its logits are host memory, so the token is picked there too (sampling.py).
        sync = steps_synchronously(self.model)
        pick = TokenPicker(gen, self.eos_ids, self.cached, host=sync)
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(list(self.format.stop_strings))
        n, finish = 0, "length"
        t_last = None
        steps = decode_tokens(self.model, self.caches, logits, pick, gen.max_tokens, sync=sync,
                              cancelled=self._cancel.is_set, observe=pick.observe)
        for tok, fed, context in steps:
            now = time.perf_counter()
            if fed and not sync:
                self.cached.append(tok)
            if n == 0:
                stats.ttft = now - t0
            elif t_last is not None:
                stats.steps.append(StepStat(context, (now - t_last) * 1000))
            t_last = now
            if tok in self.eos_ids:
                finish = "eos"
                break
            detok.add_token(tok)
            n += 1
            stats.generated_tokens = n
            stats.decode_seconds = now - t0 - stats.ttft
            shown, stopped = stops.feed(detok.last_segment)
            if n % LIVE_VIEW_EVERY == 1:
                stats.cache = self.cache_view(scan_messages=False)
                self._read_memory(stats)
            yield TokenEvent(shown, tok, stats)
            if stopped:
                finish = "stop"
                break
            if not fed:
                break
            if sync:
                self.cached.append(tok)  # fed as the loop asks for the next one (an end token never is)
        else:
            finish = "cancelled"  # decode_tokens ends on its own only when cancelled
        detok.finalize()
        tail, stopped = stops.feed(detok.last_segment)
        tail += "" if stopped else stops.flush()
        if stopped and finish not in ("cancelled",):
            finish = "stop"
        if tail:
            yield TokenEvent(tail, -1, stats)
        stats.finish = finish
        raw = text = stops.text
        if self.format.strips_replies:
            text = text.strip()  # shown and stored stripped; the next prompt renders ``raw``
        self._finish(stats, t0, text, interrupted=finish == "cancelled", raw=raw)
        yield TurnDone(text, stats)

    def _finish(self, stats: TurnStats, t0: float, text: str, interrupted: bool, raw: str | None = None) -> None:
        # A cancelled reply is kept, marked interrupted: the cache holds its tokens, so the
        # conversation and the cache agree and the next turn reuses them.
        if text or not interrupted:
            self.conversation.add("assistant", text, interrupted=interrupted)
            if raw is not None and self.format.renders_as_generated:
                render_as_generated(self.format, self.conversation, self.cached, raw)
        stats.route = decode_route(self.model, self.caches)  # what this turn ran on, before a switch
        switch = self._apply_policy(len(self.cached))
        if switch:
            stats.notices.append(switch.line())
        stats.peak_memory = mx.get_peak_memory()
        stats.cache = self.cache_view()
        self._read_memory(stats)
        self.history.append(stats)

    def _read_memory(self, stats: TurnStats) -> None:
        """Read MLX's memory gauges into the turn's statistics (latest reading and trace)."""
        if not self.gauges:
            return
        held = stats.cache.bytes_held if stats.cache.tokens else 0
        stats.memory = read_gauges(kv_held=held, tokens=len(self.cached))
        stats.memory_trace.append(stats.memory)

    # ---- persistence hooks (used by chatapp.store) ----------------------------------------------
    @property
    def stores_kv(self) -> bool:
        """Whether this model's caches can be saved (snapshots) and shared (the prefix store):
        only when every layer is a chatapp policy cache. mlx-lm's own sliding-window and
        recurrent-state layers hold state that those formats (per-layer full-precision K/V) do
        not describe, so for such models both are off and resumes re-prefill."""
        return uniform(self.caches)

    def cache_consistent(self) -> bool:
        """True when every layer's cache holds exactly the tokens ``cached`` lists (evicted ones
        counted), i.e. the caches may be saved as a snapshot of ``cached``."""
        n = len(self.cached)
        return bool(self.caches) and all(
            (c.offset + c.evicted == n) if is_ours(c) else getattr(c, "offset", n) == n for c in self.caches)

    def restore_state(self, caches: list, cached: list[int], settings: CacheSettings,
                      exact: bool = False) -> Switched | None:
        """Adopt caches rebuilt from a snapshot or the prefix store (``cache.factory.restore_caches``)
        holding ``cached``; ``exact``: they hold those tokens as a full-precision prefill would.

        When they were made with other settings than this session would use now (another mode
        asked for, other sizes), the session switches to its own, converting the caches (or
        re-prefilling), and returns that report; otherwise None.
        """
        self.adopt(caches, cached, settings, exact)
        self.restored = len(cached)
        self.pinned = self._system_tokens()
        if self.requested_mode == AUTO:
            fits = settings.mode == AUTO_STARTS_AS or (settings.evicts and settings.mode == self._long_mode())
        else:
            fits = settings.mode == self.requested_mode
        if fits and settings == self._settings_for(settings.mode):
            return None
        requested = self.requested_mode
        report = self.switch(requested)
        self.requested_mode = requested
        return report

    def adopt(self, caches: list, cached: list[int], settings: CacheSettings, exact: bool = False) -> None:
        """Take ``caches`` (made with ``settings``, holding ``cached``) as they are, without
        fitting the settings to the model or switching modes (:meth:`restore_state` does that;
        benchmarks use this to time caches filled their own way)."""
        self.caches, self.cached, self.settings = caches, list(cached), settings
        self.kv_exact = exact

    def use_long_policy(self) -> Switched | None:
        """Auto mode: take the long-history policy now instead of at ``long_after`` (for a prompt
        that would run past the model's trained context). None when not in auto mode or already
        on it."""
        if self.requested_mode != AUTO or self.settings.evicts:
            return None
        report = self.switch(self._long_mode())
        self.requested_mode = AUTO
        return report

    # ---- what the UI shows ------------------------------------------------------------------
    def load_lines(self) -> list[str]:
        """What to tell the user once loaded: the prompt format chosen and the load-time notices."""
        return ([self.format_choice.line()] if self.format_choice is not None else []) + list(self.notices)

    def describe(self) -> SessionInfo:
        """A plain description of the session (its mode, settings, cache and memory) for a front end."""
        def fields(s: CacheSettings) -> dict[str, int | str]:  # what the F4 dialog edits
            return knob_values(s, DIALOG_KNOBS)

        cache = self.cache_view()
        messages = self.conversation.messages
        return SessionInfo(
            model_id=self.model_id, mode=self.mode, requested_mode=self.requested_mode, cache=cache,
            settings=fields(self.base_settings), effective=fields(self.settings),
            has_system=bool(messages and messages[0].role == "system"), messages=len(messages),
            fmt=self.format_choice.describe() if self.format_choice is not None else self.format.name,
            memory=read_gauges(kv_held=cache.bytes_held, tokens=len(self.cached)),
        )

    def cache_view(self, scan_messages: bool = True) -> CacheView:
        """Cache usage for display (engine/cache_view.py). ``scan_messages`` also works out which
        messages the model no longer sees (it re-tokenises the conversation, so streaming skips it)
        and the attention share; without it the last scan's are shown."""
        settle(self.caches)  # the maintenance due, every layer's votes at once (usage() would run it layer by layer)
        view = session_view(self, scan_messages, self._first_visible, self._sparsity)
        self._first_visible, self._sparsity = view.first_visible_message, view.attention_sparsity
        return view
