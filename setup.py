"""Build torch_ssd._C: CPU kernels always, CUDA kernels when torch has CUDA and nvcc exists.

Install with:  pip install --no-build-isolation -e .
(build isolation would pull a fresh, multi-GB torch; the build must see the installed one)

Environment:
  TORCH_SSD_CUDA=0|1       force the CUDA build off / on (default: auto-detect)
  TORCH_CUDA_ARCH_LIST     CUDA targets (default here: "8.0;9.0")
  TORCH_SSD_DEBUG=1        -O0 -g
  TORCH_SSD_CPU_CLONES=0   compile the CPU kernels for the baseline x86-64 ISA only, without
                           the AVX2 / AVX-512 clones (a much faster build, slower CPU kernels,
                           the same results: for GPU machines, where the CPU kernels only
                           serve as a cross-check)
  TORCH_SSD_CPU_OPT=0..3   the C++ sources' optimisation level (default 3). 1 compiles
                           csrc/cpu/ssd_cpu.cpp about 7x faster than 3 (it is the longest
                           file of a CUDA build); the kernels are slower, the results the
                           same (no fast-math, no FMA contraction at any level)
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    forced = os.environ.get("TORCH_SSD_CUDA")
    if forced is not None:
        return forced == "1"
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def openmp_flags() -> list[str]:
    """at::parallel_for spreads the CPU kernels over torch's OpenMP threads only in
    code compiled with OpenMP; without -fopenmp they silently run on one thread."""
    import torch

    return ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []


def extension():
    debug = os.environ.get("TORCH_SSD_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # -ffp-contract=off: no silent FMA contraction, so the vector and the scalar
    # path of a kernel round identically (DESIGN.md: layout never changes the answer).
    # No -std here: torch's build helper adds the standard its headers need
    # (C++20 since torch 2.10; torch 2.14's headers no longer compile as C++17).
    omp = openmp_flags()
    cxx = opt + ["-ffp-contract=off", "-fvisibility=hidden"] + omp
    if os.environ.get("TORCH_SSD_CPU_CLONES") == "0":
        cxx.append("-DSSD_CPU_NO_CLONES")
    cpu_opt = os.environ.get("TORCH_SSD_CPU_OPT")
    if cpu_opt is not None and not debug:
        if cpu_opt not in ("0", "1", "2", "3"):
            raise SystemExit(f"setup.py: TORCH_SSD_CPU_OPT must be 0, 1, 2 or 3, not {cpu_opt!r}")
        cxx[0] = f"-O{cpu_opt}"
    sources = ["csrc/ssd.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    if not want_cuda():
        return cpp_extension.CppExtension(
            "torch_ssd._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=omp, py_limited_api=False
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # --fmad=false: like -ffp-contract=off above, no silent FMA contraction, so every
    # template instantiation of a kernel (vector / gather path, per-N / splat A)
    # rounds the same expression the same way.
    nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo", "--fmad=false"]
    if os.environ.get("TORCH_SSD_PTXAS_V"):
        nvcc.append("-Xptxas=-v")
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    return cpp_extension.CUDAExtension(
        "torch_ssd._C", sources, extra_compile_args={"cxx": cxx + ["-DTORCH_SSD_WITH_CUDA"], "nvcc": nvcc},
        extra_link_args=omp,
    )


class BuildPyWithMetal(build_py):
    """Ship the Metal kernel sources inside the package: csrc/metal/*.metal ->
    torch_ssd/metal/ in the build tree (a checkout finds them in csrc/metal)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "torch_ssd", "metal")
        self.mkpath(target)
        for source in sorted(glob.glob(os.path.join(ROOT, "csrc", "metal", "*.metal"))):
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


setup(
    name="torch_ssd",
    version="0.1.0",
    description="Mamba-2 / SSD decode-step kernels as torch.ops.ssd custom ops (CPU, CUDA, MPS)",
    packages=find_packages(include=["torch_ssd", "torch_ssd.*"]),
    ext_modules=[extension()],
    cmdclass={
        "build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True),
        "build_py": BuildPyWithMetal,
    },
    python_requires=">=3.10",
    install_requires=["torch>=2.7"],
    extras_require={
        "plot": ["matplotlib"],
        "transformers": ["transformers>=5.24,<6"],
        "test": ["pytest", "expecttest", "hypothesis"],
    },
)
