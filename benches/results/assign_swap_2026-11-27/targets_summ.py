import json,sys,collections,statistics as st
rows=[json.loads(l) for l in open(sys.argv[1])]
d=collections.defaultdict(list)
for r in rows:
    d[(r['ranks'],r.get('keys',1),r['bytes'],r['op'])].append(r)
for k in sorted(d):
    rs=d[k]
    ratio=[x['raw_s']/x['store_s'] for x in rs]
    print(f"np{k[0]} {k[1]}x{k[2]:>9} {k[3]:9s} store {st.median(x['store_s'] for x in rs)*1e6:9.1f} raw {st.median(x['raw_s'] for x in rs)*1e6:9.1f} us  raw/store med {st.median(ratio)*100:4.0f}% ({min(ratio)*100:.0f}-{max(ratio)*100:.0f})  n={len(rs)}")
