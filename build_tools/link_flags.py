"""The flags autoshard's extension library is linked with.

Some toolchains (a newer GCC installed beside the system's, as on some GPU images) link
libstdc++ statically into every shared object they make. The copy's symbols are exported, and
once torch has loaded the process's own libstdc++ the dynamic linker binds some of them to that
one and some to the copy: the copy's string streams then find no number formatting in their
locale, so formatting an integer writes nothing (GCC 12) or crashes (GCC 13), and every plan,
which is JSON written with a stream, fails. Keeping the symbols of static archives local keeps
each copy whole; with a dynamically linked libstdc++ the flag changes nothing."""

import sys

OPENMP = ["-fopenmp"]
# GNU ld and lld take it; macOS's linker does not (nor does it link libstdc++ statically).
LOCAL_STATIC_ARCHIVES = ["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else []


def extension_link_flags() -> list:
    return OPENMP + LOCAL_STATIC_ARCHIVES
