#!/usr/bin/env python3
"""Lists the C++ functions that choose a checkpoint; there must be one.

    check_choosers.py ROOT      prints the choosers; exit 1 unless exactly one
    check_choosers.py --self-test

A function chooses a checkpoint when it decides, by itself, which records
may be restored: it consults the lineage (a call of IsAbandoned or
NotDurable: a rollback is final), or it takes the store scan's
`newest_valid` (the newest record that verifies, blind to the lineage and
to the other tiers). Outside src/store (whose scan computes newest_valid)
every such use in src/ and tools/ (tests excluded) is attributed to the
function around it. The one chooser is the recovery planner's (src/plan/
plan.cc); everything else asks it (MakePlan, Classify).
"""
import os
import re
import sys
import tempfile

MARKERS = [
    (re.compile(r"(\.|->)\s*(IsAbandoned|NotDurable)\s*\("), "consults the lineage"),
    (re.compile(r"\bnewest_valid\b(?!\s*\"|\s*=[^=])"), "takes the scan's newest_valid"),
]
# A function definition starts at column 0 (or after "  " in a class body):
# a return type and name followed by "(" and ending in "{" within a few lines.
DEF_RE = re.compile(r"^(?:[A-Za-z_][\w:<>,*&\s]*?\s)?[*&]?((?:[A-Za-z_]\w*::)*~?[A-Za-z_]\w*)\s*\(")
SKIP_NAMES = {"if", "for", "while", "switch", "return", "catch", "sizeof", "static_assert"}


def function_at(lines, i):
    """The name of the function whose body holds line i (a heuristic that
    fits this code base's clang-format style)."""
    for j in range(i, -1, -1):
        line = lines[j]
        if not line or line[0] in " \t}#/" and not line.startswith("  ") :
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent > 2:
            continue
        m = DEF_RE.match(line.lstrip(" "))
        if m and m.group(1) not in SKIP_NAMES and not m.group(1).isupper() and not line.rstrip().endswith(";"):
            return m.group(1)
    return "?"


def scan(root):
    found = {}
    for top in ("src", "tools"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith((".cc", ".h")) or name.endswith("_test.cc"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                if rel.startswith(os.path.join("src", "store") + os.sep):
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().split("\n")
                for i, line in enumerate(lines):
                    code = line.split("//", 1)[0]
                    for rx, what in MARKERS:
                        if rx.search(code):
                            found.setdefault((rel, function_at(lines, i)), (i + 1, what))
    return found


def check(root):
    found = scan(root)
    for (rel, fn), (line, what) in sorted(found.items()):
        print(f"{rel}:{line}: {fn} {what}")
    if len(found) != 1:
        print(f"check_choosers: {len(found)} C++ functions choose a checkpoint; there must be "
              f"one (the planner, src/plan/plan.cc): make the others ask MakePlan/Classify")
        return 1
    return 0


def self_test():
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "src", "plan"))
        os.makedirs(os.path.join(root, "tools"))
        with open(os.path.join(root, "src", "plan", "plan.cc"), "w") as f:
            f.write("std::optional<std::string> Abandoned(const LineageRecord& l, uint64_t c) {\n"
                    "  if (!l.IsAbandoned(c)) return std::nullopt;\n  return \"x\";\n}\n")
        assert check(root) == 0, "one chooser must pass"
        with open(os.path.join(root, "tools", "cmd.cc"), "w") as f:
            f.write("const Rec* Target(const Scan& s) {\n"
                    "  return &s.report.checkpoints[s.report.newest_valid];\n}\n")
        found = scan(root)
        assert (os.path.join("tools", "cmd.cc"), "Target") in found, found
        assert check(root) == 1, "a second chooser must fail"
        os.remove(os.path.join(root, "tools", "cmd.cc"))
        with open(os.path.join(root, "src", "plan", "other.cc"), "w") as f:
            f.write("void Engine::Open() {\n  for (auto& c : r) {\n"
                    "    if (lineage.IsAbandoned(c.counter)) continue;\n  }\n}\n")
        assert check(root) == 1, "a lineage test outside the planner must fail"
    print("check_choosers self-test: OK")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(check(sys.argv[1] if len(sys.argv) > 1 else "."))
