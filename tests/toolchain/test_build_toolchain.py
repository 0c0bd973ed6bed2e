"""The build's CUDA decision (build_tools/cuda_toolchain.py), with versions faked."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from build_tools import cuda_toolchain as ct  # noqa: E402

WHEEL = "/env/site-packages/nvidia/cu13/include"
TOOLKIT = "/usr/local/cuda-13.0/include"


def test_matching_versions_compile():
    d = ct.decide("", nvcc="13.0", torch_cuda="13.0", header_versions={TOOLKIT: "13.0", WHEEL: "13.0"})
    assert d.build and "13.0" in d.reason


def test_torch_newer_than_nvcc_is_skipped_with_both_versions():
    d = ct.decide("", nvcc="13.0", torch_cuda="13.2", header_versions={TOOLKIT: "13.0"})
    assert not d.build
    assert "13.0" in d.reason and "13.2" in d.reason and d.reason.startswith("CUDA kernels skipped")


def test_headers_from_another_toolkit_are_skipped():
    # The failure this guards against: torch and nvcc agree, but a wheel's headers are newer.
    d = ct.decide("", nvcc="13.0", torch_cuda="13.0", header_versions={TOOLKIT: "13.0", WHEEL: "13.2"})
    assert not d.build and WHEEL in d.reason and "13.2" in d.reason


def test_patch_levels_do_not_matter():
    d = ct.decide("", nvcc="13.0.88", torch_cuda="13.0", header_versions={WHEEL: "13.0"})
    assert d.build


def test_cpu_torch_or_no_nvcc_skip():
    assert not ct.decide("", nvcc="13.0", torch_cuda=None, header_versions={}).build
    assert not ct.decide("", nvcc=None, torch_cuda="13.0", header_versions={}).build


def test_directories_without_a_version_are_ignored():
    assert ct.decide("", nvcc="12.8", torch_cuda="12.8", header_versions={WHEEL: None}).build


def test_flag_zero_never_compiles():
    assert not ct.decide("0", nvcc="13.0", torch_cuda="13.0", header_versions={}).build


def test_flag_one_turns_a_mismatch_into_an_error_naming_versions_and_headers():
    with pytest.raises(ct.CudaToolchainError, match=r"13\.0.*13\.2") as info:
        ct.decide("1", nvcc="13.0", torch_cuda="13.0", header_versions={WHEEL: "13.2"})
    assert WHEEL in str(info.value) and "AUTOSHARD_BUILD_CUDA=1" in str(info.value)
    with pytest.raises(ct.CudaToolchainError, match=r"nvcc is CUDA 13\.0 but torch was built with CUDA 13\.2"):
        ct.decide("1", nvcc="13.0", torch_cuda="13.2", header_versions={})
    assert ct.decide("1", nvcc="13.0", torch_cuda="13.0", header_versions={WHEEL: "13.0"}).build


def test_bad_flag_value_is_named():
    with pytest.raises(ct.CudaToolchainError, match="AUTOSHARD_BUILD_CUDA must be 0 or 1, got 'yes'"):
        ct.decide("yes", nvcc="13.0", torch_cuda="13.0", header_versions={})


def test_version_readers(tmp_path):
    (tmp_path / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13020\n")
    assert ct.header_cuda_version(str(tmp_path)) == "13.2"
    assert ct.header_cuda_version(str(tmp_path / "missing")) is None
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    assert ct.nvcc_version(str(nvcc)) == "12.8"
    assert ct.nvcc_version(str(tmp_path / "no-nvcc")) is None
    assert ct.major_minor("13.0.88") == "13.0" and ct.major_minor("garbage") is None
