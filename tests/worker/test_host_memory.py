"""Huge-page host tensors (yaied/worker/host_memory.py): zeros like torch.zeros, on 2 MiB pages
where the system has transparent huge pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from yaied.worker import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected mode ("always", "madvise", "never"), None where the kernel has no THP."""
    if not THP.exists():
        return None
    return THP.read_text().split("[")[1].split("]")[0]


def _huge_kib_of(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the tensor's first byte (/proc/self/smaps)."""
    address, found = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            found = low <= address < high
        elif found and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return 0


@pytest.mark.parametrize("shape", [(3, 5), (2, 700, 16, 64)])  # under and over one huge page
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_are_zeros_of_the_shape_and_writable(shape, dtype):
    tensor = host_memory.zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    gc.collect()  # the tensor holds its mapping: nothing else refers to it now
    tensor.view(-1)[-1] = 3.0
    tensor.view(-1)[0] = 1.0
    assert float(tensor.float().sum()) == 4.0


def test_a_large_tensor_sits_on_huge_pages_where_the_system_has_them():
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode() or 'absent'} on this system")
    tensor = host_memory.zeros((4, 1024, 16, 64), torch.float32)  # 16 MiB
    assert tensor.data_ptr() % host_memory.HUGE_PAGE == 0
    # All of it where the kernel found free huge pages; at least some on any system with THP.
    assert _huge_kib_of(tensor) >= 2048
