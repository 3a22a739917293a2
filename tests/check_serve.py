#!/usr/bin/env python3
"""check_serve.py PORT API_KEY EXPECTED.json — checks a running `flotilla serve`
(started by tests/test_serve.sh with --api-key API_KEY --max-body-bytes 4096)
on the demo model. EXPECTED holds `flotilla generate`'s greedy answers to the
same requests ({"completion": text, "chat": text}). Uses only the standard
library for raw HTTP, and the official openai client too when importable.
/metrics is read line by line and by prometheus_client's parser
(tests/prom_check.py). Prints one "ok - ..." line per check; exits 1 at the
first failure."""
import http.client
import json
import re
import sys
import threading
import time

import prom_check
import serve_util
from serve_util import check

port, key, expected = int(sys.argv[1]), sys.argv[2], json.load(open(sys.argv[3]))
AUTH = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
PROMPT = expected["prompt"]
MESSAGES = expected["messages"]
MAX = expected["max_tokens"]


def req(method, path, body=None, headers=AUTH, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    c.close()
    return out




def sse(path, body, close_after=None):
    """The events of a streamed request, parsed; stops early after close_after events."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps(body).encode(), headers=AUTH)
    r = c.getresponse()
    assert r.status == 200, (r.status, r.read())
    assert r.getheader("Content-Type", "").startswith("text/event-stream")
    events, buf = [], b""
    while True:
        line = r.readline()
        if not line:
            break
        if line == b"\n":
            if buf:
                events.append(buf.decode())
            buf = b""
            if close_after and len(events) >= close_after:
                c.sock.close()
                return events
            continue
        assert line.startswith(b"data: "), line
        buf += line[6:].rstrip(b"\n")
    c.close()
    return events


def error_ok(status, body, code, needle=None):
    e = json.loads(body)["error"]
    return status == code and set(e) >= {"message", "type", "param", "code"} and (
        needle is None or needle in e["message"] or e.get("param") == needle)


def metrics():
    st, _, body = req("GET", "/metrics")
    assert st == 200
    vals = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? '
                         r'(-?[0-9.e+-]+|\+Inf|NaN)', line)
        assert m, f"not Prometheus text: {line!r}"
        vals[m.group(1) + (m.group(2) or "")] = float(m.group(4))
    parsed = prom_check.parse(body.decode())  # prometheus_client's own parser
    assert parsed == vals, f"prometheus_client reads {parsed}, the lines say {vals}"
    return vals


m0 = metrics()
for name in ["flotilla_prompt_tokens_total", "flotilla_generation_tokens_total",
             'flotilla_preemptions_total{kind="swap"}', 'flotilla_preemptions_total{kind="recompute"}',
             "flotilla_swapped_bytes_total", "flotilla_requests_running", "flotilla_requests_waiting",
             "flotilla_kv_cache_usage_ratio", "flotilla_kv_swap_pool_usage_ratio", "flotilla_prefix_cache_hit_ratio",
             'flotilla_time_to_first_token_seconds_bucket{le="+Inf"}',
             "flotilla_time_per_output_token_seconds_count", "flotilla_e2e_request_latency_seconds_sum"]:
    check(name in m0, f"/metrics has {name}")

st, _, body = req("GET", "/health", headers={})
check(st == 200, "GET /health is 200 without a key")
st, _, body = req("GET", "/v1/models")
models = json.loads(body)
check(st == 200 and models["object"] == "list" and models["data"][0]["id"] == "smol",
      "GET /v1/models lists --served-model-name")

# greedy completion = flotilla generate's answer to the same body
cbody = {"model": "smol", "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
st, _, body = req("POST", "/v1/completions", cbody)
comp = json.loads(body)
check(st == 200 and comp["object"] == "text_completion" and comp["choices"][0]["text"] == expected["completion"]
      and comp["usage"]["completion_tokens"] == MAX and comp["model"] == "smol",
      f"completion equals generate's: {comp['choices'][0]['text']!r}")
hbody = {"messages": MESSAGES, "max_tokens": MAX}
st, _, body = req("POST", "/v1/chat/completions", hbody)
chat = json.loads(body)
check(st == 200 and chat["object"] == "chat.completion" and
      chat["choices"][0]["message"] == {"role": "assistant", "content": expected["chat"]},
      f"chat completion equals generate's: {expected['chat']!r}")

# streaming: chunks concatenate to the same text, [DONE] last, usage when asked
ev = sse("/v1/completions", dict(cbody, stream=True, stream_options={"include_usage": True}))
check(ev[-1] == "[DONE]", "completion stream ends with [DONE]")
chunks = [json.loads(e) for e in ev[:-1]]
usage = chunks.pop()
text = "".join(c["choices"][0]["text"] for c in chunks)
check(all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks) and
      text == expected["completion"] and chunks[-1]["choices"][0]["finish_reason"] == "length" and
      len(chunks) > 1, f"completion stream: {len(chunks)} chunks concatenate to the text")
check(usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX, "include_usage chunk")
ev = sse("/v1/chat/completions", dict(hbody, stream=True))
chunks = [json.loads(e) for e in ev[:-1]]
check(ev[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"].get("role") == "assistant" and
      all(c["object"] == "chat.completion.chunk" for c in chunks) and "usage" not in chunks[-1] and
      "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected["chat"],
      "chat stream concatenates to the chat text, role first, no usage unasked")

# n = 2 and logprobs
st, _, body = req("POST", "/v1/completions", dict(cbody, n=2, logprobs=2))
o = json.loads(body)
ok = st == 200 and [c["index"] for c in o["choices"]] == [0, 1]
for c in o["choices"]:
    lp = c["logprobs"]
    ok = ok and c["text"] == expected["completion"] and len(lp["tokens"]) == MAX and \
        "".join(lp["tokens"]) == c["text"] and all(x <= 0 for x in lp["token_logprobs"])
check(ok and o["usage"]["completion_tokens"] == 2 * MAX, "n=2 with logprobs: both greedy, tokens join to text")

# streamed logprobs: each chunk carries its tokens', and together they are the
# whole response's (same greedy request; values to float rounding)
def same_lps(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_lps(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_lps(x, y) for x, y in zip(a, b))
    return a == b


lbody = dict(cbody, n=2, logprobs=2)
st, _, body = req("POST", "/v1/completions", lbody)
whole = json.loads(body)["choices"]
ev = sse("/v1/completions", dict(lbody, stream=True))
joined = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in range(2)]
texts = ["", ""]
for e in ev[:-1]:
    c = json.loads(e)["choices"][0]
    texts[c["index"]] += c["text"]
    if c["logprobs"] is not None:
        for k in joined[c["index"]]:
            joined[c["index"]][k] += c["logprobs"][k]
check(st == 200 and ev[-1] == "[DONE]" and texts == [w["text"] for w in whole] and
      all(same_lps(joined[i], whole[i]["logprobs"]) for i in range(2)) and
      len(joined[0]["tokens"]) == MAX,
      "completion stream with logprobs: the chunks' logprobs join to the whole response's")
lhbody = dict(hbody, logprobs=True, top_logprobs=3)
st, _, body = req("POST", "/v1/chat/completions", lhbody)
whole = json.loads(body)["choices"][0]["logprobs"]
ev = sse("/v1/chat/completions", dict(lhbody, stream=True))
content = []
for e in ev[:-1]:
    c = json.loads(e)["choices"][0]
    if c["logprobs"] is not None:
        content += c["logprobs"]["content"]
check(st == 200 and ev[-1] == "[DONE]" and len(content) == MAX and same_lps({"content": content}, whole) and
      all(len(t["top_logprobs"]) == 3 for t in content),
      "chat stream with logprobs: the chunks' content entries join to the whole response's")

# errors
st, _, body = req("POST", "/v1/completions", dict(cbody, n=0))
check(error_ok(st, body, 400, "n"), "n=0: 400 naming the field")
st, _, body = req("POST", "/v1/completions", {"prompt": "x", "tools": []})
check(error_ok(st, body, 400, "tools"), "unsupported field: 400 naming it")
st, _, body = req("POST", "/v1/completions", b"{not json")
check(error_ok(st, body, 400, "JSON"), "bad JSON: 400")
st, _, body = req("GET", "/v1/nothing")
check(error_ok(st, body, 404), "unknown path: 404")
st, hdr, body = req("GET", "/v1/completions")
check(error_ok(st, body, 405) and hdr.get("Allow") == "POST", "wrong method: 405 with Allow")
st, _, body = req("POST", "/v1/completions", {"prompt": "x" * 5000})
check(error_ok(st, body, 413), "body over --max-body-bytes: 413")
st, _, body = req("POST", "/v1/completions", cbody, headers={"Authorization": "Bearer wrong"})
check(error_ok(st, body, 401), "wrong API key: 401")
st, _, body = req("GET", "/v1/models", headers={})
check(error_ok(st, body, 401), "no API key: 401")

# concurrent streaming clients, one of which hangs up early
N = int(expected.get("clients", 16))
results, errors = [None] * N, []


def client(i):
    try:
        if i == 0:
            sse("/v1/completions", dict(cbody, stream=True, max_tokens=64, ignore_eos=True), close_after=2)
            results[i] = "closed"
            return
        ev = sse("/v1/completions", dict(cbody, stream=True))
        results[i] = "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1])
    except Exception as e:  # noqa: BLE001 - reported below
        errors.append(repr(e))


ts = [threading.Thread(target=client, args=(i,)) for i in range(N)]
for t in ts:
    t.start()
for t in ts:
    t.join(timeout=300)
check(not errors and not any(t.is_alive() for t in ts) and results[0] == "closed" and
      all(r == expected["completion"] for r in results[1:]),
      f"{N} concurrent streams (one hung up early) all complete with the greedy text {errors[:2]}")

# a client that leaves a long non-streamed request: its sequence ends within
# a step or so (running back to 0, a 499), and another client is unaffected
def wait_metric(name, pred, secs):
    return serve_util.wait_metric(metrics, name, pred, secs)


n499 = metrics().get('flotilla_requests_total{status="499"}', 0)
lc = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
lc.request("POST", "/v1/completions", headers=AUTH,
           body=json.dumps(dict(cbody, max_tokens=4000, ignore_eos=True)).encode())
running = wait_metric("flotilla_requests_running", lambda v: v >= 1, 60)
other = {}
ot = threading.Thread(target=lambda: other.update(r=req("POST", "/v1/completions", cbody)))
ot.start()
lc.close()
t0 = time.monotonic()
seen = wait_metric('flotilla_requests_total{status="499"}', lambda v: v == n499 + 1, 10)
ot.join(timeout=300)
# left alone, the 4000-token request would run for minutes: 0 means dropped
after = wait_metric("flotilla_requests_running", lambda v: v == 0, 10)
gone_s = time.monotonic() - t0
st, _, body = other.get("r", (0, {}, b"{}"))
check(running >= 1 and seen == n499 + 1 and after == 0 and
      metrics().get('flotilla_requests_total{status="499"}', 0) == n499 + 1 and
      st == 200 and json.loads(body)["choices"][0]["text"] == expected["completion"],
      f"a client leaving a non-streamed request: running back to 0 in {gone_s:.2f} s, a 499, "
      "the other client's answer intact")

m1 = metrics()
check(m1["flotilla_prompt_tokens_total"] > m0["flotilla_prompt_tokens_total"] and
      m1["flotilla_generation_tokens_total"] >= m0["flotilla_generation_tokens_total"] + (N + 5) * MAX and
      m1.get('flotilla_requests_total{status="400"}', 0) >= 3 and
      m1.get('flotilla_requests_total{status="499"}', 0) >= 1 and
      m1['flotilla_e2e_request_latency_seconds_bucket{le="+Inf"}'] >= N + 4,
      "metrics counters increased (tokens, 400s, a 499, latency histogram)")

try:
    import openai
except ImportError:
    openai = None
if openai:
    cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
    r = cl.completions.create(model="smol", prompt=PROMPT, max_tokens=MAX, temperature=0)
    check(r.choices[0].text == expected["completion"], "openai client: completions.create")
    r = cl.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=MAX)
    check(r.choices[0].message.content == expected["chat"], "openai client: chat.completions.create")
    s = cl.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=MAX, stream=True)
    check("".join(c.choices[0].delta.content or "" for c in s if c.choices) == expected["chat"],
          "openai client: streamed chat")
    try:
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bad", max_retries=0).models.list()
        check(False, "openai client: a bad key raises")
    except openai.AuthenticationError:
        check(True, "openai client: a bad key raises AuthenticationError")
