#!/usr/bin/env python3
"""ncu_step.py — one decode step of `flotilla bench`, kernel by kernel, from an
Nsight Compute CSV (scripts/gpu-profile.sh writes it).

Each kernel ran alone under ncu (serialized, from a flushed L2, without the
overlap programmatic dependent launch gives), so the sum of the durations is
a cold, serial upper bound; the bench's own step time beside it shows how
much the real step's overlap and warm caches save. A step is the kernels
from the last embed_kernel launch to the end of the run (bench's final
decode step), so run bench with a short --gen-len.

    python3 scripts/ncu_step.py ncu.csv [--ceiling-gbps 4200] [--step-ms X]
"""
import argparse
import collections
import csv
import re
import sys


GEMM_PREFIXES = ("w4_", "gemv", "Kernel", "sm90", "cutlass", "nvjet", "cublas")
# optional issue-side metrics (gpu-profile.sh asks for them): the share of
# cycles a scheduler issued, and the warps eligible to issue per cycle; a
# kernel well under the copy ceiling with low eligibility is latency bound,
# one with high issue activity is instruction bound
SM_METRICS = {"smsp__issue_active.avg.pct_of_peak_sustained_active": "issue",
              "smsp__warps_eligible.avg.per_cycle_active": "elig"}
TIME_UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
                "second": 1e6}
BYTE_UNIT = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def short(name):
    """The kernel's name without its final argument list: the last ')' back to
    its matching '(' (template arguments may hold parentheses of their own)."""
    name = re.sub(r"^void ", "", name.strip())
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += name[i] == ")"
            depth -= name[i] == "("
            if depth == 0:
                name = name[:i]
                break
    return name[:60]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--ceiling-gbps", type=float, default=0)
    ap.add_argument("--step-ms", type=float, default=0, help="bench's measured step time")
    a = ap.parse_args()
    rows = collections.OrderedDict()
    with open(a.csv, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # skip ncu's own log lines
    for r in csv.DictReader(lines):
        k = r["ID"]
        d = rows.setdefault(k, {"name": short(r["Kernel Name"]), "grid": r["Grid Size"], "block": r["Block Size"]})
        v = number(r["Metric Value"])
        unit = r["Metric Unit"]
        if r["Metric Name"] == "gpu__time_duration.sum":
            if unit not in TIME_UNIT_US:
                sys.exit("ncu_step: unknown time unit %r in %s" % (unit, a.csv))
            d["us"] = v * TIME_UNIT_US[unit]
        elif r["Metric Name"].startswith("dram__bytes"):
            d["bytes"] = d.get("bytes", 0) + v * BYTE_UNIT.get(unit, 1)
        elif r["Metric Name"] in SM_METRICS:
            d[SM_METRICS[r["Metric Name"]]] = v
    ks = list(rows.values())
    starts = [i for i, k in enumerate(ks) if k["name"].startswith("embed_kernel")]
    if not starts:
        sys.exit("ncu_step: no embed_kernel launch in %s" % a.csv)
    step = ks[starts[-1]:]
    tot_us = sum(k.get("us", 0) for k in step)
    tot_b = sum(k.get("bytes", 0) for k in step)
    if tot_us <= 0:
        sys.exit("ncu_step: no kernel durations in %s (metrics missing?)" % a.csv)
    print("one decode step: %d kernels, %.1f us summed, %.1f MB read+written from DRAM" %
          (len(step), tot_us, tot_b / 1e6))
    if a.step_ms:
        print("bench step %.1f us against %.1f us of isolated cold kernels: %+.1f us (%+.0f %%)" %
              (a.step_ms * 1e3, tot_us, a.step_ms * 1e3 - tot_us, 100 * (a.step_ms * 1e3 / tot_us - 1)))
    agg = collections.OrderedDict()
    for k in step:
        key = (k["name"], k["grid"], k["block"])
        g = agg.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[1] += k.get("us", 0)
        g[2] += k.get("bytes", 0)
        g[3] += k.get("issue", 0) * k.get("us", 0)  # time-weighted
        g[4] += k.get("elig", 0) * k.get("us", 0)
    print("%-44s %-14s %-10s %5s %9s %7s %8s %6s %6s %5s" % ("kernel", "grid", "block", "count", "total us", "share",
                                                             "us each", "% ceil", "issue%", "elig"))
    for (name, grid, block), (n, us, b, iss, el) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        pct = 100 * b / (us * 1e-6) / (a.ceiling_gbps * 1e9) if a.ceiling_gbps and us > 0 else 0
        print("%-44s %-14s %-10s %5d %9.1f %6.1f%% %8.2f %6.1f %6.1f %5.2f" % (
            name[:44], grid, block, n, us, 100 * us / tot_us, us / n, pct, iss / us if us else 0, el / us if us else 0))
    short_us = sum(g[1] for (name, _, _), g in agg.items() if not name.startswith(GEMM_PREFIXES))
    print("kernels other than the GEMV/GEMMs: %.1f us (%.0f %% of the summed time)" % (short_us, 100 * short_us / tot_us))


if __name__ == "__main__":
    main()
