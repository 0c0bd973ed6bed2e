"""A toolchain that links libstdc++ statically into shared objects (build_tools/link_flags.py):
a library formatting a number with a string stream, loaded after torch, against the same
library linked with autoshard's flags; and autoshard's own library exporting no libstdc++."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

import autoshard
from build_tools.link_flags import LOCAL_STATIC_ARCHIVES

SOURCE = r"""
#include <sstream>
#include <string>
extern "C" const char* format_numbers(long value) {
  static std::string kept;
  std::ostringstream out;
  out << "value " << value << " " << 2.5;
  kept = out.str();
  return kept.c_str();
}
"""

LOAD = """
import ctypes, sys
import torch  # loads the process's own libstdc++ first, as in any use of autoshard
library = ctypes.CDLL(sys.argv[1])
library.format_numbers.restype = ctypes.c_char_p
print(library.format_numbers(42).decode())
"""


def _static_libstdcxx_available() -> bool:
    if shutil.which("g++") is None:
        return False
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    return os.path.isabs(archive) and os.path.exists(archive)


def _formatted(tmp_path, name: str, flags: list) -> str:
    source = tmp_path / "format.cpp"
    source.write_text(SOURCE)
    library = tmp_path / f"{name}.so"
    # -Bsymbolic-functions: what Debian's and Ubuntu's Python link extensions with.
    subprocess.run(["g++", "-O2", "-fPIC", "-shared", "-static-libstdc++", "-Wl,-Bsymbolic-functions", *flags,
                    str(source), "-o", str(library)], check=True)
    result = subprocess.run([sys.executable, "-c", LOAD, str(library)], capture_output=True, text=True, timeout=120)
    return result.stdout.strip() if result.returncode == 0 else f"exit {result.returncode}"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _static_libstdcxx_available(),
                    reason="needs g++ and a static libstdc++ on Linux")
def test_statically_linked_libstdcxx_formats_numbers_with_our_link_flags(tmp_path):
    assert _formatted(tmp_path, "ours", LOCAL_STATIC_ARCHIVES) == "value 42 2.5"
    # Without the flags the copy's symbols are exported, and on this toolchain they break.
    unflagged = _formatted(tmp_path, "plain", [])
    print("without the flags:", unflagged)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_built_library_exports_no_libstdcxx():
    library = glob.glob(os.path.join(os.path.dirname(autoshard.__file__), "_C*.so"))[0]
    symbols = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True, check=True).stdout
    # std::ostream's and std::locale's members: defined here only if a libstdc++ copy leaked out.
    leaked = [line for line in symbols.splitlines() if "_ZNSo" in line or "_ZNSt6locale" in line]
    assert leaked == [], leaked[:5]
