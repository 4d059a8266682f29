#!/usr/bin/env python3
"""Checks every #include of src/ and include/ against src/LAYERS.

    check_layers.py ROOT      exit 1 and one line per violation, or 0
    check_layers.py --self-test

src/LAYERS names the layers of src/, lowest first, each with the folders it
uses and the public headers (include/nonstop/) it owns. A file of folder F
(and a public header F owns) may include, with quotes:
  - "F/x.h" and "G/x.h" for every folder G that F uses, directly or through
    another folder;
  - "nonstop/x.h" when x.h is owned by F or by such a G;
  - "x.h" for a file beside it.
Anything else is a violation: a lower layer including a higher one, a folder
including a sibling it does not use, a path through "src/", tools/ or tests/.
Every folder of src/ with sources and every public header must be in
src/LAYERS. Tests (*_test.cc) link the whole engine and sit above every layer;
only their "src/..." includes are checked. Nothing under src/ may import a
Python module (the package hands the extension what it needs at import).
The build (cmake/Layers.cmake) makes the same folders libraries; this check
also covers the public headers, which every library can see.
"""
import os
import re
import sys
import tempfile

SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".inc", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
PY_IMPORT_RE = re.compile(r"\bmodule_::import\s*\(|\bPyImport_\w+\s*\(")


def read_layers(path):
    """{folder: (uses, headers)} in file order; raises ValueError."""
    layers = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([a-z_]+):([^|]*)\|(.*)", line)
            if not m:
                raise ValueError(f"{path}:{n}: expected 'folder: uses | headers'")
            name, uses, headers = m.group(1), m.group(2).split(), m.group(3).split()
            for u in uses:
                if u not in layers:
                    raise ValueError(f"{path}:{n}: {name} uses {u}, which is not on an earlier line")
            layers[name] = (uses, headers)
    return layers


def closure(layers):
    """{folder: set of folders it may include (itself and all below it)}."""
    out = {}
    for name, (uses, _) in layers.items():  # file order: uses are done already
        seen = {name}
        for u in uses:
            seen |= out[u]
        out[name] = seen
    return out


def includes(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = INCLUDE_RE.match(line)
            if m:
                yield n, m.group(1)


def check(root):
    """The list of violations, one line each."""
    errors = []
    try:
        layers = read_layers(os.path.join(root, "src", "LAYERS"))
    except (OSError, ValueError) as e:
        return [str(e)]
    allowed = closure(layers)
    owner = {}
    for name, (_, headers) in layers.items():
        for h in headers:
            if h in owner:
                errors.append(f"src/LAYERS: nonstop/{h} is owned by both {owner[h]} and {name}")
            owner[h] = name

    def check_include(rel, folder, n, inc, is_test):
        where = f"{rel}:{n}: #include \"{inc}\""
        if inc.startswith(("src/", "../")) or "/../" in inc:
            errors.append(f"{where}: include a layer's header as \"<folder>/<file>\", not by path")
            return
        if is_test:
            return
        first, _, rest = inc.partition("/")
        if not rest:
            if not os.path.isfile(os.path.join(root, os.path.dirname(rel), inc)):
                errors.append(f"{where}: not a file beside it")
            return
        if first == "nonstop":
            h_owner = owner.get(rest)
            if h_owner is None:
                errors.append(f"{where}: nonstop/{rest} is owned by no layer in src/LAYERS")
            elif h_owner not in allowed[folder]:
                errors.append(f"{where}: {folder} may not use {h_owner} (src/LAYERS)")
        elif first in layers:
            if first not in allowed[folder]:
                errors.append(f"{where}: {folder} may not use {first} (src/LAYERS)")
        else:
            errors.append(f"{where}: {first}/ is not a layer of src/")

    # Public headers: each belongs to the layer that owns it.
    inc_dir = os.path.join(root, "include", "nonstop")
    for h in sorted(os.listdir(inc_dir)) if os.path.isdir(inc_dir) else []:
        if not h.endswith(SOURCE_EXT):
            continue
        rel = f"include/nonstop/{h}"
        if h not in owner:
            errors.append(f"{rel}: owned by no layer: add it to a line of src/LAYERS")
            continue
        for n, inc in includes(os.path.join(inc_dir, h)):
            if inc.partition("/")[0] != "nonstop":
                errors.append(f"{rel}:{n}: #include \"{inc}\": a public header includes only nonstop/")
            else:
                check_include(rel, owner[h], n, inc, False)

    src = os.path.join(root, "src")
    for folder in sorted(os.listdir(src)):
        fdir = os.path.join(src, folder)
        if not os.path.isdir(fdir):
            continue
        files = []
        for dirpath, _, names in os.walk(fdir):
            files += [os.path.join(dirpath, f) for f in names if f.endswith(SOURCE_EXT)]
        if not files:
            continue
        if folder not in layers:
            errors.append(f"src/{folder}: not in src/LAYERS: add a line saying what it uses")
            continue
        for path in sorted(files):
            rel = os.path.relpath(path, root)
            is_test = os.path.basename(path).endswith("_test.cc")
            for n, inc in includes(path):
                check_include(rel, folder, n, inc, is_test)
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    if PY_IMPORT_RE.search(line.split("//", 1)[0]):
                        errors.append(f"{rel}:{n}: C++ imports a Python module; have the package "
                                      "hand the extension what it needs at import")
    for name in layers:
        if not os.path.isdir(os.path.join(src, name)):
            errors.append(f"src/LAYERS: {name}: no folder src/{name}")
    return errors


def self_test():
    """The checker finds each kind of violation in a small tree, and passes a clean one."""
    def tree(files):
        d = tempfile.mkdtemp(prefix="check_layers_")
        for rel, text in files.items():
            p = os.path.join(d, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
        return d

    layers = "base: | status.h\nlow: base | low.h\nside: base |\nhigh: low | high.h\n"
    clean = {
        "src/LAYERS": layers,
        "include/nonstop/status.h": "#pragma once\n",
        "include/nonstop/low.h": '#include "nonstop/status.h"\n',
        "include/nonstop/high.h": '#include "nonstop/low.h"\n',
        "src/base/a.cc": '#include "nonstop/status.h"\n',
        "src/low/l.h": '#include "base/x.h"\n',
        "src/low/l.cc": '#include "low/l.h"\n#include "l.h"\n#include <vector>\n',
        "src/side/s.cc": '#include "nonstop/status.h"\n',
        "src/high/h.cc": '#include "low/l.h"\n#include "base/x.h"\n#include "nonstop/low.h"\n',
        "src/base/x.h": "// py::module_::import(\"x\") in a comment is fine\n",
        "src/low/l_test.cc": '#include "high/h.h"\n',  # tests sit above every layer
    }
    cases = {
        "a lower layer includes a higher one's header":
            ({"src/low/l.cc": '#include "high/h.h"\n'}, "low may not use high"),
        "a lower layer includes a higher public header":
            ({"src/base/a.cc": '#include "nonstop/low.h"\n'}, "base may not use low"),
        "a layer includes a sibling it does not use":
            ({"src/side/s.cc": '#include "low/l.h"\n'}, "side may not use low"),
        "a public header includes a higher one":
            ({"include/nonstop/low.h": '#include "nonstop/high.h"\n'}, "low may not use high"),
        "a header by path through src/":
            ({"src/high/h.cc": '#include "src/low/l.h"\n'}, "not by path"),
        "a folder missing from src/LAYERS":
            ({"src/extra/e.cc": "\n"}, "src/extra: not in src/LAYERS"),
        "a public header owned by no layer":
            ({"include/nonstop/stray.h": "\n"}, "nonstop/stray.h: owned by no layer"),
        "C++ importing Python":
            ({"src/high/h.cc": 'auto m = py::module_::import("nonstop.errors");\n'},
             "imports a Python module"),
        "a layer using one below it on a later line":
            ({"src/LAYERS": layers.replace("low: base", "low: high")}, "not on an earlier line"),
    }
    failures = []
    got = check(tree(clean))
    if got:
        failures.append(f"clean tree: unexpected violations {got}")
    for what, (change, expect) in cases.items():
        got = check(tree({**clean, **change}))
        if not any(expect in e for e in got):
            failures.append(f"{what}: expected a violation with '{expect}', got {got}")
    for f in failures:
        print("self-test FAILED:", f)
    print(f"check_layers self-test: {len(cases) + 1 - len(failures)}/{len(cases) + 1} cases passed")
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: check_layers.py ROOT | --self-test")
        return 2
    errors = check(argv[1])
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} layering violation(s); src/LAYERS says which folder may use which")
        return 1
    print("layers: every #include of src/ and include/ follows src/LAYERS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
