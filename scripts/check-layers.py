#!/usr/bin/env python3
"""The crate's module imports, checked against its layers (docs/architecture.md, "Layers").

Lists every import between the files of src/ (test code left out: `*tests.rs` files and
`#[cfg(test)]` modules; imports of `error`, which every module makes for its `Result`, left out
too; a folder's mod.rs naming its own children is the folder's face, not an import), then:
- fails on a circle: files that import each other, directly or around a loop;
- counts the imports that run back up, from a lower layer to a higher one, and fails above
  the budget (`--max-up`, 8 by default);
- `--list` prints every import, `--up` the ones that run back up.

Usage: scripts/check-layers.py [--list] [--up] [--max-up N]
"""

import argparse
import re
import sys
from pathlib import Path

from rust_items import strip_tests

SRC = Path(__file__).resolve().parent.parent / "src"

# Layers, top first: a file may import its own layer and the layers below it. Each entry is
# a module path prefix; the longest prefix that matches a file's module path decides its layer.
LAYERS = [
    ("face", ["lib", "interop", "queue"]),
    ("store", ["store"]),
    ("checkpoint", ["checkpoint"]),
    ("ranks", ["comm::dist"]),
    ("link", ["comm::link"]),
    ("dispatch", ["comm"]),
    ("transports", ["comm::mpi", "comm::nccl"]),
    ("wire", ["comm::fingerprint", "comm::launch", "comm::spread"]),
    ("sparse", ["row_sparse"]),
    ("backend", ["backend"]),
    ("algorithms", ["compress", "updater", "ptx_text"]),
    ("leaves", ["ndarray", "host", "memcopy", "key", "shape", "dtype", "device", "config",
                "checkpoint_error",
                "error"]),
]


def module_of(path: Path) -> str:
    """`src/comm/dist/mod.rs` -> `comm::dist`; `src/lib.rs` -> `lib`."""
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    return "::".join(parts) if parts else "lib"


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + "::")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        sys.exit(f"check-layers: module {module} is in no layer: add it to LAYERS")
    return best


def uses(text: str):
    """Every `use` tree and inline `crate::`/`super::` path, as flat paths."""
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        yield from expand(flat(m.group(1)))
    for m in re.finditer(r"(?<![\w:])((?:crate|super)(?:::\w+)+)", text):
        yield m.group(1)


def flat(tree: str) -> str:
    """A `use` tree without its renames (`x as y`) and whitespace."""
    return re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))


def expand(tree: str):
    """`a::{b, c::{d}}` -> a::b, a::c::d."""
    i = tree.find("{")
    if i < 0:
        yield tree
        return
    head, body = tree[:i], tree[i + 1:tree.rfind("}")]
    depth, start = 0, 0
    for k, c in enumerate(body + ","):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            part = body[start:k]
            start = k + 1
            if part:
                yield from expand(head + part)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--up", action="store_true")
    ap.add_argument("--max-up", type=int, default=8)
    args = ap.parse_args()

    files = {}
    for f in sorted(SRC.rglob("*.rs")):
        if f.name.endswith("tests.rs") or f.name == "tests.rs":
            continue
        files[module_of(f)] = f
    modules = set(files)

    # Items the crate root re-exports: `crate::Error` is error.rs's.
    root_items = {}
    lib = files["lib"].read_text()
    for m in re.finditer(r"pub use\s+([^;]+);", lib):
        for p in expand(flat(m.group(1))):
            segs = p.split("::")
            root_items[segs[-1]] = "::".join(segs[:-1])

    def resolve(frm: str, path: str):
        segs = path.split("::")
        here = [] if frm == "lib" else frm.split("::")
        if segs[0] == "crate":
            cur, rest = [], segs[1:]
        elif segs[0] == "super":
            # Each `super` is the parent of the module so far (a file's module is its path).
            cur, rest = list(here), segs
            while rest and rest[0] == "super":
                cur, rest = cur[:-1], rest[1:]
        else:
            return None
        if not rest:
            return None
        if not cur and rest[0] in root_items and rest[0] not in modules:
            rest = root_items[rest[0]].split("::") + rest[1:]
            rest = [s for s in rest if s and s != "crate"]
        best, used = None, 0
        for n in range(1, len(rest) + 1):
            cand = "::".join(cur + rest[:n])
            if cand in modules:
                best, used = cand, n
        if best is None:
            best = "::".join(cur) or "lib"
        # An item a module re-exports (`pub use x::Y`) is the module's it comes from.
        if best in reexports and used < len(rest) and rest[used] in reexports[best]:
            return reexports[best][rest[used]]
        return best if best in modules else None

    reexports = {}
    for frm, f in files.items():
        if frm == "lib":
            continue
        text = strip_tests(re.sub(r"//[^\n]*", "", f.read_text()))
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", text):
            for p in expand(flat(m.group(1))):
                name = p.split("::")[-1]
                to = resolve(frm, p)
                if to and to != frm:
                    reexports.setdefault(frm, {})[name] = to

    edges = {}
    for frm, f in files.items():
        # Comments (doc links name paths too) are not imports.
        text = strip_tests(re.sub(r"//[^\n]*", "", f.read_text()))
        for path in uses(text):
            to = resolve(frm, path)
            if to and to != frm:
                edges.setdefault(frm, set()).add(to)

    # A folder's mod.rs naming its own children (`mod x; pub use x::Y`) is the folder's face,
    # not an import between rooms: leave parent -> child edges out.
    def is_child(frm, to):
        return frm != "lib" and to.startswith(frm + "::") or frm == "lib"

    # Every module returns the crate's `Result`, and error.rs names the leaf value types (a key,
    # a shape, a dtype) in its variants: imports of `error` are not arrows between rooms.
    graph = {
        m: {t for t in ts if not is_child(m, t) and t != "error"} for m, ts in edges.items()
    }

    if args.list:
        for m in sorted(graph):
            for t in sorted(graph[m]):
                print(f"{m} -> {t}")

    # Circles: strongly connected components of more than one file (Tarjan).
    index, low, stack, on, sccs = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(modules):
        if v not in index:
            visit(v)

    up = sorted((m, t) for m, ts in graph.items() for t in ts if layer_of(t) < layer_of(m))
    if args.up:
        for m, t in up:
            print(f"up: {m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})")
    for c in sccs:
        print(f"circle of {len(c)} files: {', '.join(c)}")
    print(f"check-layers: {len(modules)} files, {sum(map(len, graph.values()))} imports, "
          f"{len(sccs)} circles, {len(up)} running back up (at most {args.max_up})")
    if sccs or len(up) > args.max_up:
        sys.exit(1)


if __name__ == "__main__":
    main()
