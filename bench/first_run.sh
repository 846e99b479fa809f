#!/usr/bin/env bash
# Issue 65's first-run protocol: README command 1 as a new user meets it. A fresh clone of this checkout's HEAD
# beside ../shared, every cache empty ($PG_PRUNE_CACHE and $PG_PRUNE_SELF_CALIB_CACHE in one new
# folder: the model's de-quantised copy, the dense perplexity, the speed probes, the statistics, the metrics, the own text); then
# what install.sh builds in that cache (`python -m engine.tools.model_copy`: the model's copy and its dense perplexity;
# timed apart, in install.txt: install.sh's minutes are not the run's; COLD=1 skips it, every cache empty at the run);
# then `python -m engine prune --prune-ratio 0.3 --time-budget 10 --out runs/quickstart --overwrite` (with --seed S
# for seeds other than 0), seeds 0, 1 and 2, each then again (the second run: the caches its first run left). The
# packages are the installed ones; the clone's engine is imported (PYTHONPATH).
# Run it on idle cores: each run's figures carry the probe's ms per token, so machines can be read side by side.
#
#   bash bench/first_run.sh                 # seeds 0 1 2, first and second runs
#   bash bench/first_run.sh 1               # seed 1 only
#   CORES=0 bash bench/first_run.sh         # on one core (taskset -c 0): a slower or busy machine's stand-in
#   RATE=0.5 bash bench/first_run.sh        # the 50 % default (the own text: its generation is a first-run cost)
#   COLD=1 bash bench/first_run.sh          # without install.sh's builds: every cache empty when the run starts
#   bash bench/first_run.sh --dry-run       # the commands and folders, running nothing
#   bash bench/first_run.sh --report        # the table from the runs on disk
# Results: bench/results/first_run/<commit>-r<rate>[-c<cores>]/s<seed>-{first,second}/ (results.json, the log, the
# `time -v` report); the clone and the caches are removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)
RATE=${RATE:-0.3}
DRY=0; REPORT=0; SEEDS=()
for a in "$@"; do
  case $a in
    --dry-run) DRY=1 ;;
    --report) REPORT=1 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) [[ $a =~ ^[0-9]+$ ]] || { echo "error: a seed is a whole number, got '$a'" >&2; exit 2; }; SEEDS+=("$a") ;;
  esac
done
[[ ${#SEEDS[@]} -gt 0 ]] || SEEDS=(0 1 2)
TAG="$(git rev-parse --short HEAD)-r${RATE}${CORES:+-c$CORES}${COLD:+-cold}"
OUT=$HERE/bench/results/first_run/$TAG
report() { PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" python bench/first_run_report.py "$HERE/bench/results/first_run"; }
if [[ $REPORT == 1 ]]; then report; exit; fi
command=(python -m engine prune --prune-ratio "$RATE" --time-budget 10 --out runs/quickstart --overwrite)
PIN=(); [[ -n "${CORES:-}" ]] && PIN=(taskset -c "$CORES")
if [[ $DRY == 1 ]]; then
  for s in "${SEEDS[@]}"; do
    [[ -z "${COLD:-}" ]] && echo "install.sh's builds, seed $s: ${PIN[*]} python -m engine.tools.model_copy (in the empty cache) -> $OUT/s$s-first/install.txt"
    for kind in first second; do
    extra=(); [[ $s != 0 ]] && extra=(--seed "$s")
    echo "$kind run, seed $s: ${PIN[*]} ${command[*]} ${extra[*]} -> $OUT/s$s-$kind/"
  done; done
  exit 0
fi
[[ -d ../shared ]] || { echo "error: ../shared is missing beside this checkout: the data and the tiny model live there" >&2; exit 2; }
PARENT=$(dirname "$HERE")
CLONE=$(mktemp -d "$PARENT/first-run-clone.XXXXXX")
CACHE=$(mktemp -d)
trap 'rm -rf "$CLONE" "$CACHE"' EXIT
git clone -q "$HERE" "$CLONE/repo"
ln -s "$PARENT/shared" "$CLONE/shared"  # (the clone's ../shared)
mkdir -p "$OUT"
for s in "${SEEDS[@]}"; do
  rm -rf "$CACHE"; mkdir -p "$CACHE"  # (each seed's first run on empty caches; its second on what the first left)
  if [[ -z "${COLD:-}" && ! -f $OUT/s$s-first/results.json ]]; then  # (install.sh's builds, in the empty cache)
    mkdir -p "$OUT/s$s-first"
    ( cd "$CLONE/repo" && PYTHONPATH="$CLONE/repo" PG_PRUNE_CACHE="$CACHE/cache" /usr/bin/time -f "%e s wall" \
        "${PIN[@]}" python -m engine.tools.model_copy ) > "$OUT/s$s-first/install.txt" 2>&1 || true
    echo "  install.sh's builds: $(tail -n 1 "$OUT/s$s-first/install.txt")"
  fi
  for kind in first second; do
    dest=$OUT/s$s-$kind
    if [[ -f $dest/results.json ]]; then echo "$kind run, seed $s: done"; continue; fi
    extra=(); [[ $s != 0 ]] && extra=(--seed "$s")
    echo "[$(date +%T)] $kind run, seed $s: ${PIN[*]} ${command[*]} ${extra[*]}"
    rm -rf "$CLONE/repo/runs/quickstart"
    ( cd "$CLONE/repo" && PYTHONPATH="$CLONE/repo" PG_PRUNE_CACHE="$CACHE/cache" \
        PG_PRUNE_SELF_CALIB_CACHE="$CACHE/self-calib" /usr/bin/time -v -o "$CLONE/time.txt" \
        "${PIN[@]}" "${command[@]}" "${extra[@]}" > "$CLONE/log.txt" 2>&1 ) || { echo "  failed: $(tail -n 2 "$CLONE/log.txt")"; }
    mkdir -p "$dest"
    cp "$CLONE/log.txt" "$dest/run.log"; cp "$CLONE/time.txt" "$dest/time.txt"
    grep -m1 "^plan:.*ms per token from" "$CLONE/log.txt" > "$dest/plan.txt" || true  # (kept: the probe's rate)
    for f in results.json config.json; do [[ -f $CLONE/repo/runs/quickstart/$f ]] && cp "$CLONE/repo/runs/quickstart/$f" "$dest/"; done
    grep -E "Elapsed \(wall" "$dest/time.txt" | sed 's/^\s*/  /'
    tail -n 2 "$dest/run.log" | sed 's/^/  /'
  done
done
report
