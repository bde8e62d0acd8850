import json,sys,collections,statistics as st
rows=[json.loads(l) for l in open(sys.argv[1])]
d=collections.defaultdict(dict)
for r in rows:
    k=(r['ranks'],r.get('bytes'),r.get('keys',1),r['op'])
    d[k].setdefault(r['build'],{})[r['round']]=r
for k in sorted(d):
    A=d[k].get('A',{});B=d[k].get('B',{})
    rs=sorted(set(A)&set(B))
    if not rs: continue
    ratios=[A[i]['store_s']/B[i]['store_s'] for i in rs]
    a=st.median(A[i]['store_s'] for i in rs); b=st.median(B[i]['store_s'] for i in rs)
    raw=st.median(B[i]['raw_s'] for i in rs)
    print(f"np{k[0]} {k[2]}x{k[1]} {k[3]:10s} A {a*1e6:8.1f} B {b*1e6:8.1f} us  A/B med {st.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})  B/raw {raw/b*100:.0f}%")
