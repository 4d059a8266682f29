"""Nothing in nonstop loads through pickle: a static check of every module.

torch.distributed's *_object collectives unpickle what the peers send (a
hostile or confused peer runs code on every rank); pickle, torch.load and
numpy's allow_pickle load arbitrary objects. nonstop exchanges JSON bytes
over tensors instead (_distributed._Comm.gather). The remote tier's
distributed restore used all_gather_object and broadcast_object_list until
session 5: this test failed on that code."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "nonstop"  # the source
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}


def _findings(path: pathlib.Path, root: pathlib.Path = PKG.parent) -> list:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            bad += [f"{where} imports {a.name}" for a in node.names
                    if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLE_MODULES:
                bad.append(f"{where} imports from {node.module}")
            bad += [f"{where} imports {a.name}" for a in node.names if a.name in OBJECT_COLLECTIVES]
        elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
            bad.append(f"{where} calls {node.attr} (unpickles what peers send)")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            if name == "load" and owner == "torch":
                bad.append(f"{where} calls torch.load")
            if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant)
                                                   and k.value.value is False)
                   for k in node.keywords):
                bad.append(f"{where} passes allow_pickle")
    return bad


def test_the_checker_sees_what_it_looks_for(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text("import pickle\nimport torch.distributed as d\nd.all_gather_object([], 1)\n"
                 "import torch\ntorch.load('x')\nimport numpy as np\n"
                 "np.load('x', allow_pickle=True)\nnp.load('x', allow_pickle=False)\n")
    found = _findings(p, tmp_path)
    assert len(found) == 4, found


def test_no_module_loads_through_pickle():
    modules = sorted(PKG.rglob("*.py"))
    assert len(modules) > 10
    bad = [b for m in modules for b in _findings(m)]
    assert not bad, "\n".join(bad)
