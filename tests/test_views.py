"""kernels/views.rows_of: the rows of a flat buffer as a 2-D view, as reshape gave them, and a
bounds check instead of reshape's formatted error."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from chatapp.kernels.views import rows_of


@njit(cache=False)
def _rows(flat, start, n, width):
    return rows_of(flat, start, n, width).copy()


@njit(cache=False)
def _write_through(flat, start, n, width):
    v = rows_of(flat, start, n, width)
    v[n - 1, width - 1] = 7


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.uint8])
def test_rows_match_the_reshaped_slice_and_write_through(dtype):
    flat = np.arange(40).astype(dtype)
    assert np.array_equal(_rows(flat, 5, 3, 4), flat[5:17].reshape(3, 4))
    assert _rows(flat, 40, 0, 4).shape == (0, 4)
    _write_through(flat, 5, 3, 4)
    assert flat[16] == 7


def test_rows_past_the_buffer_are_refused():
    flat = np.zeros(10, np.float32)
    with pytest.raises(IndexError, match="past the buffer"):
        _rows(flat, 5, 2, 3)
    with pytest.raises(IndexError):
        _rows(flat, -1, 1, 1)
