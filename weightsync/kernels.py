"""numba kernels of the plain codecs (the range coder's are in :mod:`weightsync.arith`)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _changes(old, new, idx, diff):
    k = 0
    for i in range(old.size):
        o = old[i]
        x = new[i]
        idx[k] = i  # written always, kept only when the element changed: no branch to mispredict
        diff[k] = x - o
        k += o != x
    return k


def find_changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions where two unsigned arrays of the same length differ (ascending, int64) and the
    wrapping differences ``new - old`` there, in one pass over both; what
    ``np.flatnonzero(old != new)`` and a gather give, 1.5-2x as fast (3% changed)."""
    idx = np.empty(old.size, np.int64)  # pages are only touched up to the number of changes
    diff = np.empty(old.size, old.dtype)
    k = _changes(old, new, idx, diff)
    return idx[:k], diff[:k]
