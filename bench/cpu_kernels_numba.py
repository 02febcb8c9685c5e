"""An exact Q4_1 matrix-vector product compiled by numba, for ``bench/cpu_kernels.py``
(a candidate measured there, not part of orcapod; numba is not a dependency).

Rows are the vector lanes: the levels go as ``[groups, 16, out]`` bytes (value
``j`` of a group in the low nibble, ``j + 16`` in the high one), so for one
group and four bytes of it the loop over rows is a plain elementwise loop that
LLVM vectorises (four bytes a pass: fewer passes over the partial sums than one
byte a pass, and LLVM still vectorises it; written as one loop over all 16 it did
not). Rows are indexed unsigned: with a signed index numba wraps negative ones
around, and LLVM then gathers and scatters instead of loading vectors (8x slower).
``out = sum over groups of scale * (x . levels) + minimum * sum(x)``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit, prange

_FAST = {"fastmath": True, "boundscheck": False, "nogil": True, "error_model": "numpy"}


@njit(**_FAST)  # type: ignore[misc]
def _four_bytes(partial, b0, b1, b2, b3, a0, a1, a2, a3, h0, h1, h2, h3, begin, end):  # type: ignore[no-untyped-def]
    """partial[i] += four bytes of row i's group times their inputs: ``a`` for the
    low nibbles, ``h`` for the high ones."""
    for i in range(np.uintp(begin), np.uintp(end)):
        q0 = np.int32(b0[i])
        q1 = np.int32(b1[i])
        q2 = np.int32(b2[i])
        q3 = np.int32(b3[i])
        partial[i] += (
            a0 * np.float32(q0 & np.int32(15)) + h0 * np.float32(q0 >> np.int32(4))
            + a1 * np.float32(q1 & np.int32(15)) + h1 * np.float32(q1 >> np.int32(4))
            + a2 * np.float32(q2 & np.int32(15)) + h2 * np.float32(q2 >> np.int32(4))
            + a3 * np.float32(q3 & np.int32(15)) + h3 * np.float32(q3 >> np.int32(4))
        )  # fmt: skip


@njit(**_FAST)  # type: ignore[misc]
def _rows(x, levels, scale, minimum, out, partial, begin, end):  # type: ignore[no-untyped-def]
    groups = levels.shape[0]
    for i in range(np.uintp(begin), np.uintp(end)):
        out[i] = np.float32(0)
    for group in range(groups):
        offset = group * 32
        x_sum = np.float32(0)
        for j in range(32):
            x_sum += x[offset + j]
        for i in range(np.uintp(begin), np.uintp(end)):
            partial[i] = np.float32(0)
        block = levels[group]
        for j in range(0, 16, 4):
            at = offset + j
            _four_bytes(
                partial, block[j], block[j + 1], block[j + 2], block[j + 3],
                x[at], x[at + 1], x[at + 2], x[at + 3],
                x[at + 16], x[at + 17], x[at + 18], x[at + 19], begin, end,
            )  # fmt: skip
        group_scale = scale[group]
        group_minimum = minimum[group]
        for i in range(np.uintp(begin), np.uintp(end)):
            out[i] += group_scale[i] * partial[i] + group_minimum[i] * x_sum


@njit(parallel=True, boundscheck=False)  # type: ignore[misc]
def _rows_in_parts(x, levels, scale, minimum, out, partial, parts):  # type: ignore[no-untyped-def]
    rows = levels.shape[2]
    for part in prange(parts):
        begin = rows * part // parts // 16 * 16
        end = rows if part == parts - 1 else rows * (part + 1) // parts // 16 * 16
        _rows(x, levels, scale, minimum, out, partial, begin, end)


class Q4RowsAsLanes:
    """``levels`` [out, groups, 32] uint8 in 0..15, ``scale`` and ``minimum``
    [out, groups]: ``w = levels * scale + minimum``; called on ``x`` [in] fp32."""

    def __init__(self, levels: Any, scale: Any, minimum: Any, threads: int) -> None:
        pairs = levels[..., :16] | (levels[..., 16:] << 4)  # [out, groups, 16]
        self.levels = np.ascontiguousarray(pairs.transpose(1, 2, 0).astype(np.uint8))
        self.scale = np.ascontiguousarray(scale.T.astype(np.float32))
        self.minimum = np.ascontiguousarray(minimum.T.astype(np.float32))
        self.out = np.empty(self.levels.shape[2], np.float32)
        self.partial = np.empty_like(self.out)
        self.parts = threads
        numba.set_num_threads(threads)

    def __call__(self, x: Any) -> Any:
        x = np.ascontiguousarray(x, dtype=np.float32)
        weights = (self.levels, self.scale, self.minimum)
        if self.parts == 1:
            _rows(x, *weights, self.out, self.partial, 0, len(self.out))
        else:
            _rows_in_parts(x, *weights, self.out, self.partial, self.parts)
        return self.out

    @property
    def num_bytes(self) -> int:
        return int(self.levels.nbytes + self.scale.nbytes + self.minimum.nbytes)
