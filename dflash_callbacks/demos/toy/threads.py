"""Torch thread count for the toy world's tiny models.

Models this small spend their time in short kernels, where a second OpenMP thread costs
more in synchronisation than it gains, and on a busy machine far more (measured on
2 shared cores: a toy training step 0.32 s with one thread, 3-5 s with two).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads, restoring the previous count after."""
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
