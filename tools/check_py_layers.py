#!/usr/bin/env python3
"""Checks the imports of python/nonstop against python/LAYERS.

    check_py_layers.py ROOT      exit 1 and one line per violation, or 0
    check_py_layers.py --self-test

Every module of the package is parsed with `ast`; every import counts,
those inside functions and classes too. A violation is:
  - an import circle among the package's modules (one line per circle);
  - an import inside a function, unless of an optional third-party package
    named in OPTIONAL below (each with the reason it is imported late);
  - an import of a package module that python/LAYERS does not allow: a
    module may import only the modules it names and, through them, the
    modules those name (all on earlier lines), never one on a later line;
  - a module missing from python/LAYERS, or one named there that is gone;
  - a private name of another package module used from outside it:
    `from .m import _name` of a function or variable, `m._name`, or
    `obj._name` where _name is a private attribute set on `self`, or a
    private method, of a class of another module and of no class of this one (the owner's own methods
    are the only ones to touch it).
The C++ extension (`_core`) is the bottom, imported by `_ext` only.
tools/check_layers.py does the same for the #includes of src/.
"""
import ast
import os
import re
import sys
import tempfile

PKG = "nonstop"
# Optional third-party packages a function may import on first use: each is
# needed by one feature only and is not a dependency of the package.
OPTIONAL = {
    "lightning": "the Lightning callback (nonstop.lightning) only",
    "pytorch_lightning": "the Lightning callback, under its old name",
    "transformers": "the Hugging Face callback (nonstop.hf) only",
    "accelerate": "the Accelerate integration only",
    "torchdata": "StatefulDataLoader resume only",
    "obstore": "the remote tier (remote=) only",
    "safetensors": "the demo's weight files only",
    "tqdm": "export progress bars only, when installed",
    "matplotlib": "the demo's plot only",
}
# Parts of torch imported on first use: each costs over a second to import
# (torch 2.13 CPU: 1.2 s, 1.1 s) and only DTensor state or a DCP export uses it.
LAZY_TORCH = {
    "torch.distributed.tensor": "FSDP2/DTensor state only (1.2 s to import)",
    "torch.distributed.checkpoint": "the DCP export only (1.1 s to import)",
}


def read_layers(path):
    """{module: uses} in file order; raises ValueError."""
    layers = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*):(.*)", line)
            if not m:
                raise ValueError(f"{path}:{n}: expected 'module: the modules it imports'")
            name, uses = m.group(1), m.group(2).split()
            if name in layers:
                raise ValueError(f"{path}:{n}: {name} is named twice")
            for u in uses:
                if u not in layers:
                    raise ValueError(f"{path}:{n}: {name} uses {u}, which is not on an earlier line")
            layers[name] = uses
    return layers


def closure(layers):
    out = {}
    for name, uses in layers.items():
        seen = {name}
        for u in uses:
            seen |= out[u]
        out[name] = seen
    return out


class _Imports(ast.NodeVisitor):
    """Every import of one module: (line, target module or None, names,
    inside a function, top-level package of an absolute import)."""

    def __init__(self, modules):
        self.modules = modules
        self.depth = 0
        self.found = []   # (line, kind, value, in_function, names)

    def _func(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _func

    def visit_Import(self, node):
        for a in node.names:
            self.found.append((node.lineno, "abs", a.name, self.depth > 0, []))

    def visit_ImportFrom(self, node):
        names = [a.name for a in node.names]
        if node.level == 0:
            self.found.append((node.lineno, "abs", node.module, self.depth > 0, names))
        else:  # relative: the package is flat
            self.found.append((node.lineno, "rel", node.module or "", self.depth > 0, names))


def _self_private(tree):
    """Private attributes set on `self` in the classes of a module."""
    out = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for n in ast.walk(cls):
            targets = []
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            for t in targets:
                for e in ast.walk(t):
                    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                            and e.value.id == "self" and _private(e.attr)):
                        out.add(e.attr)
    return out


def _private_methods(tree):
    """Private methods of the classes of a module."""
    return {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(f.name)}


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _top_private(tree):
    """Private functions, classes and variables defined at a module's top level."""
    out = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out.add(t.id)
    return {x for x in out if _private(x)}


def scan(pkg_dir):
    """{module: (tree, imports)} for every .py of the package ('__init__' as PKG)."""
    out = {}
    files = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".py"))
    modules = {f[:-3] if f != "__init__.py" else PKG for f in files}
    modules.add("_core")  # the extension
    for f in files:
        name = f[:-3] if f != "__init__.py" else PKG
        with open(os.path.join(pkg_dir, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=f)
        v = _Imports(modules)
        v.visit(tree)
        out[name] = (tree, v.found)
    return out, modules


def edges(found, modules):
    """[(line, target module, in_function, names imported from it)] within the package,
    and [(line, absolute module, in_function)] outside it."""
    inner, outer = [], []
    for line, kind, value, in_fn, names in found:
        if kind == "rel":
            if value:
                inner.append((line, value.split(".")[0], in_fn, names))
            else:
                for n in names:
                    inner.append((line, n if n in modules else PKG, in_fn, []))
        else:
            parts = value.split(".")
            if parts[0] == PKG:
                if len(parts) > 1:
                    inner.append((line, parts[1], in_fn, names))
                else:
                    for n in names or [None]:
                        inner.append((line, n if n in modules else PKG, in_fn,
                                      [] if n in modules else [n] if n else []))
            else:
                outer.append((line, value, in_fn))
    return inner, outer


def circles(graph):
    """The strongly connected components with a cycle (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def check(root):
    """(violations, summary) for ROOT/python/nonstop against ROOT/python/LAYERS."""
    errors = []
    pkg_dir = os.path.join(root, "python", PKG)
    mods, modules = scan(pkg_dir)
    try:
        layers = read_layers(os.path.join(root, "python", "LAYERS"))
    except (OSError, ValueError) as e:
        errors.append(str(e))
        layers = None
    allowed = closure(layers) if layers is not None else None
    graph = {}
    in_function = 0
    privs = {m: _self_private(t) | _private_methods(t) for m, (t, _) in mods.items()}
    tops = {m: _top_private(t) for m, (t, _) in mods.items()}
    rel = lambda m: f"python/{PKG}/{'__init__' if m == PKG else m}.py"  # noqa: E731

    for m, (tree, found) in sorted(mods.items()):
        inner, outer = edges(found, modules)
        for line, target, in_fn, names in inner:
            where = f"{rel(m)}:{line}: imports {target}"
            if target != m:
                graph.setdefault(m, set()).add(target)
            if in_fn:
                in_function += 1
                errors.append(f"{where} inside a function: import it at the top, or move the code "
                              "that needs it to where it belongs")
            if target == "_core" and m != "_ext":
                errors.append(f"{where}: only _ext imports the extension; use _ext.core()")
            if allowed is not None and target != m and target in mods and m in allowed \
                    and target not in allowed[m]:
                errors.append(f"{where}: {m} may not use {target} (python/LAYERS)")
            for n in names:
                if _private(n) and n not in modules and target in tops and n in tops[target]:
                    errors.append(f"{rel(m)}:{line}: imports {target}.{n}, a private name of "
                                  f"another module")
        for line, value, in_fn in outer:
            if in_fn:
                top = value.split(".")[0]
                if top not in OPTIONAL and not any(value == k or value.startswith(k + ".")
                                                   for k in LAZY_TORCH):
                    in_function += 1
                    errors.append(f"{rel(m)}:{line}: imports {value} inside a function "
                                  "(only the optional packages of OPTIONAL and LAZY_TORCH may be)")
        mine = privs[m]
        others = set().union(*(p for k, p in privs.items() if k != m)) - mine
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and _private(n.attr)):
                continue
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Name) and v.id in mods and v.id != m and n.attr in tops[v.id]:
                errors.append(f"{rel(m)}:{n.lineno}: {v.id}.{n.attr}: a private name of another module")
            elif n.attr in others:
                owner = sorted(k for k, p in privs.items() if n.attr in p and k != m)
                errors.append(f"{rel(m)}:{n.lineno}: .{n.attr}: a private attribute or method "
                              f"of {', '.join(owner)}'s objects")
    if layers is not None:
        for m in sorted(mods):
            if m not in layers:
                errors.append(f"python/LAYERS: {m} is missing: add a line saying what it imports")
        for m in layers:
            if m not in mods and m != "_core":
                errors.append(f"python/LAYERS: {m}: no module {rel(m)}")
    for c in circles(graph):
        errors.append(f"import circle of {len(c)} modules: {' '.join(c)}")
    summary = (f"{len(mods)} modules, {sum(len(v) for v in graph.values())} package imports, "
               f"{in_function} imports inside functions (not optional packages), "
               f"{len(circles(graph))} circle(s)")
    return errors, summary


def self_test():
    """Each kind of violation in a small package, and a clean one passing."""
    def tree(files):
        d = tempfile.mkdtemp(prefix="check_py_layers_")
        for relp, text in files.items():
            p = os.path.join(d, relp)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
        return d

    P = f"python/{PKG}/"
    clean = {
        "python/LAYERS": "errors:\n_ext: errors\n_low: errors\n_high: _low _ext\n" + PKG + ": _high\n",
        P + "__init__.py": "from ._high import Thing\n",
        P + "errors.py": "class E(Exception):\n    pass\n",
        P + "_ext.py": "from . import _core\nfrom .errors import E\n",
        P + "_low.py": "from .errors import E\n\nclass Low:\n    def __init__(self):\n"
                       "        self._x = 1\n\n    def x(self):\n        return self._x\n",
        P + "_high.py": "import os\nfrom . import _low, _ext\n\n\nclass Thing:\n    def f(self):\n"
                        "        import obstore\n        return _low.Low().x()\n",
    }
    cases = {
        "a circle hidden in a function":
            ({P + "_low.py": "def f():\n    from . import _high\n"}, "import circle of 2 modules"),
        "an import inside a function":
            ({P + "_high.py": "def f():\n    import json\n"}, "imports json inside a function"),
        "a package import inside a function":
            ({P + "_high.py": "def f():\n    from ._low import Low\n"}, "inside a function"),
        "a lower layer importing a higher one":
            ({P + "_low.py": "from . import _high\n"}, "_low may not use _high"),
        "a sibling it does not use":
            ({P + "_low.py": "from ._ext import x\n"}, "_low may not use _ext"),
        "the extension imported outside _ext":
            ({P + "_high.py": "from . import _core\n"}, "only _ext imports the extension"),
        "a module missing from LAYERS":
            ({P + "_extra.py": "\n"}, "_extra is missing"),
        "a private attribute of another module's object":
            ({P + "_high.py": "def f(low):\n    return low._x\n"}, "a private attribute or method of _low"),
        "a private method of another module's object":
            ({P + "_low.py": "class Low:\n    def _m(self):\n        pass\n",
              P + "_high.py": "def f(low):\n    return low._m()\n"}, "private attribute or method of _low"),
        "a private function of another module":
            ({P + "_low.py": "def _helper():\n    pass\n",
              P + "_high.py": "from ._low import _helper\n"}, "a private name of another module"),
        "a module's private name through the module":
            ({P + "_low.py": "def _helper():\n    pass\n",
              P + "_high.py": "from . import _low\n_low._helper()\n"}, "_low._helper"),
        "a use of a module on a later line":
            ({"python/LAYERS": "errors:\n_ext: errors _high\n_low: errors\n_high: _low _ext\n"},
             "not on an earlier line"),
    }
    failures = []
    got, _ = check(tree(clean))
    if got:
        failures.append(f"clean package: unexpected violations {got}")
    for what, (change, expect) in cases.items():
        got, _ = check(tree({**clean, **change}))
        if not any(expect in e for e in got):
            failures.append(f"{what}: expected a violation with '{expect}', got {got}")
    for f in failures:
        print("self-test FAILED:", f)
    print(f"check_py_layers self-test: {len(cases) + 1 - len(failures)}/{len(cases) + 1} cases passed")
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: check_py_layers.py ROOT | --self-test")
        return 2
    errors, summary = check(argv[1])
    for e in errors:
        print(e)
    print(summary)
    if errors:
        print(f"{len(errors)} violation(s); python/LAYERS says which module may import which")
        return 1
    print("python layers: every import of python/nonstop follows python/LAYERS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
