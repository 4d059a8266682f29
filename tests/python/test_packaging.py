"""Packaging: py.typed, eager exports, import without the extension, and
`pip install .` from a read-only source tree (slow: it compiles the engine,
minutes on 2 cores; NONSTOP_PACKAGING_TEST=1 runs it; with ccache a second
run reuses the first one's objects)."""
import os
import shutil
import stat
import subprocess
import sys
import time
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


def _snapshot(root) -> dict:
    """path -> (mode, size, mtime_ns) of everything under `root`."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.skipif(os.environ.get("NONSTOP_PACKAGING_TEST") != "1",
                    reason="compiles the engine (minutes): set NONSTOP_PACKAGING_TEST=1")
@pytest.mark.timeout(3600)
def test_pip_install_from_a_read_only_tree(tmp_path):
    """`pip install .` from a read-only copy of the source tree (every file
    and folder without write permission; pip's build happens in a temporary
    folder) into a fresh venv that sees this environment's torch (never
    another: --no-build-isolation, --no-deps, -c constraints.txt). The tree
    is unchanged afterwards, and the installed package imports, has its
    extension, py.typed and CLI, and checkpoints and restores."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "build-*", ".venv", "__pycache__", "_core*.so", "*.egg-info"))
    for d, dirs, files in os.walk(src):
        for n in dirs + files:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    os.chmod(src, 0o555)
    before = _snapshot(src)
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
    # The build folder outside the tree; with ccache, compiled through it with
    # paths relative to tmp_path (CCACHE_BASEDIR), so a second run hits.
    opts = [f"--config-settings=build-dir={tmp_path / 'build'}"]
    env = dict(os.environ)
    if shutil.which("ccache"):
        opts += ["--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache",
                 "--config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache"]
        env["CCACHE_BASEDIR"] = str(tmp_path)
    t0 = time.monotonic()
    out = subprocess.run(pip + ["install", "-q", "--no-build-isolation", "--no-deps", *opts,
                                "-c", os.path.join(ROOT, "constraints.txt"), str(src)],
                         capture_output=True, text=True, timeout=3000, cwd=tmp_path, env=env)
    print(f"pip install .: {time.monotonic() - t0:.0f} s")
    after = _snapshot(src)
    for d, dirs, files in os.walk(src):  # let pytest remove it
        for n in dirs:
            os.chmod(os.path.join(d, n), 0o755)
    os.chmod(src, 0o755)
    assert out.returncode == 0, out.stderr[-3000:]
    assert after == before, sorted(set(after) ^ set(before))[:20]  # nothing written, no build-py/
    check = ("import nonstop, os, torch\n"
             "nonstop.build_info()\n"
             "assert os.path.isfile(os.path.join(os.path.dirname(nonstop.__file__), 'py.typed'))\n"
             "m = torch.nn.Linear(4, 3)\n"
             "ck = nonstop.Checkpointer('ck', state={'model': m}, every=1)\n"
             "ck.save(7).wait(); ck.close()\n"
             "c = nonstop.load('ck')\n"
             "assert c.step == 7 and torch.equal(c.tensors['model/weight'], m.weight.detach())\n"
             "print(torch.__version__)\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("2.13.0")  # the one torch, not another pulled in
    cli = venv / "bin" / "nonstop"
    if cli.exists():  # the wheel's CLI reads what the package wrote
        v = subprocess.run([str(cli), "verify", str(tmp_path / "ck")], capture_output=True,
                           text=True, timeout=120)
        assert v.returncode == 0 and v.stdout.startswith("OK: step 7"), v.stderr
