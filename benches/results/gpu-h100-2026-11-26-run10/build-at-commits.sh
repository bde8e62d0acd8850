#!/usr/bin/env bash
# Builds the kv bench binary at each commit, sharing one target dir.
set -u
cd /work/main
for c in "$@"; do
  d=/work/bisect/wt-$c
  [ -d $d ] || git worktree add -q --detach $d $c
  (cd $d && CARGO_TARGET_DIR=/work/bisect/target cargo bench --offline --no-run --bench kv --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    try: m=json.loads(l)
    except: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="kv": print(m["executable"])' > /work/bisect/path-$c)
  p=$(cat /work/bisect/path-$c)
  mkdir -p /work/main/.gpu-bundle/bisect && cp "$p" /work/main/.gpu-bundle/bisect/kv-$c && strip --strip-debug /work/main/.gpu-bundle/bisect/kv-$c
  echo "built $c $(date +%T)"
done
