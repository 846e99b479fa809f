#!/usr/bin/env bash
# The must-show commands of issues 24 and 28, as a user types them, on the default model, timed (wall clock,
# loading and evaluations included) on whatever cores are idle. Each run's folder, log and `time -v` report go to
# bench/results/must_show/; a run with a results.json is not run again.
#
#   bash bench/must_show.sh flap           # issue 24: python -m engine prune --method flap --prune-ratio 0.3 on FLAP's
#                                          # units (--units heads,channels: a run that names no units is the joint since
#                                          # 2026-11-27)
#   bash bench/must_show.sh flap-again     # the same, into a folder named after the commit
#   bash bench/must_show.sh flap16         # the same on 16 init batches (the default is 64)
#   bash bench/must_show.sh budget 0 1 2   # issue 28: python -m engine prune --prune-ratio 0.3 --time-budget 10, per seed
#   bash bench/must_show.sh budget-again 0 # the same, into a folder named after the commit (to compare engines; since
#                                          # 2026-11-27 the command starts from the default preset, the joint)
#   bash bench/must_show.sh width 0 1 2    # the same with --units heads,channels (the default run before 2026-11-27)
#   bash bench/must_show.sh joint 0 1 2    # the README's quickstart: the 10-minute run with --preset joint (Layerwise-PPL's
#                                          # layers fixed, FLAP's widths on 16 batches, PG on the widths), per seed
#   bash bench/must_show.sh warm           # a small run that fills this machine's caches (the GGUF's de-quantised
#                                          # copy, the dense perplexity, the speed probes) before the timed runs
#   bash bench/must_show.sh oneshot 0 1 2  # issue 51: the default run without --time-budget to its final mask, one step
#                                          # (--steps 1: the phases before the steps are the 50-step run's), each seed
#                                          # with the one-shot passes in float32 and in bfloat16 (--pass-dtype)
#   bash bench/must_show.sh oneshot-rb 128 0 1 2  # the same in bfloat16 with the refit's statistics on 128 batches
#   bash bench/must_show.sh default        # issue 25: the default run (python -m engine prune --prune-ratio 0.3), whose
#                                          # duration bench/plan_check.py compares with the app's estimate
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results/must_show
mkdir -p "$OUT"
run() {  # name, then the prune flags
  local name=$1; shift
  if [[ -f "$OUT/$name/results.json" ]]; then echo "$name: done"; return; fi
  echo "[$(date +%T)] $name: python -m engine prune $* --out $OUT/$name --overwrite"
  /usr/bin/time -v -o "$OUT/$name.time.txt" python -m engine prune "$@" --out "$OUT/$name" --overwrite > "$OUT/$name.log" 2>&1
  grep -E "Elapsed \(wall|Maximum resident" "$OUT/$name.time.txt"
  tail -n 4 "$OUT/$name.log"
}
what=$1; shift
case $what in
  flap) run flap30 --method flap --units heads,channels --prune-ratio 0.3 ;;
  flap-again) run "flap30-$(git rev-parse --short HEAD)" --method flap --units heads,channels --prune-ratio 0.3 ;;
  flap16) run "flap30-b16-$(git rev-parse --short HEAD)" --method flap --units heads,channels --prune-ratio 0.3 --init-batches 16 ;;
  default) run default30 --prune-ratio 0.3 ;;
  warm) run "warm-$(git rev-parse --short HEAD)" --prune-ratio 0.3 --steps 1 --init-batches 1 --layer-init-batches 1 \
          --reconstruct-batches 1 --mix-batches 1 --val-batches 1 --no-eval-init ;;
  oneshot-rb) batches=$1; shift; for seed in "$@"; do
                run "oneshot-bfloat16-rb$batches-s$seed-$(git rev-parse --short HEAD)" --prune-ratio 0.3 --steps 1 \
                  --seed "$seed" --pass-dtype bfloat16 --reconstruct-batches "$batches"; done ;;
  oneshot) for seed in "$@"; do for dtype in float32 bfloat16; do
             run "oneshot-$dtype-s$seed-$(git rev-parse --short HEAD)" --prune-ratio 0.3 --steps 1 --seed "$seed" \
               --pass-dtype "$dtype"; done; done ;;
  budget) for seed in "$@"; do run "tb10-s$seed" --prune-ratio 0.3 --time-budget 10 --seed "$seed"; done ;;
  budget-again) for seed in "$@"; do run "tb10-s$seed-$(git rev-parse --short HEAD)" --prune-ratio 0.3 --time-budget 10 --seed "$seed"; done ;;
  width) for seed in "$@"; do run "tb10-width-s$seed-$(git rev-parse --short HEAD)" --units heads,channels --prune-ratio 0.3 \
           --time-budget 10 --seed "$seed"; done ;;
  joint) for seed in "$@"; do run "tb10-joint-s$seed-$(git rev-parse --short HEAD)" --preset joint --prune-ratio 0.3 \
           --time-budget 10 --seed "$seed"; done ;;
  *) echo "usage: bash bench/must_show.sh flap | flap-again | flap16 | default | warm | oneshot SEED... | oneshot-rb BATCHES SEED... | budget SEED... | budget-again SEED... | width SEED... | joint SEED..." >&2; exit 2 ;;
esac
