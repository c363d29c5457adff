"""Converting a live cache from one mode to another without re-running the prompt.

Every cache can give its content as full-precision K/V in sequence order at compacted
positions; the target cache takes that content and applies its own policy (quantise, evict).
The one case that cannot be done is growing back history a window has already dropped: a
target mode that keeps everything needs those tokens again, so the caller must re-prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .factory import make_caches
from .layers import is_policy, primary
from .settings import CacheSettings


@dataclass
class Conversion:
    caches: list
    action: str  # "converted", "unchanged" or "reprefill" (caches are then new and empty)
    reason: str
    seconds: float
    lossy: bool = False  # dequantised or evicted on the way


def convert_caches(caches: list, model, settings: CacheSettings) -> Conversion:
    start = time.perf_counter()
    source = primary(caches)
    if not is_policy(source):  # mlx-lm's own caches only (a pure recurrent model): no policy to change
        return Conversion(caches, "unchanged", f"this model has no full-attention layers for {settings.mode} to hold",
                          0.0)
    if source.mode == settings.mode and getattr(source, "settings", settings) == settings:
        return Conversion(caches, "unchanged", f"already {settings.mode}", 0.0)
    for c in caches:  # maintenance due (an eviction) changes what each layer holds and has dropped
        getattr(c, "settle", lambda: None)()
    target = make_caches(model, settings)
    evicted = getattr(source, "evicted", 0)
    if evicted and settings.budget is None:
        return Conversion(
            target, "reprefill",
            f"the {source.mode} cache has dropped {evicted} tokens that {settings.mode} keeps; "
            "they must be prefilled again", time.perf_counter() - start,
        )
    had_quant = source.usage().quant_tokens > 0
    if len(target) != len(caches):
        return Conversion(target, "reprefill", f"the caches have {len(caches)} layers, this model {len(target)}",
                          time.perf_counter() - start)
    for i, (old, new) in enumerate(zip(caches, target)):
        if not is_policy(new):
            # mlx-lm's own layers (recurrent state) and sliding windows go on as they are
            target[i] = old
            continue
        k, v = old.content()
        if k is not None and k.shape[2]:
            new.absorb(k, v)
        new.evicted += evicted
        new.offset  # settle the target's policy (quantise, evict) before reporting on it
        for name in ("evicted_by", "quantised_by"):  # the tallies go on from the source's
            counts = dict(getattr(old, name, {}))
            for mode, n in getattr(new, name).items():
                counts[mode] = counts.get(mode, 0) + n
            setattr(new, name, counts)
    mx.eval([c.state for c in target])
    first = primary(target)
    lossy = had_quant or first.evicted > evicted or first.usage().quant_tokens > 0
    how = []
    if had_quant:
        how.append("dequantised")
    if first.usage().quant_tokens:
        how.append("quantised")
    if first.evicted > evicted:
        how.append(f"evicted {first.evicted - evicted} tokens")
    reason = f"{source.mode} -> {settings.mode}" + (f" ({', '.join(how)})" if how else "")
    return Conversion(target, "converted", reason, time.perf_counter() - start, lossy)
