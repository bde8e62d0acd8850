#!/usr/bin/env python3
"""Checks that every relative link in the project's Markdown resolves: the file or folder it
names exists, and an anchor (`#...`) names a heading of the target file (GitHub's slugs).

    scripts/check-doc-links.py            # README.md, BENCHMARKS.md, docs/, benches/results/history/
    scripts/check-doc-links.py FILE...    # those files only

Prints each broken link as `file:line: target (why)` and exits 1 if there is one."""
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slugs(path):
    """GitHub's anchors for the headings of a Markdown file."""
    seen, out, fenced = {}, set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        text = re.sub(r"[^\w\- ]", "", m.group(1).lower().replace("`", ""))
        slug = text.replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def targets(path):
    fenced = False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        for m in LINK.finditer(line):
            yield no, m.group(1)
        m = REF.match(line)
        if m:
            yield no, m.group(1)


def check(path):
    bad = []
    for no, target in targets(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{os.path.relpath(path, ROOT)}:{no}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            bad.append(f"{os.path.relpath(path, ROOT)}:{no}: {target} (no such heading)")
    return bad


def main():
    if len(sys.argv) > 1:
        files = [Path(a).resolve() for a in sys.argv[1:]]
    else:
        files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
        files += sorted((ROOT / "docs").glob("*.md"))
        files += sorted((ROOT / "benches/results/history").glob("*.md"))
    bad = [b for f in files for b in check(f)]
    links = sum(1 for f in files for _ in targets(f))
    print("\n".join(bad) if bad else f"{len(files)} files, {links} links: all resolve")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
