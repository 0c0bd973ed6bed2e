"""Loads a library built with the CUDA kernels and checks that each op with a CPU kernel also
has a CUDA one. Runs without a GPU: it checks registration, not results.

usage: python build_tools/check_cuda_kernels.py <dir holding autoshard/_C*.so>
"""

import glob
import os
import sys

import torch

# Host-only by design: checkpoint file I/O copies bytes between host buffers.
HOST_ONLY = {"copy_byte_runs_"}


def main(package_root: str) -> int:
    libraries = glob.glob(os.path.join(package_root, "autoshard", "_C*.so"))
    if len(libraries) != 1:
        print(f"expected one autoshard/_C*.so under {package_root}, found {libraries}")
        return 1
    torch.ops.load_library(libraries[0])
    names = sorted(
        schema.name.split("::", 1)[1].split(".")[0]
        for schema in torch._C._jit_get_all_schemas()
        if schema.name.startswith("autoshard::")
    )
    names = sorted(set(names))
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    with_cpu = [n for n in names if has(f"autoshard::{n}", "CPU")]
    missing = [n for n in with_cpu if n not in HOST_ONLY and not has(f"autoshard::{n}", "CUDA")]
    print(f"{len(names)} autoshard ops; {len(with_cpu)} with a CPU kernel; "
          f"{len(with_cpu) - len(missing) - len(HOST_ONLY & set(with_cpu))} of them with a CUDA kernel too "
          f"(host-only by design: {sorted(HOST_ONLY & set(with_cpu))})")
    if missing:
        print(f"ops with a CPU kernel but no CUDA kernel: {missing}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
