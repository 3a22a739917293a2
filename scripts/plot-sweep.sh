#!/usr/bin/env bash
# plot-sweep.sh CSV PNG [TITLE] — draws a `flotilla bench --workload
# --sweep-csv` file with gnuplot: output tokens/s against the median time
# per output token, one series per input length, each point labelled with
# its max concurrency, and the Pareto front (the points no other beats on
# both) as a line. Needs gnuplot (Debian: gnuplot-nox).
set -euo pipefail
csv=${1:?usage: plot-sweep.sh CSV PNG [TITLE]}
png=${2:?usage: plot-sweep.sh CSV PNG [TITLE]}
title=${3:-flotilla bench --workload sweep}
command -v gnuplot >/dev/null || { echo "plot-sweep.sh: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
head -1 "$csv" | grep -q '^input_len,max_concurrency,.*,tpot_p50_ms,.*,pareto$' ||
  { echo "plot-sweep.sh: $csv is not a --sweep-csv file (header: $(head -1 "$csv"))" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# columns by name, so the CSV may grow
awk -F, -v dir="$tmp" '
  NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
  {
    x = $col["tpot_p50_ms"]; y = $col["output_tok_s"]; L = $col["input_len"]; c = $col["max_concurrency"]
    print x, y, c > (dir "/in_" L ".dat")
    if ($col["pareto"] == 1) print x, y > (dir "/pareto.unsorted")
  }' "$csv"
[ -s "$tmp/pareto.unsorted" ] && sort -g "$tmp/pareto.unsorted" >"$tmp/pareto.dat"
plots=()
for f in "$tmp"/in_*.dat; do
  L=${f##*/in_}; L=${L%.dat}
  plots+=("'$f' using 1:2 with linespoints pt 7 title 'input $L'")
  plots+=("'$f' using 1:2:3 with labels offset 0.8,0.6 font ',8' notitle")
done
[ -s "$tmp/pareto.dat" ] && plots+=("'$tmp/pareto.dat' using 1:2 with lines lw 2 dt 2 lc rgb 'black' title 'Pareto front'")
{
  echo "set terminal pngcairo size 900,600 noenhanced"
  echo "set output '$png'"
  echo "set title '$title'"
  echo "set xlabel 'time per output token, median (ms)'"
  echo "set ylabel 'output tokens/s'"
  echo "set grid"
  echo "set key top left"
  (IFS=,; echo "plot ${plots[*]}")
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
[ -s "$png" ] || { echo "plot-sweep.sh: gnuplot wrote no $png" >&2; exit 1; }
echo "plot-sweep.sh: $png"
