#!/usr/bin/env python3
"""check_serve_stall.py PORT STALL_S — a streaming client that stops reading,
against a running `flotilla serve --stream-stall-timeout STALL_S` on the demo
model (tests/test_serve_load.sh starts it): a raw socket with a small receive
buffer asks for a long chat stream with 20 top logprobs per token (big
chunks fill the socket buffers fast) and never reads. The server must drop
it (flotilla_stream_stalls_total + 1, a 499, its sequence gone from
flotilla_requests_running, the socket closed before [DONE]) while another
client's stream, started meanwhile and read normally, gets the same greedy
text it gets alone. Prints one "ok - ..." line per check; exits 1 at the
first failure."""
import http.client
import json
import socket
import sys
import threading
import time

import serve_util
from serve_util import check

port, stall_s = int(sys.argv[1]), float(sys.argv[2])
DEADLINE = 240  # the most any wait here takes, seconds




def metrics():
    return serve_util.scrape(port)


def wait_metric(name, pred, secs):
    return serve_util.wait_metric(metrics, name, pred, secs, 0.1)


def stream_text(body):
    """The text of a streamed completion read normally, and whether [DONE] came."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text, done = "", False
    for line in r:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: "):
            text += json.loads(line[6:])["choices"][0]["text"]
    c.close()
    return r.status, text, done


OTHER = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
st, alone, done = stream_text(OTHER)
check(st == 200 and done and alone, f"a stream alone: {alone!r}")

m0 = metrics()
STALLS, R499 = "flotilla_stream_stalls_total", 'flotilla_requests_total{status="499"}'
check(STALLS in m0, "/metrics has flotilla_stream_stalls_total")

# the client that stops reading: a small receive buffer, set before connect
# so the window it announces is small too
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
s.settimeout(DEADLINE)
s.connect(("127.0.0.1", port))
body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
                   "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}).encode()
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
# received (waiting) or admitted (running): the gauges follow the engine's loop
busy = DEADLINE
deadline = time.monotonic() + DEADLINE
while time.monotonic() < deadline:
    m = metrics()
    busy = m["flotilla_requests_running"] + m["flotilla_requests_waiting"]
    if busy >= 1:
        break
    time.sleep(0.1)
check(busy >= 1, "the stalled client's request is taken")

# meanwhile another client streams normally and gets its whole answer
other = {}
ot = threading.Thread(target=lambda: other.update(r=stream_text(OTHER)))
ot.start()
t0 = time.monotonic()
stalls = wait_metric(STALLS, lambda v: v >= m0[STALLS] + 1, DEADLINE)
took = time.monotonic() - t0
check(stalls == m0[STALLS] + 1, f"the stalled stream is dropped ({took:.1f} s after the other client "
      f"started; the buffers fill, then {stall_s:g} s without progress)")
ot.join(timeout=DEADLINE)
st, text, done = other.get("r", (0, "", False))
check(st == 200 and done and text == alone, f"the other client's stream completes meanwhile: {text!r}")
after = wait_metric("flotilla_requests_running", lambda v: v == 0, 30)
m1 = metrics()
check(after == 0 and m1.get(R499, 0) == m0.get(R499, 0) + 1,
      "its sequence is stopped (requests_running back to 0) and counted as a 499")

# the socket holds what its receive buffer took, then the server's close:
# no [DONE]
got = b""
while True:
    try:
        b = s.recv(65536)
    except (ConnectionResetError, socket.timeout):
        break
    if not b:
        break
    got += b
s.close()
check(got.startswith(b"HTTP/1.1 200") and b"data: {" in got and b"[DONE]" not in got,
      f"the stalled socket got {len(got)} bytes and was closed before [DONE]")
