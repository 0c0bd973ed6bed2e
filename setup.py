"""Builds autoshard's one extension library, ``autoshard._C``.

CUDA kernels are compiled when nvcc and torch agree on the CUDA version (major.minor) and the
CUDA headers on the include path come from that same version, even with no GPU visible;
otherwise they are skipped with one printed line. ``AUTOSHARD_BUILD_CUDA=0`` skips them and
``=1`` insists on them (a mismatch is then an error). The decision is
``build_tools/cuda_toolchain.py``.
"""

import glob
import os
import shutil
import sys

import torch
from setuptools import find_packages, setup


def _locate_cuda_home() -> None:
    # torch derives CUDA_HOME from the nvcc on PATH; an nvcc installed as /usr/local/bin/nvcc
    # then gives /usr/local, which holds no CUDA runtime to link. Prefer a directory that has one.
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []) + ["/usr/local/cuda"]
    for home in candidates:
        if glob.glob(os.path.join(home, "lib*", "libcudart.so*")):
            os.environ["CUDA_HOME"] = home
            return


_locate_cuda_home()
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.join(HERE, "python", "autoshard")
sys.path.insert(0, HERE)
from build_tools import cuda_toolchain  # noqa: E402
from build_tools.link_flags import extension_link_flags  # noqa: E402


def build_cuda() -> bool:
    """Decides once, prints the reason on one line, and returns whether to compile CUDA."""
    nvcc = None
    header_dirs = []
    if CUDA_HOME is not None:
        candidate = os.path.join(CUDA_HOME, "bin", "nvcc")
        nvcc = candidate if os.path.exists(candidate) else shutil.which("nvcc")
        header_dirs = [os.path.join(CUDA_HOME, "include")] + cuda_library_headers()
    decision = cuda_toolchain.decide(
        os.environ.get("AUTOSHARD_BUILD_CUDA", ""),
        nvcc=cuda_toolchain.nvcc_version(nvcc),
        torch_cuda=torch.version.cuda,
        header_versions={d: cuda_toolchain.header_cuda_version(d) for d in header_dirs},
    )
    print(f"autoshard: {decision.reason}", flush=True)
    return decision.build


def sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", pattern), recursive=True))


def write_build_info(with_cuda: bool) -> None:
    # Checked at import time, so that a library built against another torch fails with a
    # sentence instead of an undefined-symbol error.
    with open(os.path.join(PACKAGE_DIR, "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py at build time."""\n')
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"WITH_CUDA = {with_cuda!r}\n")


def cuda_library_headers() -> list:
    # A CUDA build of torch from pip brings the CUDA libraries' headers (cusparse.h,
    # cublas_v2.h, which torch's CUDA headers include) in its nvidia-* wheels; a bare nvcc
    # install may lack them.
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    try:
        import nvidia
    except ImportError:
        return []
    found = set()
    for root in nvidia.__path__:
        for header in glob.glob(os.path.join(root, "**", "include", "cusparse.h"), recursive=True):
            found.add(os.path.dirname(header))
    return sorted(found)


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
    include_dirs=[os.path.join(HERE, "csrc")] + (cuda_library_headers() if with_cuda else []),
    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
    extra_link_args=extension_link_flags(),
)
extension = CUDAExtension(**extension_kwargs) if with_cuda else CppExtension(**extension_kwargs)

setup(
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
