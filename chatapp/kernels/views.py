"""2-D views of a flat buffer's rows, without ``reshape``.

numba's ``reshape`` compiles, at each call site's types, an error path that formats the shapes
into its message (string formatting, ``str`` of tuples and ints): ~4 s of a first start's
compile for the sites in the attention and prefill kernels (an array assignment ``a[:] = b``
pulls in the same path: the kernels copy rows in loops). ``rows_of`` builds the same
C-contiguous view (numba's ``carray`` over the buffer's address) behind one bounds check with a
constant message. The view holds no reference to the buffer: the callers' buffers outlive it.
"""

from __future__ import annotations

from numba import carray, njit, types
from numba.extending import intrinsic


@intrinsic
def _address_of(typingctx, flat, start):
    """A typed pointer to element ``start`` of a 1-D array."""
    if not (isinstance(flat, types.Array) and flat.ndim == 1 and isinstance(start, types.Integer)):
        return None
    dtype = flat.dtype

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.gep(arr.data, [index])

    return types.CPointer(dtype)(flat, start), codegen


@njit(nogil=True, cache=True)
def rows_of(flat, start, n, width):  # pragma: no cover - jitted
    """flat[start:start + n * width] as a C-contiguous [n, width] array (flat 1-D, C-contiguous).
    A function, not an ``inline="always"`` overload: inlined at numba's level, a store through
    the view in the caller was dropped (numba 0.68, checked by tests/test_views.py)."""
    if start < 0 or n < 0 or start + n * width > flat.shape[0]:
        raise IndexError("rows_of: the rows run past the buffer")
    return carray(_address_of(flat, start), (n, width))


__all__ = ["rows_of"]
