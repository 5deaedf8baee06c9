"""Page-aligned staging memory (pykv/io/memory.py): zeroed, aligned, populated on request, and on
transparent huge pages where the kernel offers them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pykv.io import memory
from pykv.io.memory import ALIGNMENT, HUGE_PAGE, aligned_buffer, buffer_address


@pytest.mark.parametrize("size", [ALIGNMENT, HUGE_PAGE - ALIGNMENT, 3 * HUGE_PAGE + ALIGNMENT])
@pytest.mark.parametrize("populate", [False, True])
def test_zeroed_aligned_and_writable(size: int, populate: bool) -> None:
    buffer = aligned_buffer(size, populate=populate)
    assert len(buffer) == size and buffer_address(buffer) % ALIGNMENT == 0
    assert buffer[:] == bytes(size)
    buffer[size - 1:size] = b"\x07"
    assert buffer[size - 1] == 7


def test_populate_falls_back_to_touching_every_page(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    buffer = aligned_buffer(2 * HUGE_PAGE, populate=True)
    assert buffer[:] == bytes(2 * HUGE_PAGE)


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that starts at ``address`` (/proc/self/smaps), in bytes."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == address
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_a_large_buffer_is_backed_by_huge_pages() -> None:
    buffer = aligned_buffer(8 * HUGE_PAGE, populate=True)
    assert anon_huge_bytes(buffer_address(buffer)) >= HUGE_PAGE


@pytest.mark.skipif(thp_mode() != "madvise", reason="only 'madvise' tells asked-for from default")
def test_a_small_buffer_is_not_asked_for_huge_pages() -> None:
    buffer = aligned_buffer(HUGE_PAGE - ALIGNMENT, populate=True)
    assert anon_huge_bytes(buffer_address(buffer)) == 0


def test_huge_page_bytes_sums_the_mappings_a_range_spans(tmp_path):
    from pykv.io.memory import huge_page_bytes
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\nAnonHugePages:      2048 kB\n"
        "7f0000400000-7f0000800000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\nAnonHugePages:      4096 kB\n"
        "7f0000800000-7f0000801000 r--p 00000000 08:01 1234   /usr/lib/x.so\n"
        "AnonHugePages:         0 kB\nVmFlags: rd mr mw me\n")
    base = 0x7f0000000000
    assert huge_page_bytes(base, 4 << 20, str(smaps)) == 2 << 20  # the first mapping only
    assert huge_page_bytes(base + (1 << 20), 4 << 20, str(smaps)) == 4 << 20  # both, at most the range
    assert huge_page_bytes(base + (1 << 20), 6 << 20, str(smaps)) == 6 << 20
    assert huge_page_bytes(0x1000, 4096, str(smaps)) == 0  # no mapping there
    assert huge_page_bytes(base, 4096, str(tmp_path / "missing")) is None

