#!/usr/bin/env bash
# The GPU checks and figures, on a machine with one or more NVIDIA GPUs (CI has none). From the project root:
#
#   bash benchmarks/gpu_checks.sh DATA_DIR OUT_DIR PART...
#
# DATA_DIR holds mnist/ and fashion-mnist/ (IDX .gz); each PART writes OUT_DIR/PART.log:
#   runtime     the Merger's tests (tests/test_runtime.py) with the loop's model on CUDA against the engine on
#               CUDA (every rank on cuda:0 when there is one GPU: gloo between them, payloads staged through host
#               memory); the deploy example under torchrun on CUDA with AMP; calibrate under torchrun on CUDA
#               (CUDA events); benchmarks/check_gpu.py (the engine's CUDA paths)
#   population  benchmarks/bench_population.py --device cuda (trials per minute)
#   generic     benchmarks/bench_generic.py --device cuda (the stacked model against a loop of modules)
#   profile     benchmarks/profile_population.py --device cuda (where a population's time goes), N = 32 and 128
#   search      benchmarks/bench_search.py --device cuda (the search a user runs: trials per minute with Optuna's
#               study and MLflow's runs on SQLite), for each SAMPLER:BATCH:TRIALS:JOBS in SEARCHES; then, if
#               PROFILE_SEARCH names one SAMPLER:BATCH:TRIALS:JOBS, its cProfile (OUT/search.prof)
#
# Python packages the machine lacks can be put in .whl/ as wheels (pydantic, optuna, ...): they are installed
# into /tmp/site first.
set -uo pipefail
DATA=$1 OUT=$2
shift 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
PY=python3
for part in "$@"; do
  log="$OUT/$part.log"
  {
    echo "== $part  $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPUs')"
    uptime
    case $part in
      runtime)
        EVOMERGE_TEST_DEVICE=cuda EVOMERGE_TEST_DATA_DIR=$DATA $PY -m pytest -p no:cacheprovider -q -o addopts="" \
          -m system -n 4 --timeout 600 tests/test_runtime.py -k "not deploy_example" 2>&1 | tail -25
        for args in "" "--slow-rank 3 --slow-factor 4"; do
          echo "-- examples/deploy/train.py, 4 ranks on one GPU, MNIST, AdamW, AMP $args"
          $PY -m torch.distributed.run --nproc-per-node 4 examples/deploy/train.py --dataset mnist --data-dir "$DATA" \
            --policy studies/policies/ring-gossip.json --epochs 1 --trace "$OUT/trace-$([ -z "$args" ] && echo even || echo slow)" $args 2>&1 | grep -v "^W\|OMP_NUM" | tail -5
        done
        echo "-- calibrate under torchrun, 2 ranks on the GPU (rank 1 emulated 3x slower)"
        $PY -m torch.distributed.run --nproc-per-node 2 -m evomerge.calibrate --study studies/mnist-stragglers.toml \
          --data-dir "$DATA" -o "$OUT/cluster.toml" --slow-rank 1 --slow-factor 3 2>&1 | grep -v "^W\|OMP_NUM" | tail -5
        cat "$OUT/cluster.toml"
        echo "-- benchmarks/check_gpu.py"
        $PY benchmarks/check_gpu.py --data-dir "$DATA"
        ;;
      population)
        $PY benchmarks/bench_population.py --device cuda --data-dir "$DATA" --sizes ${SIZES:-1 8 32 128} --scale ${SCALE:-0.25}
        ;;
      profile)
        for n in 32 128; do
          $PY benchmarks/profile_population.py --device cuda --data-dir "$DATA" --n $n --scale ${SCALE:-0.25} --top 25
        done
        ;;
      search)
        for spec in ${SEARCHES:-random:256:512:1 tpe:256:512:1 tpe:256:512:2}; do
          IFS=: read -r sampler batch trials jobs <<<"$spec"
          timeout "${SEARCH_TIMEOUT:-300}" $PY benchmarks/bench_search.py --device cuda --data-dir "$DATA" \
            --sampler "$sampler" --batch "$batch" --trials "$trials" --jobs "$jobs"
        done
        if [ -n "${PROFILE_SEARCH:-}" ]; then
          IFS=: read -r sampler batch trials jobs <<<"$PROFILE_SEARCH"
          timeout "${SEARCH_TIMEOUT:-300}" $PY benchmarks/bench_search.py --device cuda --data-dir "$DATA" \
            --sampler "$sampler" --batch "$batch" --trials "$trials" --jobs "$jobs" --profile "$OUT/search.prof"
        fi
        ;;
      generic)
        $PY benchmarks/bench_generic.py --device cuda --workers 8 64 --repeats 5 --steps 10
        ;;
    esac
  } 2>&1 | tee "$log"
done
