"""Hand-written CPU kernels, built once per machine into ``$CASCADE_HOME/build`` with the C++
compiler torch.compile already needs.

``rows_times_weight``: 1-16 bf16 activation rows times a bf16 weight matrix, reading the weight
once at memory speed (see ``rows_times_weight.cpp``). ``decode_attention``: a short pass's
attention over a bf16 KV cache, each key and value read once for every query head of its group
and every token of the pass, key blocks split across threads (see ``attention.cpp``; scores and
weighted sums from AMX tiles where the CPU has them, else from AVX512-BF16 products). ``rows_times_int8``: the same
product for an int8 weight packed by ``cascade.quantise``, the activations quantised per 64 inputs
(see ``rows_times_int8.cpp``; AMX-INT8, AVX512-VNNI or AVX2); ``rows_times_int4``: for a 4-bit weight
with a scale and a low per 32 inputs (``rows_times_int4.cpp``; AVX512-VNNI or AVX2). A CPU without AVX512-BF16
but with AVX2 and FMA gets the bf16 product, the layer ops and attention in float32 arithmetic
(``rows_times_weight_avx2.cpp``, ``attention_avx2.h``). Where the build fails or the CPU has neither,
``weight_kernel_available()`` is false, a warning says why, and callers keep PyTorch's own kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import shutil
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from cascade import atomic
from cascade.home import cascade_home
from cascade.tuning import machine_tuning

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "rows_times_weight.cpp",
        "rows_times_weight_avx2.cpp",
        "attention.cpp",
        "rows_times_int8.cpp",
        "rows_times_int4.cpp",
        "layer.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("tiles.h", "products.h", "quantised_rows.h", "vector_math.h", "attention_avx2.h")
]
MAX_KERNEL_ROWS = 16
"""Most activation rows per product the kernel takes (decode steps, proposals, verifications of up
to 15 proposals); wider passes (prefill chunks) are compute-bound and go to oneDNN."""


def build_directory() -> Path:
    """Per source version, CPU (the build uses -march=native) and PyTorch installation (the build's
    commands name its headers and libraries). Resolved: a ``$CASCADE_HOME`` whose ``build`` links to
    another home's names the same files, so ninja sees the same commands and does not rebuild."""
    machine = platform.processor() + cpu_model() + str(Path(torch.__file__).parent)
    digest = hashlib.sha256(source_code() + machine.encode())
    path = cascade_home() / "build" / f"kernels-{torch.__version__}-{digest.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def source_code() -> bytes:
    """The kernels' sources and headers, one after another."""
    return b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))


@cache
def source_digest() -> str:
    """A digest of the kernels' sources: what a pass costs changes with them."""
    return hashlib.sha256(source_code()).hexdigest()[:16]


def staged_sources(directory: Path) -> list[str]:
    """The sources, copied with their headers into ``directory/src`` (under the build lock), where the
    build reads them. Its commands then name the same files whichever checkout or installed copy of
    cascade asks for the build: ninja rebuilds when a command changes, and two source trees on one
    machine would otherwise rebuild the same directory in turn."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    for path in (*SOURCES, *HEADERS):
        copy = staged / path.name
        if not copy.exists():  # the directory's name fixes what it holds: a copy is never stale
            with atomic.replacing(copy) as partial:
                shutil.copyfile(path, partial)
    return [str(staged / path.name) for path in SOURCES]


@cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


@contextmanager
def _exclusive(handle):
    """Hold an OS lock on the open file ``handle``: one build at a time per directory, released by
    the OS if the process dies (torch's own lock file would then be left behind and waited on)."""
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)


@cache
def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU multiplies bf16 pairs (oneDNN's bf16 matrix products then run at about twice
    float32's rate; without it they are emulated, several times slower than float32)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def bf16_products_emulated(rows: torch.Tensor) -> bool:
    """Whether a bf16 matrix product of ``rows`` would be emulated (oneDNN on a CPU without AVX512-BF16,
    several times slower than float32): wide passes there multiply in float32 instead."""
    return rows.dtype == torch.bfloat16 and rows.device.type == "cpu" and not cpu_has_avx512_bf16()


@cache
def weight_kernel_available() -> bool:
    """Whether ``torch.ops.cascade_kernels.rows_times_weight`` runs at memory speed here (built and
    loaded on first call; a failure is logged once and leaves PyTorch's kernels in use)."""
    from torch.utils import cpp_extension

    try:
        torch._C._cpu._init_amx()  # ask the OS for AMX tile state (Linux grants it per process)
        directory = build_directory()
        with open(directory / "build.flock", "w") as held, _exclusive(held):
            (directory / "lock").unlink(missing_ok=True)  # a build killed midway leaves torch's lock file
            cpp_extension.load(  # -fopenmp: at::parallel_for is inlined OpenMP, run by torch's own libgomp
                name="cascade_kernels",
                sources=staged_sources(directory),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # compiler, headers or ninja missing: many exception types
        first_line = next(iter(str(error).splitlines()), "")
        logger.warning(
            "building cascade's CPU kernels failed (%s: %s); weight products and attention use PyTorch's kernels",
            type(error).__name__,
            first_line,
        )
        return False
    if not compiled_features() & VECTOR_FEATURES:
        logger.warning("this CPU has neither AVX512-BF16 nor AVX2 with FMA: weight products use PyTorch's kernels")
        return False
    torch.ops.cascade_kernels.set_step_in_memory_order(machine_tuning().step_in_memory_order)
    return True


VECTOR_FEATURES = frozenset({"avx512_bf16", "avx2"})
"""The instruction sets the bf16 kernels take (``vector_math.h``): AVX512-BF16's bf16 pair products, or
on CPUs without them (Zen 1-3, Intel's before Sapphire Rapids but Cooper Lake) AVX2 and FMA, bf16
widened to float32 in registers."""


@cache
def compiled_features() -> frozenset[str]:
    """What the loaded build compiled for: avx512_bf16 or avx2, amx_bf16, avx512_vnni or quantised_avx2, amx_int8
    (see ``features()``)."""
    return frozenset(torch.ops.cascade_kernels.features())


def step_orders_available() -> bool:
    """Whether the bf16 weight kernel has both one-row orders (``Tuning.step_in_memory_order``): its
    AVX512-BF16 build does, the AVX2 one reads in one order only."""
    return weight_kernel_available() and "avx512_bf16" in compiled_features()


QUANTISED_FEATURES = frozenset({"avx512_vnni", "quantised_avx2"})
"""The instruction sets the int8 and 4-bit kernels take (``quantised_rows.h``): AVX512-VNNI's byte quad
products, or AVX2 with FMA and F16C (two instructions for each of VNNI's, the same sums)."""


@cache
def quantised_kernels_available() -> bool:
    """Whether ``torch.ops.cascade_kernels.rows_times_int8`` and ``rows_times_int4`` run here (both
    need AVX512-VNNI or AVX2; AMX-INT8 speeds the int8 one up)."""
    return weight_kernel_available() and bool(compiled_features() & QUANTISED_FEATURES)


@cache
def attention_kernel_available() -> bool:
    """Whether ``torch.ops.cascade_kernels.decode_attention`` runs here (it needs AVX512-BF16 or AVX2,
    as the weight kernel does; AMX only speeds its products up)."""
    return weight_kernel_available()


ATTENTION_HEAD_SIZES = (16, 32, 64, 128)
"""Head sizes ``decode_attention`` takes."""
