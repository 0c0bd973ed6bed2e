"""Decides whether the CUDA kernels can be compiled, before the build starts.

The CUDA kernels are optional: a machine with an ``nvcc`` whose CUDA differs from torch's, or
whose headers come from another toolkit, must still build the CPU library rather than stop on
``#error "CUDA compiler and CUDA toolkit headers are incompatible"`` deep inside the build.
Everything here is plain Python with no torch import, so the decision can be tested with faked
versions.
"""

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional


class CudaToolchainError(RuntimeError):
    """``AUTOSHARD_BUILD_CUDA=1`` was set but the CUDA kernels cannot be compiled."""


@dataclass(frozen=True)
class CudaDecision:
    build: bool
    # One line for the build log: why the kernels are (not) compiled, naming the versions.
    reason: str


def major_minor(version: Optional[str]) -> Optional[str]:
    """``"13.0.88"`` -> ``"13.0"``; ``None`` or an unparsable string -> ``None``."""
    if not version:
        return None
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def nvcc_version(nvcc: Optional[str]) -> Optional[str]:
    """The ``release X.Y`` that ``nvcc --version`` prints, or ``None`` when it cannot be run."""
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def header_cuda_version(include_dir: str) -> Optional[str]:
    """The CUDA runtime version a header directory declares (``CUDART_VERSION 13000`` -> ``"13.0"``),
    or ``None`` when the directory holds no ``cuda_runtime_api.h``."""
    path = os.path.join(include_dir, "cuda_runtime_api.h")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{(number % 1000) // 10}"


def decide(
    flag: str,
    nvcc: Optional[str],
    torch_cuda: Optional[str],
    header_versions: Mapping[str, Optional[str]],
) -> CudaDecision:
    """Whether to compile the CUDA kernels.

    ``flag`` is ``AUTOSHARD_BUILD_CUDA`` ("" for unset, "0" or "1"); ``nvcc`` is nvcc's release
    (``None`` when there is no nvcc); ``torch_cuda`` is ``torch.version.cuda`` (``None`` for a
    CPU build); ``header_versions`` maps each CUDA header directory the build would put on the
    include path to the runtime version it declares (``None`` when it declares none).

    Compiles only when nvcc and torch agree on major.minor and every header directory that
    declares a version declares nvcc's. ``flag="0"`` never compiles; ``flag="1"`` turns every
    reason not to compile into a ``CudaToolchainError`` naming both versions.
    """
    flag = (flag or "").strip()
    if flag not in ("", "0", "1"):
        raise CudaToolchainError(f"AUTOSHARD_BUILD_CUDA must be 0 or 1, got {flag!r}")
    if flag == "0":
        return CudaDecision(False, "CUDA kernels skipped: AUTOSHARD_BUILD_CUDA=0")

    problem = None
    nvcc_mm, torch_mm = major_minor(nvcc), major_minor(torch_cuda)
    if nvcc_mm is None:
        problem = f"no usable nvcc found (torch CUDA {torch_cuda or 'none: a CPU build'})"
    elif torch_mm is None:
        problem = f"torch {'is a CPU build' if torch_cuda is None else f'reports CUDA {torch_cuda!r}'} (nvcc {nvcc})"
    elif nvcc_mm != torch_mm:
        problem = f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch_cuda}"
    else:
        for include_dir, version in sorted(header_versions.items()):
            if version is not None and major_minor(version) != nvcc_mm:
                problem = (
                    f"nvcc is CUDA {nvcc} (torch CUDA {torch_cuda}) but the headers in "
                    f"{include_dir} are CUDA {version}"
                )
                break

    if problem is None:
        return CudaDecision(True, f"CUDA kernels compiled: nvcc CUDA {nvcc}, torch CUDA {torch_cuda}")
    if flag == "1":
        raise CudaToolchainError(f"AUTOSHARD_BUILD_CUDA=1 but the CUDA kernels cannot be compiled: {problem}")
    return CudaDecision(False, f"CUDA kernels skipped: {problem}")
