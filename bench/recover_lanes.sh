#!/usr/bin/env bash
# The recovery study's cells (bench/recover_study.py) in two lanes, one thread each, in the background: the tuning
# seeds first (0, 1, 2: where a row is chosen), every row and text at the 2- and 5-minute rungs (the rows that
# lose at 5 minutes are dropped before 30 are spent on them: give the kept rows as ROWS="kl-lora kl-full" and
# RUNGS=2,5,10,30 for the next pass), lane a at 30 %, lane b at 50 %. Each cell needs its confirmation cell's
# init run (bench/confirm_lanes.sh: the default's export, no steps) finished. A cell resumes where it stopped. Logs:
# bench/results/recover_study/logs/.
#   bash bench/recover_lanes.sh                         # the first pass: every row, rungs 2 and 5, seeds 0-2
#   ROWS="kl-lora mix-lora" RUNGS=2,5,10,30 SEEDS="0 1 2 3 4 5" bash bench/recover_lanes.sh
#   RATES=30 SEEDS=0 AFTER=PID bash bench/recover_lanes.sh  # one lane (30 %), once process PID has ended
#   TEXTS=c4 bash bench/recover_lanes.sh                # the C4 text's cells only (TEXTS="c4 own" by default)
#   CODE=/path/to/a/checkout bash bench/recover_lanes.sh   # that checkout's engine and bench (a worktree at a
#                                          # fixed commit); the results land in this checkout's bench/results
#   bash bench/recover_lanes.sh status
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)
CODE=${CODE:-$HERE}
LOGS=$HERE/bench/results/recover_study/logs
mkdir -p "$LOGS"
if [[ "$CODE" != "$HERE" ]]; then  # (the cells write through the other checkout's links into this one)
  mkdir -p "$CODE/bench/results"
  for d in recover_study confirm; do
    [[ -L "$CODE/bench/results/$d" ]] || { rm -rf "$CODE/bench/results/$d"; ln -s "$HERE/bench/results/$d" "$CODE/bench/results/$d"; }
  done
fi
ROWS=${ROWS:-"ce-lora kl-lora kl-full mix-lora"}
RUNGS=${RUNGS:-2,5}
SEEDS=${SEEDS:-"0 1 2"}
RATES=${RATES:-"30 50"}
TEXTS=${TEXTS:-"c4 own"}
if [[ "${1:-}" == "status" ]]; then
  if [[ -f "$LOGS/lanes.txt" ]]; then tail -n 20 "$LOGS/lanes.txt"; else echo "no lane has started ($LOGS)"; fi
  exit 0
fi
lane() {  # a rate: every seed, row and text
  local r="$1"
  for s in $SEEDS; do for text in $TEXTS; do for row in $ROWS; do  # (every row on a text before the next text)
    local name="r$r-s$s-$row-$text"
    echo "$(date -u +%FT%TZ) start $name $RUNGS" >> "$LOGS/lanes.txt"
    PYTHONPATH="$CODE" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PG_PRUNE_CACHE="$HERE/bench/results/confirm/cache" \
      PG_PRUNE_SELF_CALIB_CACHE="$HERE/bench/results/confirm/selfcalib" \
      python "$CODE/bench/recover_study.py" cell --rate "0.$r" --seed "$s" --row "$row" --text "$text" \
      --minutes "$RUNGS" --without zeroshot >> "$LOGS/$name.log" 2>&1
    echo "$(date -u +%FT%TZ) end $name rc=$?" >> "$LOGS/lanes.txt"
  done; done; done
}
wait_for=""
[[ -n "${AFTER:-}" ]] && wait_for="while kill -0 ${AFTER} 2>/dev/null; do sleep 20; done; "
for r in $RATES; do  # each lane a session of its own, its autogroup at nice 19 (plain nice would not yield the cores)
  setsid nohup bash -c "echo 19 > /proc/self/autogroup 2>/dev/null; ${wait_for}$(declare -f lane); HERE='$HERE'; CODE='$CODE'; \
    LOGS='$LOGS'; ROWS='$ROWS'; RUNGS='$RUNGS'; SEEDS='$SEEDS'; TEXTS='$TEXTS'; lane $r" > /dev/null 2>&1 < /dev/null &
done
echo "lane(s) $RATES started (rows: $ROWS; texts: $TEXTS; rungs: $RUNGS; seeds: $SEEDS${AFTER:+; after process $AFTER}); bash bench/recover_lanes.sh status"
