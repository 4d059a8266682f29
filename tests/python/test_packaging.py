"""Packaging: py.typed, eager exports, import without the extension, and
`pip install .` from a read-only source tree (slow: it compiles the engine;
set NONSTOP_PACKAGING_TEST=1 to run it)."""
import os
import shutil
import stat
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "python", "nonstop")


def test_py_typed_and_eager_exports():
    import nonstop
    assert os.path.isfile(os.path.join(PKG, "py.typed"))
    # bound in the module itself (what IDEs and mypy see), not via __getattr__
    for name in ("Checkpointer", "CheckpointHandle", "load", "export", "LoadedCheckpoint",
                 "Preempted"):
        assert name in vars(nonstop), name
    for name in nonstop.__all__:
        assert hasattr(nonstop, name), name


def test_no_build_dir_in_the_source_tree_by_default():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        sk = tomllib.load(f)["tool"]["scikit-build"]
    assert "build-dir" not in sk  # a temporary one: the source tree may be read-only
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "-Cbuild-dir=" in f.read()  # the editable install keeps its own


def test_import_without_the_extension(tmp_path):
    shutil.copytree(PKG, tmp_path / "nonstop",
                    ignore=shutil.ignore_patterns("_core*", "__pycache__"))
    # `make build`'s editable install puts a finder for nonstop ahead of
    # sys.path (scikit-build-core's _editable_skbc_nonstop); drop it so that
    # the copy without the extension is the one imported.
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path\n"
            "                    if not type(f).__module__.startswith('_editable_skbc_')]\n"
            "import nonstop\n"
            "assert nonstop.__file__.startswith(%r), nonstop.__file__\n"
            "assert nonstop._core is None and nonstop.Checkpointer is not None\n"
            "try:\n    nonstop.build_info()\nexcept ImportError as e:\n    print('ok', e)\n"
            ) % str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok nonstop's C++ extension did not load")


@pytest.mark.skipif(os.environ.get("NONSTOP_PACKAGING_TEST") != "1",
                    reason="compiles the engine (minutes): set NONSTOP_PACKAGING_TEST=1")
@pytest.mark.timeout(3600)
def test_pip_install_from_a_read_only_tree(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "build-*", ".venv", "__pycache__", "_core*.so", "*.egg-info"))
    for d, dirs, files in os.walk(src):
        for n in dirs + files:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    os.chmod(src, 0o555)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    # torch and the build tools of this environment, seen (not copied) by the new one
    import torch
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "here.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    out = subprocess.run(pip + ["install", "-q", "--no-build-isolation", "--no-deps",
                                "-c", os.path.join(ROOT, "constraints.txt"), str(src)],
                         capture_output=True, text=True, timeout=3000)
    os.chmod(src, 0o755)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not os.path.exists(src / "build-py")
    check = ("import nonstop, os, torch; nonstop.build_info(); "
             "assert os.path.isfile(os.path.join(os.path.dirname(nonstop.__file__), 'py.typed')); "
             "print(torch.__version__)")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("2.13.0")  # the one torch, not another pulled in
