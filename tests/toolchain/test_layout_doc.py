"""docs/layout.md names every module of python/autoshard, and its floors are the import layers
build_tools/check_layers.py enforces, in the same order."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PACKAGE = os.path.join(ROOT, "python", "autoshard")
GENERATED = {"_build_info.py"}  # written by setup.py


def _layout() -> str:
    with open(os.path.join(ROOT, "docs", "layout.md")) as f:
        return f.read()


def test_every_module_is_named():
    text = _layout()
    missing = []
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py") or name in GENERATED:
                continue
            path = os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
            if path.endswith("/__init__.py"):
                continue  # a package's face: its floor is named
            if f"`{path}`" not in text:
                missing.append(path)
    assert not missing, f"docs/layout.md does not name {missing}"


def test_floors_follow_the_import_layers():
    sys.path.insert(0, os.path.join(ROOT, "build_tools"))
    import check_layers

    floors = re.findall(r"^\| (\w+) \| `", _layout(), flags=re.M)
    # The doc's floor for the root modules: parallelize.py and __main__.py are "entry", __init__.py "face".
    doc_name = {"parallelize": "entry", "__main__": "entry", "__init__": "face"}
    expected = []
    for name, _ in check_layers.LAYERS:
        floor = doc_name.get(name, name)
        if name != "_build_info" and floor not in expected:
            expected.append(floor)
    assert floors == expected


def test_the_layer_check_passes():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "build_tools", "check_layers.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
