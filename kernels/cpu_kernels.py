"""te_lab's hand-written C++ CPU kernels (``kernels/cpp/*.cpp``): the ``cpp`` backend.

On a CPU a fused op's time at notebook sizes is mostly the cost of reaching its kernels
from Python: the ``torch.autograd.Function``, the op's wrappers, the generated wrapper of
an Inductor graph. The C++ kernels here register each op's forward and backward, and its
autograd formula, under the op's own name (``te_lab::<op>`` with the overload ``cpp``), so
an eager call crosses from Python into C++ once and its backward runs inside autograd's
engine without returning to Python. Traces still show ``te_lab::<op>``.

They are compiled with ``torch.utils.cpp_extension`` (ninja and the machine's C++
compiler), for this machine's vector ISA, once: the first time an op asks for them, or
during set-up (:func:`main`, which ``make test`` and ``make demo`` run). The library
lands in te_lab's cache directory under a key of the sources, torch's version and the
flags, so a change of any rebuilds it; later processes load it in milliseconds. Where
it cannot be built (no compiler or ninja, or ``TE_LAB_CPP=off``),
:func:`unavailable_reason` says why and ops choose another backend.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from te_lab.cache import cache_directory

NAME = "te_lab_cpu_kernels"
ENV_VAR = "TE_LAB_CPP"
SOURCES = tuple(sorted((Path(__file__).parent / "cpp").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).parent / "cpp").glob("*.h")))
_BUILT = "built"  # written once the library is complete: another process may be mid-build

_reasons: dict[str, Optional[str]] = {}


# torch's CPU capability -> what at::vec::Vectorized needs to be built for it (as Inductor's
# generated C++ is); other capabilities get Vectorized's portable code.
_VECTOR_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}


def compiler_flags() -> list[str]:
    """-O3; OpenMP on Linux (``at::parallel_for`` threads, torch's own libgomp at run time);
    the vector ISA torch itself runs at on this machine (the build is per machine)."""
    flags = ["-O3"]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")
    return flags + _VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


def build_directory() -> Path:
    digest = hashlib.sha1()
    for source in SOURCES + HEADERS:  # a header's change rebuilds too
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(" ".join([torch.__version__, str(torch.version.git_version), platform.machine(),
                            *compiler_flags()]).encode())
    return cache_directory() / "cpu-kernels" / digest.hexdigest()[:16]


def _say(message: str) -> None:
    print(f"te_lab: {message}", file=sys.stderr, flush=True)


def build(progress: Callable[[str], None] = _say) -> Path:
    """Compile the kernels if this machine has no current build, and load them; the
    library's path. Raises what the compiler or ninja raised."""
    from torch.utils import cpp_extension

    directory = build_directory()
    library = directory / f"{NAME}.so"
    if not (directory / _BUILT).exists():
        cpp_extension.verify_ninja_availability()
        progress(f"building te_lab's C++ CPU kernels into {directory} "
                 "(once per machine and torch version, about a minute)...")
        directory.mkdir(parents=True, exist_ok=True)
        flags = compiler_flags()
        cpp_extension.load(name=NAME, sources=[str(source) for source in SOURCES], extra_cflags=flags,
                           extra_ldflags=[flag for flag in flags if flag == "-fopenmp"],
                           build_directory=str(directory), is_python_module=False, verbose=False)
        (directory / _BUILT).write_text(torch.__version__)
        progress("te_lab's C++ CPU kernels are built")
    else:
        torch.ops.load_library(str(library))
    return library


def _load() -> Optional[str]:
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting not in ("", "on", "off"):
        raise ValueError(f"{ENV_VAR}={setting!r}: expected 'on' or 'off'")
    if setting == "off":
        return f"{ENV_VAR}=off"
    try:
        build()
    except Exception as error:  # noqa: BLE001 - whatever the toolchain raised, the ops fall back
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"te_lab's C++ CPU kernels could not be built here ({first_line})"
    return None


@torch.compiler.assume_constant_result
def unavailable_reason() -> Optional[str]:
    """``None`` once the kernels are loaded in this process (built first if need be),
    else why they cannot be; decided once per process."""
    if "cpu" not in _reasons:
        _reasons["cpu"] = _load()
    return _reasons["cpu"]


def main() -> int:
    """Build (or find) the kernels and say where: set-up's step (the Makefile)."""
    reason = unavailable_reason()
    if reason is not None:
        _say(reason)
        return 1
    _say(f"C++ CPU kernels ready in {build_directory()}")
    return 0

