"""Native CPU kernels of the engine, built from their C source on first use.

``decode_kernel()`` returns the paged decode attention (``paged_decode.c``) as a function
of torch tensors, or None where it cannot run (no C compiler, a build that failed,
``PDSERVE_NATIVE=0``); the engine then takes the torch path (gather, then SDPA), which
gives the same results within float rounding. The runner also gives it the prefill
chunks of short contexts (``attention.KERNEL_PREFILL_MAX_CONTEXT``), each new token a row
of its own. The kernel reads each row's K and V where they lie in the paged cache; the
torch path copies them into a dense tensor first and reads the copy again: a layer's
decode attention at batch 32 on SmolLM2's shapes 1.37 -> 0.84 ms, the engine's decode
step about 1.09x at batch 8 and 1.11x at 32 (docs/benchmarks.md, "Decode attention read
in place"); on a CPU with AVX-512 BF16, 1.7-2x more (paged_decode.c's header).

``gemm_kernel()`` returns the linear layers over oneDNN's packed weights, read in place
(``packed_gemm.c``), or None where it cannot run (the same reasons, or a CPU without
AVX-512 BF16); ``prepack.linear`` calls it for every checked weight (docs/benchmarks.md).

``elementwise_kernels()`` returns RMSNorm and the half rotation, one pass each over
bfloat16 tensors (``elementwise.c``), or None (the same reasons); the runner gives them
to the model (``model.use_native``) and eager steps take them where torch would run an
op per term (docs/benchmarks.md).

Build: ``cc -O3 -march=native -fopenmp`` (never ``-ffast-math``: its start-up code
would set flush-to-zero for the whole process) into a shared library, cached by the sources'
hash and this CPU's feature flags (``-march=native`` code runs only where it was built)
under ``$PDSERVE_NATIVE_CACHE`` or ``~/.cache/pdserve/native``; written to a temporary
name and renamed, so engines starting together on one machine never load half a file.
Loaded with ctypes: no Python headers or torch extension build involved.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode.c", "packed_gemm.c", "elementwise.c"))
HEADERS = (Path(__file__).with_name("bf16.h"),)  # included by the sources: part of the cache key
SWITCH = "PDSERVE_NATIVE"  # "0": never build or use the native kernels
# Not -ffast-math: a library built with it sets the CPU's flush-to-zero and denormals-are-
# zero flags for the whole process when it loads. The reductions vectorize by their
# ``omp simd`` pragmas; these two let the exponential loop vectorize as well.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
DIMS = (64, 128)  # head sizes the kernel is built for
MAX_HEADS, MAX_BLOCK = 64, 64


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_NATIVE_CACHE") or Path.home() / ".cache" / "pdserve" / "native")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build(directory: Path | None = None) -> Path:
    """The kernels' library for this CPU, built unless already cached. Raises
    ``RuntimeError`` with the compiler's message when it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    text = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"kernels-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        include = f"-I{HEADERS[0].parent}"
        done = subprocess.run([compiler, *FLAGS, include, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class PagedDecode:
    """The loaded kernel: ``__call__`` attends ``q`` [rows, heads, D] over the cache."""

    def __init__(self, library: Path) -> None:
        fn = ctypes.CDLL(str(library)).paged_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                       ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __reduce__(self):
        # A step's metadata goes to the tensor-parallel ranks pickled: each rank loads its own.
        return (decode_kernel, ())

    @staticmethod
    def takes(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
        """Whether the kernel was built for a model of these shapes (this rank's heads)."""
        return (head_dim in DIMS and heads <= MAX_HEADS and heads % kv_heads == 0
                and block_size <= MAX_BLOCK)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                 lens: torch.Tensor, block_size: int, scale: float, window: int | None) -> torch.Tensor:
        """``q`` [rows, heads, D]; ``k_cache``/``v_cache`` [num_slots, kv_heads, D], contiguous;
        ``blocks`` [rows, max_blocks] int64 block tables; ``lens`` [rows] int64 contexts."""
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        blocks, lens = blocks.contiguous(), lens.contiguous()
        rows, heads, dim = q.shape
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(),
                      blocks.stride(0), lens.data_ptr(), rows, heads, k_cache.shape[1], dim, block_size,
                      scale, window or 0, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"paged_decode: sizes past the kernel's (heads {heads}, dim {dim}, block {block_size})")
        return out


@functools.cache
def decode_kernel() -> PagedDecode | None:
    """The paged decode kernel, built and loaded once per process; None where it cannot be
    (the reason logged once)."""
    return _load(PagedDecode, "native decode attention", "decode attention gathers, then SDPA", logging.WARNING)


def _load(kernel: type, what: str, otherwise: str, level: int):
    """``kernel`` over this process's build of the library, or None (logged at ``level``
    with what the engine does ``otherwise``) where the switch, the build or the CPU says no."""
    if os.environ.get(SWITCH) == "0":
        log.info("%s off (%s=0)", what, SWITCH)
        return None
    try:
        return kernel(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.log(level, "%s unavailable (%s): %s", what, exc, otherwise)
        return None


class PackedGemm:
    """The loaded kernel: ``__call__`` multiplies ``x`` [rows, k] by a packed weight. On
    SmolLM2's shapes, one core: 1.5-1.8x oneDNN's speed at 1-4 rows, 1.3x at 8, 1.08-1.16x
    from 16 to 64, 1.05-1.12x at 200-1,024 (docs/benchmarks.md)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        if not lib.packed_gemm_available():
            raise RuntimeError("built without AVX-512 BF16")
        fn = lib.packed_gemm
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __reduce__(self):
        return (gemm_kernel, ())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T`` for a bfloat16 ``x`` [rows, k] (rows contiguous) and ``weight``
        packed by oneDNN in the layout ``packed_gemm.c`` reads (the caller checked it);
        None where the kernel does not take these sizes (the caller uses oneDNN)."""
        rows, k = x.shape
        n = weight.shape[0]
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        rc = self._fn(x.data_ptr(), x.stride(0), rows, torch.ops.mkldnn.data_ptr(weight), n, k,
                      out.data_ptr(), n, torch.get_num_threads())
        return out if rc == 0 else None


@functools.cache
def gemm_kernel() -> PackedGemm | None:
    """The packed-weight GEMM, built and loaded once per process; None where it cannot be
    (the reason logged once; a CPU without AVX-512 BF16 is no fault, so at INFO)."""
    return _load(PackedGemm, "native packed GEMM", "every linear through oneDNN", logging.INFO)


class Elementwise:
    """The loaded kernels of ``elementwise.c``: one pass each over bfloat16 tensors where
    torch runs an op per term (``model.RMSNorm``, ``rope.rotate``); the results torch's
    within one bfloat16 rounding (``rotate`` bit for bit)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        i64, ptr, threads = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm, self._rotate = lib.rms_norm, lib.rotate_half
        self._norm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, threads]
        self._rotate.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, threads]
        for fn in (self._norm, self._rotate):
            fn.restype = ctypes.c_int

    def __reduce__(self):
        return (elementwise_kernels, ())

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether ``x`` is a tensor these kernels read: bfloat16 on the CPU, rows of
        contiguous elements (2-D, or 3-D with its heads side by side), outside a graph
        torch.compile is tracing (which fuses the torch code itself)."""
        return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1
                and (x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2]))
                and not torch.compiler.is_compiling())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [rows, n] (``takes``), ``weight`` [n] bfloat16: RMSNorm.forward's result."""
        rows, n = x.shape
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        self._norm(x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(), eps, out.data_ptr(),
                   torch.get_num_threads())
        return out

    def rotate(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, heads, D] (``takes``) by ``Rotary.at``'s float32 tables [rows, 1, D]
        (contiguous): rope.rotate's result, contiguous."""
        rows, heads, dim = x.shape
        out = torch.empty((rows, heads, dim), dtype=torch.bfloat16)
        rc = self._rotate(x.data_ptr(), x.stride(0), rows, heads, dim, cos.data_ptr(), sin.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rotate_half: head size {dim} is odd")
        return out


@functools.cache
def elementwise_kernels() -> Elementwise | None:
    """The elementwise kernels, built and loaded once per process; None where they cannot
    be (the reason logged once)."""
    return _load(Elementwise, "native elementwise kernels", "norms and rotary through torch", logging.WARNING)
