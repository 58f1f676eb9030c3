"""How full-width passes walk a [C, V] block of logits: in row blocks that stay in cache.

    for a, b in row_blocks(z):      # ~1 MiB of rows each on a CPU; the whole block on a GPU
        z[a:b].sub_(m[a:b]).exp_()

Shared by the loss's chunk math (topkd/loss/chunk.py) and the teacher's top-K pass (topkd/cache/building/teacher.py):
a neutral home, so neither layer imports the other.
"""

from __future__ import annotations

from torch import Tensor

BLOCK_BYTES = 2**20  # elementwise passes walk the chunk in row blocks this size, so they stay in L2


def row_blocks(z: Tensor) -> list[tuple[int, int]]:
    """(start, end) row ranges of about BLOCK_BYTES each: elementwise passes per block stay in L2.
    On a GPU one block: a kernel launch per row would cost more than the L2 reuse saves."""
    if z.device.type != "cpu":
        return [(0, z.shape[0])]
    rows = max(1, BLOCK_BYTES // (z.shape[1] * z.element_size()))
    return [(r, min(r + rows, z.shape[0])) for r in range(0, z.shape[0], rows)]
