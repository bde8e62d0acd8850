#!/usr/bin/env python3
"""Non-test lines of src/ at each git revision given (default HEAD): non-blank lines of the .rs
files, leaving out *tests.rs files and every item under #[cfg(test)] (a module, a function, a
use). Comments count: they are part of what a reader reads. With --files, per file, for the
first revision against the last.

    python3 scripts/count-src-lines.py 5a13e0f HEAD
    python3 scripts/count-src-lines.py --files 5a13e0f HEAD
"""

import subprocess
import sys

from rust_items import strip_tests


def per_file(rev):
    names = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "src"], text=True)
    counts = {}
    for name in names.split():
        if not name.endswith(".rs") or name.endswith("tests.rs"):
            continue
        text = subprocess.check_output(["git", "show", f"{rev}:{name}"], text=True)
        counts[name] = sum(1 for line in strip_tests(text).split("\n") if line.strip())
    return counts


def main(args):
    files = "--files" in args
    revs = [a for a in args if a != "--files"] or ["HEAD"]
    counts = [per_file(r) for r in revs]
    if files and len(counts) > 1:
        a, b = counts[0], counts[-1]
        for name in sorted(set(a) | set(b), key=lambda n: -b.get(n, 0)):
            print(f"{a.get(name, 0):6} {b.get(name, 0):6} {b.get(name, 0) - a.get(name, 0):+6} {name}")
    for rev, c in zip(revs, counts):
        print(f"{rev} {sum(c.values())}")


if __name__ == "__main__":
    main(sys.argv[1:])
