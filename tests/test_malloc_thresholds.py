"""glibc's dynamic thresholds, and fix_malloc_thresholds ending them (issue 28: memory kept after hostile
uploads). Checked on the allocator itself, in a fresh process each, with no RSS reading: a chunk's header
says whether it is its own mapping (glibc's IS_MMAPPED bit), and mallinfo2's keepcost is the free heap
top glibc kept instead of trimming."""

import subprocess
import sys

import pytest

from inference_engine.malloc_trim import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, fix_malloc_thresholds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")

# A start-up's large temporary (20 MiB, freed: glibc raises its mmap threshold to 20 MiB and its trim
# threshold to 40 MiB), then the fix or not; then a buffer over our mmap threshold, freed and allocated
# again, and 8 MiB of 256 KiB buffers freed together. Prints: is the second buffer its own mapping, and
# how many bytes of free heap top glibc kept.
SCRIPT = f"""
import ctypes, sys
from inference_engine.malloc_trim import fix_malloc_thresholds
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.free(libc.malloc(20 << 20))
if sys.argv[1] == "fixed":
    assert fix_malloc_thresholds()
size = {MMAP_THRESHOLD_BYTES} + {MMAP_THRESHOLD_BYTES} // 2
libc.free(libc.malloc(size))
p = libc.malloc(size)
mapped = bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
libc.free(p)
small = [libc.malloc(256 << 10) for _ in range(32)]
for q in reversed(small):
    libc.free(q)
print(mapped, libc.mallinfo2().keepcost)
"""


def _allocator(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    mapped, kept = out.stdout.split()
    return mapped == "True", int(kept)


def test_large_buffers_stay_mappings_and_a_free_heap_top_is_trimmed_once_the_thresholds_are_fixed():
    assert fix_malloc_thresholds()
    mapped, kept = _allocator("fixed")
    assert mapped and kept < 2 * TRIM_THRESHOLD_BYTES  # the top left is under the threshold (plus glibc's padding)


def test_control_glibc_otherwise_carves_large_buffers_from_the_heap_and_keeps_its_free_top():
    """The negative control: without the fix both thresholds stay raised by the first large temporary."""
    mapped, kept = _allocator("dynamic")
    assert not mapped and kept >= 4 << 20
