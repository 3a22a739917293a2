#!/usr/bin/env python3
"""ncu_step.py — one decode step of `flotilla bench`, kernel by kernel, from an
Nsight Compute CSV (scripts/gpu-profile.sh writes it).

Each kernel ran alone under ncu (serialized, caches flushed), so the sum of
the durations is the step without launch gaps or overlap; the bench's own
step time beside it gives what the gaps and the serial ramps cost. A step
is the kernels from the last embed_kernel launch to the end of the run
(bench's final decode step), so run bench with a short --gen-len.

    python3 scripts/ncu_step.py ncu.csv [--ceiling-gbps 4200] [--step-ms X]
"""
import argparse
import collections
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*", "", name)            # arguments
    name = re.sub(r"^void ", "", name)
    return name[:60]


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
        v = float(r["Metric Value"].replace(",", "")) if r["Metric Value"] not in ("", "n/a") else 0.0
        unit = r["Metric Unit"]
        if r["Metric Name"] == "gpu__time_duration.sum":
            d["us"] = v / 1e3 if unit in ("ns", "nsecond") else v if unit in ("us", "usecond") else v * 1e3
        elif r["Metric Name"].startswith("dram__bytes"):
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
            d["bytes"] = d.get("bytes", 0) + v * scale
    ks = list(rows.values())
    starts = [i for i, k in enumerate(ks) if k["name"].startswith("embed_kernel")]
    if not starts:
        sys.exit("ncu_step: no embed_kernel launch in %s" % a.csv)
    step = ks[starts[-1]:]
    tot_us = sum(k.get("us", 0) for k in step)
    tot_b = sum(k.get("bytes", 0) for k in step)
    print("one decode step: %d kernels, %.1f us summed, %.1f MB read+written from DRAM" %
          (len(step), tot_us, tot_b / 1e6))
    if a.step_ms:
        print("bench step %.1f us: %.1f us (%.0f %%) outside the kernels' isolated times" %
              (a.step_ms * 1e3, a.step_ms * 1e3 - tot_us, 100 * (1 - tot_us / (a.step_ms * 1e3))))
    agg = collections.OrderedDict()
    for k in step:
        key = (k["name"], k["grid"], k["block"])
        g = agg.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += k.get("us", 0)
        g[2] += k.get("bytes", 0)
    print("%-44s %-14s %-10s %5s %9s %7s %8s %6s" % ("kernel", "grid", "block", "count", "total us", "share",
                                                    "us each", "% ceil"))
    for (name, grid, block), (n, us, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        pct = 100 * b / (us * 1e-6) / (a.ceiling_gbps * 1e9) if a.ceiling_gbps and us > 0 else 0
        print("%-44s %-14s %-10s %5d %9.1f %6.1f%% %8.2f %6.1f" % (name[:44], grid, block, n, us,
                                                                   100 * us / tot_us, us / n, pct))
    short_us = sum(g[1] for (name, _, _), g in agg.items() if not name.startswith(("w4_", "gemv", "Kernel", "sm90", "cutlass")))
    print("kernels other than the GEMV/GEMMs: %.1f us (%.0f %% of the summed time)" % (short_us, 100 * short_us / tot_us))


if __name__ == "__main__":
    main()
