"""cffi (out-of-line API mode) build of slates._native: the shared-memory rings.

setup.py finds `ffibuilder` through cffi_modules; running this file directly
builds the extension in place (slates/_native*.so) for a source checkout:

    python native/build_native.py
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent


def _relative(path: Path) -> str:
    # setuptools rejects absolute source paths, and setup.py runs from the
    # repository root; the script below builds from the root too.
    return os.path.relpath(path, _ROOT)


ffibuilder = FFI()

ffibuilder.cdef(
    """
    #define RING_HEADER_SIZE ...
    #define RING_MIN_CAPACITY ...
    #define RING_MAX_CAPACITY ...

    typedef struct { uint64_t capacity; ...; } ring_t;

    uint64_t ring_region_size(uint64_t capacity);
    uint32_t ring_max_message(const ring_t *r);
    int ring_init(void *mem, uint64_t mem_len, uint64_t capacity);
    int ring_attach(ring_t *r, void *mem, uint64_t mem_len);
    int ring_push(ring_t *r, const uint8_t *msg, uint32_t len);
    int ring_pop(ring_t *r, uint8_t *out, uint32_t cap);
    int ring_peek_length(ring_t *r);
    int ring_spin_wait(ring_t *r, uint64_t spin_ns);
    int ring_prepare_park(ring_t *r);
    void ring_unpark(ring_t *r);
    int ring_is_parked(const ring_t *r);
    int ring_notify(ring_t *r, int eventfd);
    int64_t ring_drain_eventfd(int eventfd);
    """
)

ffibuilder.set_source(
    "slates._native",
    '#include "ring.h"',
    sources=[_relative(_HERE / "ring.c")],
    include_dirs=[_relative(_HERE)],
    depends=[_relative(_HERE / "ring.h")],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
)


if __name__ == "__main__":
    # With the root as tmpdir, cffi writes slates/_native.c and the .so next
    # to the package (both git-ignored).  The .so gets the name an install
    # gives it (cffi builds for the stable ABI), so a stale copy from one
    # way of building can never shadow the other's.
    print(ffibuilder.compile(tmpdir=str(_ROOT), target="_native.abi3.so", verbose=True))
