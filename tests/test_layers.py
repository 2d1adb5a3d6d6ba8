"""The package's folders are its layers, and no module imports from a layer above its own.

kernels (Triton kernels, their plans and launchers) < ops (the public operators, their
references, checks and roads) < patching (models: adapters, factories) < tools (CLI,
verify, bench). A module may import its own layer and those below; the package's
``__init__`` (lazy public names) and ``__main__`` sit above all. No modules import each
other, directly or around a circle, not even inside a function.
"""
import ast
import os

import timm_flashwin

PACKAGE = os.path.dirname(timm_flashwin.__file__)
LAYERS = ("kernels", "ops", "patching", "tools")
MAX_LINES = 400


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield path, os.path.relpath(path, PACKAGE).replace(os.sep, "/")


def _imported(path: str, rel: str, modules=()):
    """The package-relative dotted names ``path`` imports (relative and absolute imports); a
    name imported from a package that is one of ``modules`` (dotted) is that module."""
    package = rel.rsplit("/", 1)[0].split("/") if "/" in rel else []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("timm_flashwin."):
                base = node.module[len("timm_flashwin."):]
            else:
                continue
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("timm_flashwin."):
                    yield alias.name[len("timm_flashwin."):]


def test_no_module_imports_from_a_layer_above():
    wrong = []
    for path, rel in _modules():
        layer = rel.split("/")[0]
        if layer not in LAYERS:
            assert rel in ("__init__.py", "__main__.py"), f"{rel}: every module belongs to a layer folder {LAYERS}"
            continue
        for name in _imported(path, rel):
            target = name.split(".")[0]
            if target in LAYERS and LAYERS.index(target) > LAYERS.index(layer):
                wrong.append(f"{rel} imports {name}")
    assert not wrong, "imports from a layer above: " + "; ".join(wrong)


def test_no_file_over_400_lines():
    long = {rel: n for path, rel in _modules() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_import_circle():
    def dotted(rel):
        return rel[:-len(".py")].replace("/", ".").removesuffix(".__init__")
    paths = {dotted(rel): path for path, rel in _modules()}
    imports = {name: {t for t in _imported(path, path[len(PACKAGE) + 1:].replace(os.sep, "/"), paths)
                      if t in paths and t != name} for name, path in paths.items()}

    def back_to_itself(name):
        seen, todo = set(), [name]
        while todo:
            for target in imports[todo.pop()] - seen:
                if target == name:
                    return True
                seen.add(target)
                todo.append(target)
        return False
    circles = sorted(filter(back_to_itself, imports))
    assert not circles, f"modules that import themselves around a circle: {circles}"
