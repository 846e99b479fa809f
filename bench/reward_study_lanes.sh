#!/usr/bin/env bash
# The reward study's cells (bench/reward_study.py) in two lanes, one thread each, in the background; each cell
# resumes where it stopped, a finished one is skipped in seconds. Logs: bench/results/reward_study/logs/.
#   bash bench/reward_study_lanes.sh          # start both lanes
#   bash bench/reward_study_lanes.sh status   # what each lane is doing
#   bash bench/reward_study_lanes.sh curves   # then: each finished PG cell's curve and zero-shot ends
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=bench/results/reward_study/logs
mkdir -p "$LOGS"
cell() {  # one cell, one thread
  local name="$1"; shift
  echo "$(date -u +%FT%TZ) start $name" >> "$LOGS/lanes.txt"
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/reward_study.py "$@" >> "$LOGS/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$?" >> "$LOGS/lanes.txt"
}
lane_a() {  # PG with kl on C4, the one-shot stage's seeds (they decide the mix's rule), then kl with the step refit
  cell "pg-r30-s0-kl-data-40" pg --rate 0.3 --seed 0 --source data --reward kl --steps 40
  for s in 1 2; do cell "oneshot-r30-s$s-data" oneshot --rate 0.3 --seed "$s" --source data; done
  for s in 1 2; do cell "pg-r30-s$s-kl-data-40" pg --rate 0.3 --seed "$s" --source data --reward kl --steps 40; done
  for s in 0 1 2; do cell "pg-r30-s$s-kl-data-40-step-refit" pg --rate 0.3 --seed "$s" --source data --reward kl \
    --steps 40 --variant step-refit; done
  for s in 0 1 2; do cell "oneshot-r50-s$s-data" oneshot --rate 0.5 --seed "$s" --source data; done
  for s in 0 1 2; do cell "pg-r50-s$s-kl-data-40" pg --rate 0.5 --seed "$s" --source data --reward kl --steps 40; done
}
lane_b() {  # PG with ce on C4, then the model's own text
  for s in 0 1 2; do cell "pg-r30-s$s-ce-data-40" pg --rate 0.3 --seed "$s" --source data --reward ce --steps 40; done
  for s in 0 1 2; do cell "oneshot-r30-s$s-self" oneshot --rate 0.3 --seed "$s" --source self; done
  for s in 0 1 2; do cell "pg-r30-s$s-kl-self-40" pg --rate 0.3 --seed "$s" --source self --reward kl --steps 40; done
  for s in 0 1 2; do cell "pg-r50-s$s-ce-data-40" pg --rate 0.5 --seed "$s" --source data --reward ce --steps 40; done
}
lane_curves() {  # after both lanes: each finished PG cell's curve (every 10 steps) and the zero-shot mean at its ends
  for d in bench/results/reward_study/pg/*/; do
    IFS=- read -r r s reward source steps variant <<< "$(basename "$d")"
    [[ -f "$d/heldout.json" ]] || continue
    cell "curve-$(basename "$d")" curve --rate "0.${r#r}" --seed "${s#s}" --source "$source" --reward "$reward" \
      --steps "$steps" ${variant:+--variant "$variant"} --zeroshot
  done
}
if [[ "${1:-}" == "status" ]]; then tail -n 20 "$LOGS/lanes.txt"; exit 0; fi
if [[ "${1:-}" == "curves" ]]; then
  nohup bash -c "$(declare -f cell lane_curves); LOGS=$LOGS; lane_curves" > /dev/null 2>&1 &
  echo "the curves lane started"; exit 0
fi
nohup bash -c "$(declare -f cell lane_a); LOGS=$LOGS; lane_a" > /dev/null 2>&1 &
nohup bash -c "$(declare -f cell lane_b); LOGS=$LOGS; lane_b" > /dev/null 2>&1 &
echo "two lanes started; bash bench/reward_study_lanes.sh status"
