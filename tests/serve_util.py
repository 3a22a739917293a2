"""serve_util.py — imported by the check_serve*.py scripts: the TAP-like
check line, one scrape of a `flotilla serve` /metrics page (parsed and
checked by prom_check), and waiting for a metric to reach a value."""
import http.client
import sys
import time

import prom_check


def check(cond, what):
    """Prints "ok - what", or "FAIL - what" and exits 1."""
    if not cond:
        print(f"FAIL - {what}")
        sys.exit(1)
    print(f"ok - {what}")


def scrape(port):
    """{'name{label="v"}': value} of the server's /metrics page."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return prom_check.parse(text)


def wait_metric(metrics, name, pred, secs, poll=0.05):
    """Polls metrics() until pred(value of name, 0 when absent) holds or secs
    pass; returns the last value."""
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        v = metrics().get(name, 0)
        if pred(v):
            return v
        time.sleep(poll)
    return metrics().get(name, 0)
