"""The imports of python/nonstop follow python/LAYERS: no circle, no import
inside a function (optional packages aside), no private name of another
module (tools/check_py_layers.py; also the ctest py_layers_check)."""
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
