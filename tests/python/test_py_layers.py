"""The imports of python/nonstop follow python/LAYERS: no circle, no import
inside a function (optional packages aside), no private name of another
module (tools/check_py_layers.py; also the ctest py_layers_check); the
Checkpointer is at most 300 lines and holds its mode as a driver; the
package is at most 6,000 lines (issue 23: adapters over the C++ engine, not
a second engine)."""
import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import check_py_layers  # noqa: E402


def test_the_package_follows_python_layers():
    errors, summary = check_py_layers.check(ROOT)
    assert errors == [], "\n".join(errors + [summary])


def test_the_checker_finds_each_kind_of_violation():
    assert check_py_layers.self_test() == 0


def _checkpointer_class():
    path = os.path.join(ROOT, "python", "nonstop", "_checkpointer.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer")


def test_the_checkpointer_class_is_at_most_300_lines():
    cls = _checkpointer_class()
    assert cls.end_lineno - cls.lineno + 1 <= 300


def test_the_package_is_at_most_6000_lines():
    pkg = os.path.join(ROOT, "python", "nonstop")
    lines = {}
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), encoding="utf-8") as f:
                lines[name] = len(f.read().splitlines())
    assert sum(lines.values()) <= 6000, sorted(lines.items(), key=lambda kv: -kv[1])


def test_the_checkpointer_never_branches_on_the_mode_name():
    # The mode is a driver behind one protocol (_session.Driver): no
    # comparison in the class names a mode.
    modes = {"concurrent", "layerwise", "multistep", "auto"}
    for node in ast.walk(_checkpointer_class()):
        if isinstance(node, ast.Compare):
            names = [c.value for c in [node.left, *node.comparators]
                     if isinstance(c, ast.Constant)]
            names += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.Set))
                      for e in c.elts if isinstance(e, ast.Constant)]
            assert not modes & set(names), ast.unparse(node)
