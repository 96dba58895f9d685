"""How XLA lays a program's temporaries out in one block of memory.

XLA allocates a step's temporaries as one block and gives each buffer an
offset no buffer live at the same time holds (its heap simulator,
``GlobalDecreasingSizeBestFitHeap``, run in two orders and the tighter
taken). Buffers of different sizes with interleaved lifetimes leave gaps,
so the block, which ``memory_analysis()`` counts, can be larger than what
is ever live at once. :func:`packed_bytes` lays buffers out the same way
from their lifetimes (:mod:`~remat_toolkit._src.analysis.liveness` gives
them in the program's order).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PACKED_MIN_BYTES", "packed_bytes"]


#: Temporaries under this size are not packed one by one but taken to fill
#: the gaps the larger ones leave (packing is quadratic in the buffers
#: placed, and a small one opens no gap worth the time).
PACKED_MIN_BYTES = 1 << 16


def packed_bytes(intervals: Sequence[tuple[int, int, int]]) -> int:
  """The size of one block holding every buffer of ``intervals`` (first
  step, last step, bytes; both steps included), each at an offset no buffer
  live at the same time holds, as XLA's heap simulator lays temporaries out
  (``GlobalDecreasingSizeBestFitHeap``): in decreasing size (or decreasing
  lifetime, whichever packs tighter), each in the tightest gap that fits,
  else on top.

  Example:
    >>> MiB = 2 ** 20
    >>> spans = [(1, 1, 5 * MiB), (0, 2, 2 * MiB), (2, 5, 4 * MiB),
    ...          (4, 5, 5 * MiB)]  # at most 9 MiB live at once
    >>> packed_bytes(spans) // MiB
    11
  """
  by_size = sorted(intervals, key=lambda t: (-t[2], t[0] - t[1], t[0]))
  by_life = sorted(intervals, key=lambda t: (t[0] - t[1], -t[2], t[0]))
  return min(_best_fit(by_size), _best_fit(by_life))


def _best_fit(order: Sequence[tuple[int, int, int]]) -> int:
  placed: list[tuple[int, int, int, int]] = []  # first, last, offset, bytes
  for first, last, size in order:
    taken = sorted((offset, offset + b) for f, la, offset, b in placed
                   if f <= last and first <= la)
    best: tuple[int, int] | None = None  # offset, gap
    cursor = 0
    for low, high in taken:
      gap = low - cursor
      if gap >= size and (best is None or gap < best[1]):
        best = (cursor, gap)
      cursor = max(cursor, high)
    placed.append((first, last, best[0] if best else cursor, size))
  return max((offset + b for _, _, offset, b in placed), default=0)
