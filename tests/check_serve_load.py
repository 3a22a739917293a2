#!/usr/bin/env python3
"""check_serve_load.py PORT FLOTILLA MODEL CLIENTS MAX_TOKENS — a loopback load
test of a running `flotilla serve` on the demo model (tests/test_serve_load.sh
starts it): CLIENTS clients at once, half completions and half chat, half of
each streamed, every answer checked against the same request sent alone
(greedy): the whole text, finish_reason, usage (prompt, completion, total),
ids and objects; streams chunk by chunk, ending with a usage chunk and
[DONE]. Four completion prompts with different answers catch answers sent to
the wrong client. Prints the latency percentiles, then checks /metrics.

The prompts share a long prefix padded to whole KV blocks (counted with
`flotilla tokenize`), so prefix caching leaves each request one or two
prompt tokens to compute: on the sanitized CPU build a token costs about
half a CPU second, and the load is in the clients, not the prompt lengths.
Prints one "ok - ..." line per check; exits 1 at the first failure."""
import http.client
import json
import subprocess
import sys
import threading
import time

import serve_util
from serve_util import check

port, fl, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
CLIENTS, MAX = int(sys.argv[4]), int(sys.argv[5])
BLOCK = 16  # the engine's default KV block size
TIMEOUT = 600
HDR = {"Content-Type": "application/json"}




def n_tokens(texts):
    out = subprocess.run([fl, "tokenize", "--model", model], input=json.dumps(texts), capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return [len(ids) for ids in json.loads(out)]


# --- the prompts, padded so that the shared part ends on a block boundary ---
BASE = "Capitals. Germany: Berlin. Spain: Madrid."
COUNTRIES = [" France:", " Japan:", " Italy:", " Peru:"]
SYSTEM = "Answer in one word."
USER = "Name a color."


def chat_text(k):
    return (f"<|im_start|>system\n{SYSTEM}{' ok' * k}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
            "<|im_start|>assistant\n")


counts = n_tokens([BASE + " ok" * k for k in range(BLOCK)] + [chat_text(k) for k in range(BLOCK)] +
                  [c.strip() for c in COUNTRIES] + [BASE + c for c in COUNTRIES])
kc = next(k for k in range(BLOCK) if counts[k] % BLOCK == 0)
# a chat prompt whose tokens but the last fill whole blocks: all of it is shared
kh = next(k for k in range(BLOCK) if (counts[BLOCK + k] - 1) % BLOCK == 0)
SHARED = BASE + " ok" * kc
COMP = [{"prompt": SHARED + c, "max_tokens": MAX, "temperature": 0} for c in COUNTRIES]
CHAT = {"messages": [{"role": "system", "content": SYSTEM + " ok" * kh}, {"role": "user", "content": USER}],
        "max_tokens": MAX, "temperature": 0}


def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    c.request("POST", path, body=json.dumps(body).encode(), headers=HDR)
    r = c.getresponse()
    return c, r


def whole(path, body):
    c, r = post(path, body)
    out = r.status, r.read()
    c.close()
    return out


def metrics():
    return serve_util.scrape(port)


# --- each request alone: the reference answers ---
REQS = [("/v1/completions", b) for b in COMP] + [("/v1/chat/completions", CHAT)]
ref = []
for path, body in REQS:
    st, raw = whole(path, body)
    o = json.loads(raw)
    check(st == 200, f"alone: {path} {st}")
    ch = o["choices"][0]
    text = ch["text"] if path == "/v1/completions" else ch["message"]["content"]
    ref.append({"text": text, "finish": ch["finish_reason"], "usage": o["usage"]})
check(len({r["text"] for r in ref[:4]}) == 4,
      f"the four completion prompts have four different answers: {[r['text'] for r in ref[:4]]}")
aligned = [r["usage"]["prompt_tokens"] - 2 for r in ref[:4]] + [ref[4]["usage"]["prompt_tokens"] - 1]
print(f"# prompts: {[r['usage']['prompt_tokens'] for r in ref]} tokens, shared part "
      f"{'on a block boundary' if all(a % BLOCK == 0 for a in aligned) else 'NOT block-aligned (slower)'}")
for r in ref:
    u = r["usage"]
    check(u["completion_tokens"] <= MAX and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and
          (u["completion_tokens"] == MAX) == (r["finish"] == "length"),
          f"alone: usage {u} consistent with finish_reason {r['finish']!r}")


def run_client(i, out):
    """Client i: completions for even i (prompt (i // 4) % 4), chat for odd i;
    streamed when (i // 2) is even."""
    chat = i % 2 == 1
    k = 4 if chat else (i // 4) % 4
    path, body = REQS[k]
    stream = (i // 2) % 2 == 0
    want = ref[k]
    t0 = time.monotonic()
    err = None
    try:
        if not stream:
            st, raw = whole(path, body)
            lat = time.monotonic() - t0
            o = json.loads(raw)
            ch = o["choices"]
            ok = (st == 200 and o["object"] == ("chat.completion" if chat else "text_completion") and
                  len(ch) == 1 and ch[0]["index"] == 0 and ch[0]["finish_reason"] == want["finish"] and
                  (ch[0]["message"] == {"role": "assistant", "content": want["text"]} if chat
                   else ch[0]["text"] == want["text"]) and o["usage"] == want["usage"])
            if not ok:
                err = f"client {i}: {st} {raw[:400]!r} want {want}"
        else:
            c, r = post(path, dict(body, stream=True, stream_options={"include_usage": True}))
            ttft, events, buf = None, [], b""
            for line in r:
                if ttft is None:
                    ttft = time.monotonic() - t0
                if line == b"\n":
                    events.append(buf)
                    buf = b""
                elif not line.startswith(b"data: ") or not line.endswith(b"\n"):
                    raise ValueError(f"not an SSE data line: {line!r}")
                else:
                    buf = line[6:-1]
            c.close()
            lat = time.monotonic() - t0
            if buf or events[-1] != b"[DONE]":
                raise ValueError(f"the stream does not end with [DONE]: {events[-2:]!r} {buf!r}")
            chunks = [json.loads(e) for e in events[:-1]]
            usage = chunks.pop()
            obj = "chat.completion.chunk" if chat else "text_completion"
            text = "".join((c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"])
                           for c in chunks)
            fins = [c["choices"][0]["finish_reason"] for c in chunks]
            ok = (r.status == 200 and all(c["object"] == obj and c["id"] == chunks[0]["id"] and
                                          len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
                                          for c in chunks) and
                  text == want["text"] and fins[-1] == want["finish"] and not any(fins[:-1]) and
                  usage["choices"] == [] and usage["id"] == chunks[0]["id"] and usage["usage"] == want["usage"] and
                  (not chat or chunks[0]["choices"][0]["delta"].get("role") == "assistant"))
            if not ok:
                err = f"client {i} (stream): {text!r} {fins} {usage.get('usage')} want {want}"
        out[i] = (lat, stream, chat, err)
    except Exception as e:  # noqa: BLE001 - reported below
        out[i] = (time.monotonic() - t0, stream, chat, f"client {i}: {e!r}")


m0 = metrics()
out = [None] * CLIENTS
start = threading.Barrier(CLIENTS)
ts = [threading.Thread(target=lambda i=i: (start.wait(), run_client(i, out))) for i in range(CLIENTS)]
t0 = time.monotonic()
for t in ts:
    t.start()
for t in ts:
    t.join(timeout=TIMEOUT)
wall = time.monotonic() - t0
errs = [o[3] if o else "no result (hung)" for o in out if not o or o[3]]
lats = sorted(o[0] for o in out if o)


def pct(p):
    return lats[min(len(lats) - 1, int(p / 100 * len(lats)))]


print(f"# {CLIENTS} clients, max_tokens {MAX}: wall {wall:.1f} s, latency p50 {pct(50):.2f} s, "
      f"p99 {pct(99):.2f} s, max {lats[-1]:.2f} s")
kinds = {(s, c) for _, s, c, _ in (o for o in out if o)}
check(not errs and len(kinds) == 4,
      f"{CLIENTS} concurrent clients (completions and chat, whole and streamed) all answered as alone "
      f"{errs[:3]}")

gen = sum(ref[4 if i % 2 else (i // 4) % 4]["usage"]["completion_tokens"] for i in range(CLIENTS))
# a stream is counted when its connection is done with it, just after the
# client read [DONE], and the gauges follow the engine's next loop: give
# them a moment
deadline = time.monotonic() + 20
while True:
    m1 = metrics()
    d200 = m1.get('flotilla_requests_total{status="200"}', 0) - m0.get('flotilla_requests_total{status="200"}', 0)
    dgen = m1["flotilla_generation_tokens_total"] - m0["flotilla_generation_tokens_total"]
    de2e = (m1['flotilla_e2e_request_latency_seconds_bucket{le="+Inf"}'] -
            m0['flotilla_e2e_request_latency_seconds_bucket{le="+Inf"}'])
    if ((d200, dgen, de2e) == (CLIENTS, gen, CLIENTS) and m1["flotilla_requests_running"] == 0 and
            m1["flotilla_requests_waiting"] == 0) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
check(d200 == CLIENTS and dgen == gen and de2e == CLIENTS and m1["flotilla_requests_running"] == 0 and
      m1["flotilla_requests_waiting"] == 0,
      f"/metrics: {CLIENTS} more 200s, {gen} more generated tokens, {CLIENTS} more latencies, none left running "
      f"(got {d200:g}, {dgen:g}, {de2e:g}, running {m1['flotilla_requests_running']:g}, "
      f"waiting {m1['flotilla_requests_waiting']:g})")
