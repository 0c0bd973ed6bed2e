"""The import-layer contract of python/autoshard, checked by `make lint`.

Each package of autoshard is one layer; a module may import its own layer and the layers below,
never one above, and no two modules may import each other, directly or round a circle. Every
import counts, the ones made inside functions too. Layers, from the ground up:
"""

import ast
import os
import sys
from typing import Dict, List, Optional, Set

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "autoshard")

# Ground floor first. A root module (python/autoshard/<name>.py) is named by its module name.
LAYERS = [
    ("conventions", "what autoshard relies on of other libraries; imports nothing of autoshard"),
    ("_build_info", "written by setup.py"),
    ("core", "the compiled library, ops, split rule, styles, groups, collectives, per-model state"),
    ("tensor_io", "tensors in files, part by part"),
    ("nn", "the sharded layers"),
    ("runtime", "what a parallelized model runs while it trains"),
    ("state", "state_dict views for the tools that read a model by name"),
    ("optim", "fused sharded optimizers"),
    ("checkpoint", "sharded checkpoints"),
    ("pretrained", "Hugging Face safetensors checkpoints into sharded models"),
    ("constructs", "one class per construct the planner decides about"),
    ("inputs", "example inputs for planning"),
    ("capture", "a forward on meta recorded as the planner's graph"),
    ("apply", "a plan applied to a model"),
    ("planner", "the plan: made, frozen, printed, stored, predicted, dry-run"),
    ("parallelize", "the entry point that plans (if asked) and applies"),
    ("__main__", "the command line"),
    ("integrations", "trainers and tools of other libraries over a parallelized model"),
    ("__init__", "the public names"),
]
__doc__ += "\n".join(f"    {i:2}. {name}: {what}" for i, (name, what) in enumerate(LAYERS, 1))
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
EXTENSION = "_C"  # the compiled library, no Python module


def modules(root: str = PACKAGE) -> Dict[str, str]:
    """Every module of the package: dotted name below autoshard ('' for the package) -> path."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else
                      "" if dotted == "__init__" else dotted] = path
    return found


def layer_of(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


def imports_of(module: str, path: str, known: Dict[str, str]) -> Set[str]:
    """The autoshard modules `module` imports, anywhere in its file."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name[len("autoshard."):] if a.name != "autoshard" else ""
                       for a in node.names if a.name == "autoshard" or a.name.startswith("autoshard.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - node.level + 1]
                parent = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "autoshard" or (node.module or "").startswith("autoshard."):
                parent = node.module[len("autoshard."):] if node.module != "autoshard" else ""
            else:
                continue
            if parent not in known:
                raise ImportError(f"{path}:{node.lineno}: imports autoshard.{parent}, which is no module")
            targets = [f"{parent}.{a.name}".lstrip(".") if f"{parent}.{a.name}".lstrip(".") in known else parent
                       for a in node.names if a.name != EXTENSION]
        for target in targets:
            if target.split(".")[-1] == EXTENSION:
                continue
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != module:
                found.add(target)
    return found


def circle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One circle of the graph, or None."""
    colour: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if node not in colour:
            found = visit(node)
            if found:
                return found
    return None


def _dotted(module: str) -> str:
    return f"autoshard.{module}" if module else "autoshard"


def problems(root: str = PACKAGE) -> List[str]:
    known = modules(root)
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    found = []
    for module, targets in sorted(graph.items()):
        if layer_of(module) not in RANK:
            found.append(f"{known[module]}: in no layer; add its package to LAYERS in {__file__}")
            continue
        for target in sorted(targets):
            if RANK.get(layer_of(target), -1) > RANK[layer_of(module)]:
                found.append(f"{_dotted(module)} ({layer_of(module)}) imports {_dotted(target)}, "
                             f"of a higher layer ({layer_of(target)})")
    # A package's face (its __init__) imports its own modules; a module importing its package is
    # the circle Python resolves by the face importing first, so both directions count.
    ring = circle(graph)
    if ring:
        found.append("import circle: " + " -> ".join(_dotted(m) for m in ring))
    return found


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(line)
    print(f"{len(modules())} modules, {len(found)} problems", file=sys.stderr)
    sys.exit(1 if found else 0)
