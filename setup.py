"""Builds autoshard's one extension library, ``autoshard._C``.

CUDA kernels are compiled whenever nvcc and a CUDA build of torch are present, even with
no GPU visible; ``AUTOSHARD_BUILD_CUDA=0`` skips them and ``=1`` insists on them.
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.join(HERE, "python", "autoshard")


def build_cuda() -> bool:
    flag = os.environ.get("AUTOSHARD_BUILD_CUDA", "").strip()
    available = CUDA_HOME is not None and torch.version.cuda is not None
    if flag == "0":
        return False
    if flag == "1":
        if not available:
            raise RuntimeError(
                "AUTOSHARD_BUILD_CUDA=1 needs nvcc (CUDA_HOME) and a CUDA build of torch; "
                f"found CUDA_HOME={CUDA_HOME!r}, torch.version.cuda={torch.version.cuda!r}"
            )
        return True
    if flag:
        raise RuntimeError(f"AUTOSHARD_BUILD_CUDA must be 0 or 1, got {flag!r}")
    return available


def sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", pattern), recursive=True))


def write_build_info(with_cuda: bool) -> None:
    # Checked at import time, so that a library built against another torch fails with a
    # sentence instead of an undefined-symbol error.
    with open(os.path.join(PACKAGE_DIR, "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py at build time."""\n')
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"WITH_CUDA = {with_cuda!r}\n")


with_cuda = build_cuda()
if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    # No GPU to ask: build for Hopper rather than torch's every-architecture default.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
write_build_info(with_cuda)

# No -std flag: torch.utils.cpp_extension picks the standard the installed torch needs.
cxx_flags = ["-O3", "-fopenmp"]
extension_kwargs = dict(
    name="autoshard._C",
    sources=sources("*.cpp") + (sources("*.cu") if with_cuda else []),
    include_dirs=[os.path.join(HERE, "csrc")],
    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
    extra_link_args=["-fopenmp"],
    define_macros=[("AUTOSHARD_WITH_CUDA", "1" if with_cuda else "0")],
)
extension = CUDAExtension(**extension_kwargs) if with_cuda else CppExtension(**extension_kwargs)

setup(
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
