"""From a Config to a loaded model and a ready Session (shared by the CLI and the TUI)."""

from __future__ import annotations

from typing import Callable

from cache import CacheConfigError, CacheSettings

from .device import pick_backend
from .generate import GenerationSettings
from .loader import DownloadProgress, LoadedModel, ModelLoadError, load_model
from .session import Session


class SetupError(Exception):
    """A one-line, user-fixable reason the engine could not start."""


def load_engine(config, progress: Callable[[DownloadProgress], None] | None = None) -> LoadedModel:
    """Load the model and give it the backend's fast path (the CPU plan is a no-op on GPUs)."""
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
    )
    return loaded


def cache_settings_from(config, mode: str | None = None) -> CacheSettings:
    c = config.cache
    mode = mode or c.mode
    try:
        return CacheSettings(
            mode=mode if mode != "auto" else "prealloc", chunk_size=c.chunk_size, sinks=c.sinks,
            window=c.window, evict_chunk=c.evict_chunk, kv_bits=c.kv_bits, kv_group_size=c.kv_group_size,
            quant_start=c.quant_start, max_kv_tokens=c.max_kv_tokens,
        )
    except CacheConfigError as e:
        raise SetupError(f"cache.{e}") from None


def generation_from(config) -> GenerationSettings:
    s = config.sampling
    return GenerationSettings(
        temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
        max_tokens=s.max_tokens, repetition_penalty=s.repetition_penalty, ignore_eos=s.ignore_eos,
    )


def session_from_config(config, loaded: LoadedModel) -> Session:
    try:
        session = Session(
            loaded.model, loaded.tokenizer, cache_settings=cache_settings_from(config), mode=config.cache.mode,
            long_after=config.cache.long_after, generation=generation_from(config),
            system=config.chat.system, raw=config.chat.raw,
        )
    except CacheConfigError as e:
        raise SetupError(f"cache.{e}") from None
    session.model_id = loaded.model_id
    plan = getattr(loaded, "cpu_plan", None)
    if plan is not None and plan.applied:
        session.notices.append(f"CPU fast path: {plan.headline()}")
        session.notices.append(f"CPU routes: {'; '.join(plan.route_lines())}")
    if plan is not None:
        session.notices.extend(plan.warnings)
    return session
