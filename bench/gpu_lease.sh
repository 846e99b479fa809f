#!/usr/bin/env bash
# One lease of the GPU machine (the `device` tool: 15 minutes of device time a session, 10 per call), used for every GPU test and
# figure the open issues ask for, in as few calls as possible.
#
#   here:   bash bench/gpu_lease.sh prep     after `bash install.sh`: fills the git-ignored .gpu/ and prints the calls
#   there:  source bench/gpu_lease.sh env    at the start of each call's command: the exports (and, the first
#                                            time, the test model and data put where the tests look for them)
#           bash bench/gpu_lease.sh STAGE [SECONDS]
#                tests      the `gpu` tests (tests/test_gpu.py)
#                step-cost  bench/step_cost.py on CUDA: the default model (float32, bfloat16), random 1B and 7B
#                quality    bench/pg_quality.py: the control variate and bias compensation, 3 seeds, 300 steps
#                recovery   the converged preset (300 steps, N_s 8, leave-one-out), 3 seeds, each then LoRA-recovered
#                           (`finetune`, the paper's 4,000 x 1,024 tokens): the 30 % figure after recovery
#                long       PG to 300 steps against its init (0 steps), refit, the default and the joint preset, 3 seeds
#                tables     bench/paper_tables.py at 200 steps, 8 queues, for SECONDS (default 500); rerun to go on
#           Each stage writes $OUT/STAGE.log and $OUT/STAGE.tar.gz (its result files, as repository paths).
#   here:   tar -xzf FILES_AT/STAGE.tar.gz   from the repository root: the results land where the docs cite them
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GGUF=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf

prep() {
    cd "$ROOT" || exit 2
    bash ../shared/tools/gpu-prep >/dev/null || exit 2
    # lm-eval (zero-shot) and what it needs beyond the GPU image's packages (KINDS.md lists them); three ship as
    # source only, so they are built here (pure Python)
    local pins=(lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
                more-itertools==11.2.1 pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5
                chardet==6.0.0.post1 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 nltk==3.10.4)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --abi none --platform manylinux_2_17_x86_64 -d .gpu/whl "${pins[@]}" 2>&1 | grep -v '^WARNING' || true
    python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl rouge-score==0.1.2 sqlitedict==2.1.0 \
        word2number==1.1 2>&1 | grep -v '^WARNING' || true
    rm -rf .gpu/x && mkdir -p .gpu/x
    cp -r ../shared/models/tinystories-656k ../shared/data/zeroshot .gpu/x/
    # a call carries at most 64 MiB with the working tree: the model goes in as few parts as fit beside the tree
    local tree room n i
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    room=$(( (64 * 1048576 - tree - 2000000) / 1000000 * 1000000 ))
    cat .gpu/p[0-9]/part[0-9] > .gpu/model.gguf  # (gpu-prep's parts, in order)
    rm -rf .gpu/p[0-9]*
    split -b "$room" -d -a 1 .gpu/model.gguf .gpu/part && rm .gpu/model.gguf
    n=$(ls .gpu/part* | wc -l)
    for ((i = 0; i < n; i++)); do mkdir -p .gpu/p$i && mv .gpu/part$i .gpu/p$i/; done
    du -sh .gpu/* | sed 's/^/  /'
    echo "Device calls, back to back (the machine goes back after 30 s idle; the tree is $((tree / 1000000)) MB):"
    echo " 1. carry [\".gpu/p0\"]   mkdir -p /tmp/m && cat .gpu/p0/part0 > /tmp/m/part"
    for ((i = 1; i < n; i++)); do echo " $((i + 1)). carry [\".gpu/p$i\"]   cat .gpu/p$i/part$i >> /tmp/m/part"; done
    cat <<TXT
 $((n + 1)). carry [".gpu/whl", ".gpu/data", ".gpu/x"]   mv /tmp/m/part /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && source bench/gpu_lease.sh env && bash bench/gpu_lease.sh tests
 then, nothing to carry:   source bench/gpu_lease.sh env && bash bench/gpu_lease.sh STAGE   (step-cost, quality, recovery, long, tables 540)
Each call: timeout_s 600. Unpack each files_at/*.tar.gz here with tar -xzf from the repository root.
TXT
}

env_setup() {
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MODEL=$GGUF
    local shared="$ROOT/../shared"  # where tests/conftest.py and engine/data/text.py look
    if [[ ! -d $shared/models/tinystories-656k && -d $ROOT/.gpu/x ]]; then
        mkdir -p "$shared/models" "$shared/data"
        cp -r "$ROOT/.gpu/x/tinystories-656k" "$shared/models/"
        cp -r "$ROOT/.gpu/x/zeroshot" "$ROOT"/.gpu/data/* "$shared/data/"
    fi
    export PG_PRUNE_DATA_DIR=$(cd "$shared/data" && pwd)
    [[ -f $GGUF ]] || echo "gpu_lease: $GGUF is missing: make the assembly calls first (bash bench/gpu_lease.sh prep prints them)" >&2
}

pack() {  # pack STAGE PATH... : the stage's results as repository paths, for tar -xzf here
    local stage=$1; shift
    (cd "$ROOT" && tar -czf "${OUT:-/tmp}/$stage.tar.gz" --ignore-failed-read "$@" 2>/dev/null)
}

stage_tests() {
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py --junitxml="${OUT:-/tmp}/tests.xml"
}

stage_step_cost() {
    local out=bench/results/step_cost
    python3 bench/step_cost.py --model "$MODEL" --device cuda --repeats 20 --out $out
    python3 bench/step_cost.py --model "$MODEL" --device cuda --dtype bfloat16 --repeats 20 --out $out
    python3 bench/step_cost.py --random-config 1b --device cuda --repeats 10 --out $out
    python3 bench/step_cost.py --random-config 7b --device cuda --dtype bfloat16 --repeats 5 --out $out
    pack step-cost $out/step_cost-cuda-*.json
}

stage_quality() {
    [[ -f /tmp/plain/config.json ]] || python3 bench/plain_copy.py /tmp/plain --model "$MODEL"
    python3 bench/pg_quality.py --model /tmp/plain --device cuda --variants cv,comp --seeds 0,1,2 --steps 300 --workers 6
    pack quality bench/results/pg_quality/jobs bench/results/pg_quality/report.md
}

stage_recovery() {
    local out=bench/results/recovery pids=()
    mkdir -p $out
    for seed in 0 1 2; do
        (python3 -m engine prune --model "$MODEL" --device cuda --preset converged --prune-ratio 0.3 --seed $seed \
             --max-windows 256 --out /tmp/rec/pg-s$seed --overwrite &&
         python3 -m engine finetune --model /tmp/rec/pg-s$seed/model --out /tmp/rec/ft-s$seed --device cuda \
             --max-windows 256 --seed $seed) > /tmp/rec-s$seed.log 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}"
    tail -n 3 /tmp/rec-s*.log
    for seed in 0 1 2; do
        mkdir -p $out/s$seed
        cp /tmp/rec/pg-s$seed/{config.json,results.json} /tmp/rec/ft-s$seed/finetune_{config,results}.json $out/s$seed/
    done
    pack recovery $out
}

stage_tables() {
    local seconds=${1:-500} out=bench/results/paper_tables_gpu200
    local args=(--steps 200 --max-windows 256 --device cuda --model "$MODEL" --out $out)
    local pids=()
    for q in 1 2 3 4 5 6 7 8; do
        setsid python3 bench/paper_tables.py "${args[@]}" > "/tmp/tables-q$q.log" 2>&1 &
        pids+=($!)
        # the first queue makes the plain model copy the others read
        [[ $q == 1 ]] && while [[ ! -f $out/model/config.json ]] && kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
    done
    local end=$((SECONDS + seconds))
    while ((SECONDS < end)) && kill -0 "${pids[@]}" 2>/dev/null; do sleep 5; done
    for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done  # a cut cell resumes from its checkpoint
    sleep 3
    python3 bench/paper_tables.py "${args[@]}" --report-only > /dev/null
    cat /tmp/tables-q*.log | grep -E "running|resuming|failed" | sort | uniq
    local done=$(ls $out/cells/*/results.json 2>/dev/null)  # finished cells only: a cut one resumes there
    pack tables $out/tables.md $done ${done//results.json/config.json}
}

stage_long() {  # does PG earn anything over its refit init with plenty of steps? 300 steps against 0, 3 seeds,
    # the width-only run (FLAP's widths; the default before 2026-11-27) and the joint preset (the default since), 12
    # runs side by side on the one GPU; SECONDS: the deadline (the folders keep their names: default-*, joint-*)
    local seconds=${1:-420} out=bench/results/pg_long pids=() end
    mkdir -p $out /tmp/long
    end=$((SECONDS + seconds))
    for seed in 0 1 2; do
        for what in default joint; do
            local flags=(--prune-ratio 0.3 --seed $seed --device cuda --model "$MODEL")
            [[ $what == joint ]] && flags+=(--preset joint) || flags+=(--units heads,channels)
            for steps in 0 300; do  # (0 steps: the init mask, refit on the run's own stream as every run's final mask
                # is; it was one step at lr 1e-12 while the joint's method was pg: pg-alloc's step is scale-free)
                local name=$what-st$steps-s$seed run=(--steps $steps)
                OMP_NUM_THREADS=1 setsid python3 -m engine prune "${flags[@]}" "${run[@]}" \
                    --out /tmp/long/$name --overwrite > $out/$name.log 2>&1 &
                pids+=($!)
            done
        done
    done
    while ((SECONDS < end)) && kill -0 "${pids[@]}" 2>/dev/null; do sleep 5; done
    for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
    sleep 2
    for d in /tmp/long/*/; do
        local n=$(basename "$d"); mkdir -p $out/$n
        cp "$d"/{config.json,results.json,metrics.jsonl,masks.json} $out/$n/ 2>/dev/null
    done
    tail -n 2 $out/*.log
    pack long $out
}

case "${1:-}" in
    prep) prep ;;
    env) env_setup ;;
    tests|step-cost|quality|recovery|tables|long)
        set -o pipefail
        stage=$1; shift
        cd "$ROOT" || exit 2
        "stage_${stage//-/_}" "$@" 2>&1 | tee "${OUT:-/tmp}/$stage.log" ;;
    *) echo "usage: bash bench/gpu_lease.sh prep | source bench/gpu_lease.sh env | bash bench/gpu_lease.sh tests|step-cost|quality|recovery|tables [SECONDS]" >&2
       [[ ${BASH_SOURCE[0]} == "$0" ]] && exit 2 ;;
esac
