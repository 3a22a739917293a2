#!/usr/bin/env python3
"""check_serve_swap.py PORT CLIENTS BLOCK_BYTES [recompute] — preemption through `flotilla serve`
(tests/test_serve.sh starts it on a byte-tokenizer fixture with a 1 MiB KV
cache): CLIENTS completions at once, each 21..51 prompt tokens and 72
generated (EOS ignored), several times what the cache holds, so the
scheduler preempts. /metrics (parsed by prometheus_client, prom_check.py)
must carry flotilla_preemptions_total by kind, swap and recompute, with
swaps counted and flotilla_swapped_bytes_total > 0 after the run (whole
KV blocks of BLOCK_BYTES, at least one a swap), the pool
seen in use while it ran, and both usage gauges in [0, 1], the pool empty
once every request is done. With `recompute` (a server with --swap-space
0) every preemption counts as recompute, none as swap, and nothing moves.
Prints one "ok - ..." line per check; exits 1 at the first failure."""
import http.client
import json
import sys
import threading
import time

import serve_util
from serve_util import check

port, CLIENTS, BLOCK = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
SWAPS = sys.argv[4:] != ["recompute"]
MAX = 72
SWAP, RECOMPUTE = 'flotilla_preemptions_total{kind="swap"}', 'flotilla_preemptions_total{kind="recompute"}'
BYTES, KV, POOL = "flotilla_swapped_bytes_total", "flotilla_kv_cache_usage_ratio", "flotilla_kv_swap_pool_usage_ratio"




def metrics():
    return serve_util.scrape(port)


def run_client(i, out):
    p = (f"Request {i:02d}: " + "tell me a story " * (1 + i % 3))[:51]
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": p, "max_tokens": MAX, "ignore_eos": True,
                                                              "temperature": 0}).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out[i] = (r.status, json.loads(r.read()))
        c.close()
    except Exception as e:  # noqa: BLE001 - reported below
        out[i] = (0, repr(e))


m0 = metrics()
check(all(k in m0 for k in (SWAP, RECOMPUTE, BYTES, KV, POOL)),
      f"/metrics has {SWAP}, {RECOMPUTE}, {BYTES}, {KV}, {POOL}")
check(m0[SWAP] == 0 and m0[RECOMPUTE] == 0 and m0[BYTES] == 0 and m0[POOL] == 0,
      "nothing preempted or swapped before the first request")

out = [None] * CLIENTS
ts = [threading.Thread(target=run_client, args=(i, out)) for i in range(CLIENTS)]
for t in ts:
    t.start()
pool_seen, kv_seen, bad_gauge = 0.0, 0.0, []
while any(t.is_alive() for t in ts):
    m = metrics()
    if not (0 <= m[KV] <= 1 and 0 <= m[POOL] <= 1):
        bad_gauge.append((m[KV], m[POOL]))
    pool_seen, kv_seen = max(pool_seen, m[POOL]), max(kv_seen, m[KV])
    time.sleep(0.05)
for t in ts:
    t.join()
errs = [o for o in out if not o or o[0] != 200 or o[1]["usage"]["completion_tokens"] != MAX]
check(not errs, f"{CLIENTS} concurrent completions of {MAX} tokens each answered {errs[:2]}")
check(not bad_gauge, f"usage gauges stay in [0, 1] {bad_gauge[:3]}")
check((pool_seen > 0) == SWAPS and kv_seen > 0.5,
      f"while the requests ran, the swap pool was {'in use' if SWAPS else 'unused'} (peak {pool_seen:.3f}) and "
      f"the cache filled (peak {kv_seen:.3f})")

deadline = time.monotonic() + 20
while True:  # the gauges follow the engine's next loop
    m1 = metrics()
    if (m1["flotilla_requests_running"] == 0 and m1[POOL] == 0) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
print(f"# preemptions: {m1[SWAP]:g} swap, {m1[RECOMPUTE]:g} recompute; {m1[BYTES]:.0f} bytes swapped out")
if SWAPS:
    check(m1[SWAP] > 0 and m1[BYTES] > 0 and m1[RECOMPUTE] >= 0,
          f"a run that overfills the cache swaps: {SWAP} {m1[SWAP]:g} > 0, {BYTES} {m1[BYTES]:g} > 0")
    check(m1[BYTES] % BLOCK == 0 and m1[BYTES] >= m1[SWAP] * BLOCK,
          f"swapped bytes are whole blocks of {BLOCK} bytes, at least one a swap")
else:
    check(m1[RECOMPUTE] > 0 and m1[SWAP] == 0 and m1[BYTES] == 0,
          f"--swap-space 0: preemptions by recompute only ({RECOMPUTE} {m1[RECOMPUTE]:g}, {SWAP} {m1[SWAP]:g}, "
          f"{BYTES} {m1[BYTES]:g})")
check(m1[POOL] == 0 and m1["flotilla_requests_running"] == 0,
      f"once every request is done the swap pool is empty ({m1[POOL]:g}) and nothing runs")
