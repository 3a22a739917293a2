#!/usr/bin/env python3
"""scaling-table.py — the multi-GPU scaling table from `flotilla bench` JSON.

    python3 scripts/scaling-table.py DIR NP [--csv FILE]

DIR holds np1-PRESET-QUANT-bBATCH.json (one GPU) and npNP-PRESET-QUANT-bBATCH-
epEP[-own|-p2p].json (NP GPUs under mpirun), as scripts/gpu-scaling.sh writes
them. Each NP-GPU run with its one-GPU run becomes a row: tokens/s both ways,
speed-up, scaling efficiency (speed-up / NP), the share of the copy ceiling,
and the communication numbers the NP-GPU run measured. Prints a Markdown table;
--csv also writes the rows as CSV (scripts/plot-scaling.sh draws that file).
Exits 1, naming DIR, when no run has its one-GPU partner.
"""
import argparse
import csv
import glob
import json
import os
import sys

COLUMNS = ["preset", "quant", "batch", "ep", "allreduce", "tok_s_1", "tok_s_np", "np", "speedup", "efficiency",
           "ceiling_frac_1", "ceiling_frac_np", "allreduce_us", "allreduce_pipelined_us", "allreduce_busbw_GBps",
           "alltoall_busbw_GBps", "comm_share_est"]


def rows(out, np_):
    res = []
    for f in sorted(glob.glob(os.path.join(out, f"np{np_}-*.json"))):
        m = json.load(open(f))
        q = m["quantize"].replace("bf16", "none")
        one = os.path.join(out, f"np1-{m['preset']}-{q}-b{m['batch']}.json")
        if not os.path.exists(one):
            continue
        o = json.load(open(one))
        s = m["decode_tok_s"] / o["decode_tok_s"]
        stream = "own" if f.endswith("-own.json") else "p2p" if f.endswith("-p2p.json") else "compute"
        res.append({"preset": m["preset"], "quant": m["quantize"], "batch": m["batch"], "ep": m["ep"],
                    "allreduce": stream, "tok_s_1": o["decode_tok_s"], "tok_s_np": m["decode_tok_s"], "np": np_,
                    "speedup": s, "efficiency": s / np_, "ceiling_frac_1": o["fraction_of_ceiling"],
                    "ceiling_frac_np": m["fraction_of_ceiling"], "allreduce_us": m["allreduce_hidden_us"],
                    "allreduce_pipelined_us": m.get("allreduce_hidden_pipelined_us", 0),
                    "allreduce_busbw_GBps": m["allreduce_busbw_GBps"], "alltoall_busbw_GBps": m["alltoall_busbw_GBps"],
                    "comm_share_est": m.get("comm_share_est", 0)})
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("np", type=int)
    ap.add_argument("--csv")
    a = ap.parse_args()
    rs = rows(a.dir, a.np)
    if not rs:
        print(f"scaling-table.py: no np{a.np}-*.json in {a.dir} has its np1 run", file=sys.stderr)
        return 1
    names = {"own": "own + host syncs", "p2p": "one-shot p2p (small)", "compute": "compute"}
    n = a.np
    print(f"| preset | quant | batch | ep | all-reduce | tok/s 1 GPU | tok/s {n} GPUs | speed-up | efficiency | "
          f"% ceiling 1 / {n} | all-reduce 1 token, waited / back-to-back (us) | all-reduce busbw GB/s | "
          f"all-to-all busbw GB/s | comm share of step (est.) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        print(f"| {r['preset']} | {r['quant']} | {r['batch']} | {r['ep']} | {names[r['allreduce']]} | "
              f"{r['tok_s_1']:.1f} | {r['tok_s_np']:.1f} | {r['speedup']:.2f}x | {r['efficiency']:.0%} | "
              f"{r['ceiling_frac_1']:.1%} / {r['ceiling_frac_np']:.1%} | {r['allreduce_us']:.1f} / "
              f"{r['allreduce_pipelined_us']:.1f} | {r['allreduce_busbw_GBps']:.0f} | "
              f"{r['alltoall_busbw_GBps']:.0f} | {r['comm_share_est']:.0%} |")
    if a.csv:
        with open(a.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            for r in rs:
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
