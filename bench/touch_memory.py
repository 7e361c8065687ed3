#!/usr/bin/env python3
"""bench/touch_memory.py GB: allocate GB of anonymous memory, write every page, free it.

Used by bench/pinload.sh to separate the engine's pinned-prefix load from the cost of
backing fresh guest memory: on a VM with free page reporting (virtio-balloon) memory freed a
few seconds ago is returned to the host, and touching it again faults on the host (measured
0.6-1.1 GB/s here, against 7-11 GB/s for memory touched a moment before). Prints the rate."""
import ctypes
import mmap
import sys
import time

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
size = int(float(sys.argv[1]) * 1e9) // (2 << 20) * (2 << 20)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf = ctypes.c_char.from_buffer(m)
addr = ctypes.addressof(buf)
libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_HUGEPAGE)
t = time.monotonic()
if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_POPULATE_WRITE) != 0:
    for off in range(0, size, 4096):  # kernels before 5.14: touch every page
        m[off] = 1
dt = time.monotonic() - t
print(f"touched {size / 1e9:.2f} GB in {dt:.3f} s ({size / dt / 1e9:.2f} GB/s)")
del buf
m.close()
