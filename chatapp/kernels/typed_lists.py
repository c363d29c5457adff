"""numba typed lists built by cached code.

``numba.typed.List()`` and its ``append`` called from Python compile numba's own list helpers
for the item type in every new process (they are not cached on disk): 0.4-0.6 s of each model
load for the fused decoder's lists of per-layer weights. Built inside these ``cache=True``
functions instead, the same helpers are compiled into code that numba loads from its cache
after the first run on a machine.
"""

from __future__ import annotations

from typing import Sequence

from numba import njit
from numba.typed import List


@njit(cache=True)
def _one(item):  # pragma: no cover - jitted
    out = List()
    out.append(item)
    return out


@njit(cache=True)
def _append(out, item):  # pragma: no cover - jitted
    out.append(item)


def typed_list(items: Sequence) -> List:
    """A numba typed List of ``items`` (at least one; all of one numba type)."""
    if not items:
        raise ValueError("typed_list needs at least one item (its type is the first one's)")
    out = _one(items[0])
    for item in items[1:]:
        _append(out, item)
    return out
