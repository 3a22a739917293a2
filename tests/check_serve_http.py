#!/usr/bin/env python3
"""check_serve_http.py PORT TIMEOUT — malformed and hostile HTTP against a
running `flotilla serve --timeout-keep-alive TIMEOUT` (started by
tests/test_serve.sh on the demo model, no API key): a client trickling its
headers byte by byte must not stall the others; idle, stalled, half-closed
clients and invalid Content-Length values each get a 4xx or a closed
connection, never a hang (every socket here has a deadline); an answer that
takes longer than TIMEOUT is still delivered whole. Prints one "ok - ..."
line per check; exits 1 at the first failure."""
import http.client
import json
import socket
import sys
import threading
import time

from serve_util import check

port, timeout = int(sys.argv[1]), float(sys.argv[2])
DEADLINE = timeout * 3 + 10  # the most any socket here waits




def conn():
    s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    return s


def read_all(s):
    """Everything the server sends until it closes; raises socket.timeout on a hang."""
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            return out
        if not b:
            return out
        out += b


def status_of(resp):
    """The status of the first response in resp, or None when the server sent nothing."""
    if not resp:
        return None
    line = resp.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else -1


def req(method, path, body=None, to=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=to)
    c.request(method, path, body=None if body is None else json.dumps(body).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


def metric(name):
    _, body = req("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def closed_or_4xx(raw, what, t0):
    s = conn()
    try:
        s.sendall(raw)
        resp = read_all(s)
        st = status_of(resp)
        check(st is None or 400 <= st < 500,
              f"{what}: {'closed' if st is None else st} in {time.monotonic() - t0:.1f} s")
        return st
    except socket.timeout:
        check(False, f"{what}: no answer and not closed within {DEADLINE:.0f} s")
    finally:
        s.close()


# a client trickling its headers over several seconds; others are served meanwhile
raw = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slowpoke\r\n"
       b"Connection: close\r\n\r\n")
slow = {}


def trickle():
    s = conn()
    t0 = time.monotonic()
    try:
        for i in range(len(raw)):
            s.sendall(raw[i:i + 1])
            time.sleep(min(0.05, timeout / 10))
        slow["resp"] = read_all(s)
    except OSError as e:
        slow["err"] = repr(e)
    slow["secs"] = time.monotonic() - t0
    s.close()


th = threading.Thread(target=trickle)
th.start()
time.sleep(0.3)
lat = []
while th.is_alive() and len(lat) < 20:
    t0 = time.monotonic()
    st, _ = req("GET", "/health", to=10)
    st2, body = req("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, to=30)
    lat.append((st, st2, time.monotonic() - t0))
th.join(DEADLINE)
check(not th.is_alive() and status_of(slow.get("resp")) == 200 and slow["secs"] > 2,
      f"a client sending its headers byte by byte over {slow.get('secs', 0):.1f} s is answered")
check(len(lat) >= 2 and all(a == 200 and b == 200 and t < 5 for a, b, t in lat),
      f"{len(lat)} other requests meanwhile answered at once (slowest "
      f"{max(t for _, _, t in lat) if lat else 0:.2f} s)")

# silent, stalled and half-closed clients: closed, never a hang
t0 = time.monotonic()
s = conn()
try:
    got = read_all(s)
    secs = time.monotonic() - t0
    check(got == b"" and secs < timeout + 5, f"an idle connection is closed after {secs:.1f} s "
          f"(--timeout-keep-alive {timeout:g})")
except socket.timeout:
    check(False, "an idle connection is never closed")
s.close()
t0 = time.monotonic()
closed_or_4xx(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", "headers stopping midway", t0)
t0 = time.monotonic()
closed_or_4xx(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
              "a body shorter than its Content-Length", t0)
for cl in [b"abc", b"-5", b"99999999999999999999999", b"1, 2", b"0x10"]:
    t0 = time.monotonic()
    closed_or_4xx(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + cl +
                  b"\r\nConnection: close\r\n\r\n{\"prompt\": \"x\"}", f"Content-Length: {cl.decode()}", t0)
t0 = time.monotonic()
closed_or_4xx(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
              b"Content-Length: 15\r\nConnection: close\r\n\r\n{\"prompt\": \"x\"}",
              "two different Content-Lengths", t0)
t0 = time.monotonic()
closed_or_4xx(b"HELLO THERE\r\n\r\n", "a request line that is not HTTP", t0)
t0 = time.monotonic()
closed_or_4xx(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200000 + b"\r\n\r\n",
              "a 200 kB header", t0)

# half-closed: the request whole, then the client's write side shut
LONG = json.dumps({"prompt": "Once", "max_tokens": 3000, "ignore_eos": True}).encode()
for what, raw in [("headers cut, then half-closed", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
                  ("a long request, then half-closed",
                   b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" %
                   (len(LONG), LONG))]:
    t0 = time.monotonic()
    s = conn()
    try:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        resp = read_all(s)
        st = status_of(resp)
        check(st is None or 400 <= st < 500,
              f"{what}: {'closed' if st is None else st} in {time.monotonic() - t0:.1f} s")
    except socket.timeout:
        check(False, f"{what}: a hang")
    s.close()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and metric("flotilla_requests_running") != 0:
    time.sleep(0.1)
check(metric("flotilla_requests_running") == 0, "nothing left running after the half-closed clients")

# an answer slower than the timeout still arrives, whole and streamed: as
# many tokens as take twice the timeout at the rate a 32-token answer shows
# (a fixed count finishes inside it on a fast build)
t0 = time.monotonic()
c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
          body=json.dumps({"prompt": "Once", "max_tokens": 32, "ignore_eos": True}).encode())
c.getresponse().read()
c.close()
n_slow = min(2000, max(32, int(32 * 2 * timeout / (time.monotonic() - t0)) + 1))
for stream in (False, True):
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
              body=json.dumps({"prompt": "Once", "max_tokens": n_slow, "ignore_eos": True,
                               "stream": stream}).encode())
    r = c.getresponse()
    body = r.read()
    secs = time.monotonic() - t0
    if stream:
        ev = [e[6:] for e in body.decode().split("\n\n") if e]
        ok = ev[-1] == "[DONE]" and json.loads(ev[-2])["choices"][0]["finish_reason"] == "length"
    else:
        ok = json.loads(body)["usage"]["completion_tokens"] == n_slow
    check(r.status == 200 and ok and secs > timeout,
          f"a {'streamed' if stream else 'whole'} answer taking {secs:.1f} s (> {timeout:g}) arrives whole")
    # the same connection is kept alive for the next request
    c.request("GET", "/health")
    r = c.getresponse()
    check(r.status == 200 and r.read() == b"ok\n", "the connection serves a next request after it")
    c.close()
