"""prom_check.py — imported by the check_serve*.py scripts: parses a
`flotilla serve` /metrics page with prometheus_client's own text parser
(the one Prometheus' Python tooling uses) and checks what that parser lets
through: every family has HELP and a known TYPE, counters end in _total,
histograms have ascending le buckets ending at +Inf with counts that never
drop, and _count equal to the +Inf bucket, with a _sum. Without the package
the page is still read line by line (FL_CI=1 makes its absence an error)."""
import math
import os
import re

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    text_string_to_metric_families = None


def _key(name, labels):
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def parse(text):
    """{'name{label="v"}': value} for every sample of the page; raises
    AssertionError naming what is wrong."""
    vals = {}
    if text_string_to_metric_families is None:
        assert os.environ.get("FL_CI") != "1", "prometheus_client is not installed (scripts/setup.sh)"
        for line in text.splitlines():
            if line and not line.startswith("#"):
                m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?) (\S+)', line)
                assert m, f"not Prometheus text: {line!r}"
                vals[m.group(1)] = float(m.group(3))
        return vals
    assert text.endswith("\n"), "the page must end with a newline"
    helps = set(re.findall(r"^# HELP (\S+) \S", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    fams = list(text_string_to_metric_families(text))
    assert fams, "no metric families"
    for f in fams:
        assert f.type in ("counter", "gauge", "histogram"), f"{f.name}: type {f.type!r}"
        full = f.name + "_total" if f.type == "counter" else f.name
        assert full in helps and types.get(full) == f.type, f"{full}: no HELP line or a TYPE other than {f.type}"
        assert f.documentation, f"{f.name}: empty HELP"
        for s in f.samples:
            assert not math.isnan(s.value), f"{s.name}: NaN"
            vals[_key(s.name, s.labels)] = s.value
        if f.type == "counter":
            assert all(s.name == f.name + "_total" and s.value >= 0 for s in f.samples), \
                f"{f.name}: counter samples must be NAME_total >= 0"
        if f.type == "histogram":
            buckets = [s for s in f.samples if s.name == f.name + "_bucket"]
            les = [float(s.labels["le"]) for s in buckets]
            assert les and les == sorted(les) and len(set(les)) == len(les) and les[-1] == math.inf, \
                f"{f.name}: le labels must ascend and end with +Inf: {les}"
            counts = [s.value for s in buckets]
            assert counts == sorted(counts), f"{f.name}: cumulative bucket counts drop: {counts}"
            count = [s.value for s in f.samples if s.name == f.name + "_count"]
            total = [s.value for s in f.samples if s.name == f.name + "_sum"]
            assert count == [counts[-1]] and len(total) == 1 and total[0] >= 0, \
                f"{f.name}: _count {count} must equal the +Inf bucket {counts[-1]}, one _sum {total}"
    return vals
