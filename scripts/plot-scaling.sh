#!/usr/bin/env bash
# plot-scaling.sh CSV PNG [TITLE] — draws a scripts/scaling-table.py --csv
# file with gnuplot: per run (preset, quant, batch, ep, all-reduce) decode
# tokens/s on one GPU beside the same run on NP GPUs, the scaling efficiency
# (speed-up / NP) printed over each pair. Needs gnuplot (Debian: gnuplot-nox).
set -euo pipefail
csv=${1:?usage: plot-scaling.sh CSV PNG [TITLE]}
png=${2:?usage: plot-scaling.sh CSV PNG [TITLE]}
title=${3:-}
command -v gnuplot >/dev/null || { echo "plot-scaling.sh: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
head -1 "$csv" | grep -q '^preset,quant,batch,ep,allreduce,tok_s_1,tok_s_np,np,speedup,efficiency' ||
  { echo "plot-scaling.sh: $csv is not a scaling-table.py --csv file (header: $(head -1 "$csv"))" >&2; exit 1; }
[ "$(wc -l <"$csv")" -gt 1 ] || { echo "plot-scaling.sh: $csv has no rows" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# columns by name, so the CSV may grow: label, tok/s 1, tok/s NP, efficiency %
awk -F, '
  NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
  {
    lab = $col["preset"] " " $col["quant"] " b" $col["batch"] " ep" $col["ep"]
    if ($col["allreduce"] != "compute") lab = lab " " $col["allreduce"]
    printf "\"%s\" %s %s %.0f\n", lab, $col["tok_s_1"], $col["tok_s_np"], 100 * $col["efficiency"]
  }' "$csv" >"$tmp/data"
np=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "np") c = i; next } { print $c; exit }' "$csv")
title=${title:-flotilla bench: decode tokens/s on 1 and $np GPUs}
{
  echo "set terminal pngcairo size 1000,600 noenhanced"
  echo "set output '$png'"
  echo "set title '$title'"
  echo "set ylabel 'decode tokens/s'"
  echo "set style data histograms"
  echo "set style histogram clustered gap 1"
  echo "set style fill solid 0.8 border -1"
  echo "set boxwidth 0.9"
  echo "set xtics rotate by -30 scale 0"
  echo "set yrange [0:*]"
  echo "set grid ytics"
  echo "set key top left"
  echo "set offsets 0, 0, graph 0.1, 0"
  echo "plot '$tmp/data' using 2:xtic(1) title '1 GPU', '' using 3 title '$np GPUs', \\"
  echo "  '' using (\$0 + 0.15):3:(sprintf('%d %%', \$4)) with labels offset 0,0.8 notitle"
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
[ -s "$png" ] || { echo "plot-scaling.sh: gnuplot wrote no $png" >&2; exit 1; }
echo "plot-scaling.sh: $png"
