"""Host tensors on transparent huge pages, for memory the CPU reads at scattered places.

Decode attention reads each sequence's K/V pages wherever the pool put them. With 4 KiB pages
nearly every 16-position page of K or V is a miss in the TLB, and in a virtual machine a miss
walks two page tables. Linux backs an anonymous mapping with 2 MiB pages where the mapping asks
for them (``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` on most distributions, so nothing else gets them unasked): on a Zen 4 guest the
decode attention of W-mixed's 32 rows read its K/V from memory 1.15-1.19x faster. Streamed
weights gain little (1.0-1.06x: the kernels prefetch ahead), so only the KV pools ask.

Where the system has no transparent huge pages, the mapping is plain anonymous memory: the same
zeros at the same speed as ``torch.zeros``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes; x86-64's and most arm64 kernels' transparent huge page


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor, on huge pages where the system gives them (see above). Every
    page is written here, so the kernel finds (or compacts) its huge pages now, not in a
    request's first step that touches them."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than asked, so that the tensor can start on a huge page boundary: the
    # kernel backs only whole, aligned 2 MiB ranges. The spare range is never touched.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: plain pages
        region.madvise(advice)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -start % HUGE_PAGE
    # The tensor keeps the mapping alive (frombuffer holds the buffer until the storage goes).
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape).zero_()


def return_freed_memory(collect: bool = False) -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    what was freed stays resident in the heap otherwise, for tensors under glibc's mmap
    threshold and for whatever a library's loading parsed and dropped. ``collect``: run the
    garbage collector first, for memory held by reference cycles (about 0.1 s with torch
    imported, so only where a load may leave cycles behind, not on every engine's path)."""
    if collect:
        import gc

        gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
