"""From a Config to a loaded model and a ready Session (shared by the CLI and the TUI)."""

from __future__ import annotations

from typing import Callable

from cache import CacheConfigError, CacheSettings
from cache.settings import SETTINGS_KNOBS, knob_values, starting_mode
from chatapp.errors import SetupError
from chatapp.model.device import pick_backend
from chatapp.model.hub import DownloadProgress
from chatapp.model.loader import LoadedModel, load_model
from chatapp.model.modelfiles import ModelLoadError
from chatapp.prompt.choice import FormatChoice, FormatRequest, RepoFacts, choose_format
from chatapp.prompt.formats import (
    FormatError,
    PromptFormat,
    make_format,
    read_template_file,
)

from .generate import GenerationSettings
from .memory import MemoryLimits, apply_limits
from .session import Session


def load_engine(config, progress: Callable[[DownloadProgress], None] | None = None,
                on_slow_warm_up: Callable[[str], None] | None = None) -> LoadedModel:
    """Set MLX's memory limits, load the model and give it the backend's fast path (the CPU plan
    is a no-op on GPUs). ``on_slow_warm_up`` gets a line, from a helper thread, every few
    seconds while the CPU kernels compile (a first start on this CPU)."""
    if config.chat.template and not config.chat.raw:
        try:  # a missing template file is said before the model loads, not after
            read_template_file(config.chat.template)
        except FormatError as e:
            raise SetupError(str(e)) from None
    memory_notes = apply_limits(MemoryLimits(config.memory.limit_mb, config.memory.cache_limit_mb),
                                pick_backend().name)
    try:
        # scales stay as stored: the CPU kernels read float16 ones directly, and apply_fast_path
        # casts those of the layers that MLX runs
        loaded = load_model(config.model.id, progress=progress, dtype=config.model.dtype, cast_scales=False)
    except ModelLoadError as e:
        raise SetupError(str(e)) from None
    from chatapp.backend.cpu import apply_fast_path, physical_memory_bytes

    cpu = config.cpu
    loaded.cpu_plan = apply_fast_path(
        loaded.model, backend=pick_backend().name, fast_attention=cpu.fast_attention,
        dense_prefill_threshold=cpu.dense_prefill_threshold, dense_weights=cpu.dense_weights,
        dense_budget_bytes=int(physical_memory_bytes() * cpu.dense_budget_fraction), numpy_matvec=cpu.numpy_matvec,
        kernels=cpu.kernels, kernel_max_tokens=cpu.kernel_max_tokens, threads=cpu.threads,
        fused_decode=cpu.fused_decode, numerics=cpu.numerics, kv_dtype=cpu.kv_dtype,
        precompile=cpu.precompile, on_slow_warm_up=on_slow_warm_up,
    )
    loaded.memory_notes = memory_notes
    return loaded


def cache_settings_from(config, mode: str | None = None) -> CacheSettings:
    """The [cache] settings as the CacheSettings a session starts with (``mode`` instead of the config's)."""
    values = knob_values(config.cache, SETTINGS_KNOBS)
    try:
        return CacheSettings(**{**values, "mode": starting_mode(mode or values["mode"])})
    except CacheConfigError as e:
        raise SetupError(f"cache.{e}") from None


def generation_from(config) -> GenerationSettings:
    s = config.sampling
    return GenerationSettings(
        temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
        max_tokens=s.max_tokens, repetition_penalty=s.repetition_penalty, ignore_eos=s.ignore_eos,
    )


def prompt_format_for(config, loaded: LoadedModel) -> tuple[PromptFormat, FormatChoice]:
    """The prompt format the settings and the model call for (prompt.choice), and why.
    A format the tokenizer cannot serve, or a template file that cannot be read or rendered, is a
    one-line SetupError."""
    facts = RepoFacts.from_tokenizer(loaded.model_id, loaded.config, loaded.tokenizer)
    choice = choose_format(FormatRequest.from_config(config), facts)
    if choice.template_file:
        path = choice.template_file
        try:
            text = read_template_file(path)
        except FormatError as e:
            raise SetupError(str(e)) from None
        fmt = make_format("template", loaded.tokenizer, text, source=path)
        try:
            fmt.check(config.chat.system)  # a template that cannot render fails now, naming its line
        except FormatError as e:
            raise SetupError(f"the chat template does not render: {e}") from None
        return fmt, choice
    try:
        return make_format(choice.name, loaded.tokenizer), choice
    except FormatError as e:
        raise SetupError(f"cannot use {choice.line()}: {e}") from None


def load_notices(loaded: LoadedModel) -> list[str]:
    """The load-time lines for the user: a GGUF's file, types and conversions, the CPU plan, memory."""
    notes = list(getattr(loaded, "notes", []))
    plan = getattr(loaded, "cpu_plan", None)
    if plan is not None and plan.applied:
        notes.append(f"CPU fast path: {plan.headline()}")
        notes.append(f"CPU routes: {'; '.join(plan.route_lines())}")
        from chatapp.backend.warmup import SLOW_WARM_UP_S, compiled_line

        if plan.warm_up_seconds >= SLOW_WARM_UP_S:
            notes.append(compiled_line(plan.warm_up_seconds))
    if plan is not None:
        notes.extend(plan.warnings)
    notes.extend(getattr(loaded, "memory_notes", []))
    return notes


def session_from_config(config, loaded: LoadedModel, cancel=None) -> Session:
    """The Session the settings call for; ``cancel`` (a threading.Event-like token) stops its replies."""
    fmt, choice = prompt_format_for(config, loaded)
    try:
        session = Session(
            loaded.model, loaded.tokenizer, cache_settings=cache_settings_from(config), mode=config.cache.mode,
            long_after=config.cache.long_after, generation=generation_from(config),
            system=config.chat.system, prompt_format=fmt, format_choice=choice, model_id=loaded.model_id,
            notices=load_notices(loaded), cancel=cancel,
        )
    except CacheConfigError as e:
        raise SetupError(f"cache.{e}") from None
    return session
