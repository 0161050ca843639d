#!/usr/bin/env bash
# GPU validation run (used on the lent H200 machines): NCCL bucket tests, bf16 training
# against the CPU goldens, and the Mamba kernel comparison. Logs go to ${OUT:-gpu_out}/.
#   bash tools/gpu_checks.sh [buckets|train|kernels|all|perf]
# perf (not part of all): the speed issues' benchmarks on one GPU within one 10-minute call
# (gpu_train's three configurations, gpu_decode's GPT rows at 64 and 1 requests, the GPU
# fused-kernel tests), JSON and logs in $OUT. The hybrid configuration runs alone with its
# own budget: mamba-ssm's autotuned Triton kernels compile for about two minutes on a cold cache.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in
  buckets|train|kernels|all|perf) ;;
  -h|--help) echo "usage: bash tools/gpu_checks.sh [buckets|train|kernels|all|perf]"; exit 0 ;;
  *) echo "usage: bash tools/gpu_checks.sh [buckets|train|kernels|all|perf] (got '$what')" >&2; exit 2 ;;
esac
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .gpu_whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $ngpu; torch $(python3 -c 'import torch; print(torch.__version__)')"

if [[ $what == buckets || $what == all ]]; then
  python3 tools/run_test_bucket.py gpu2 --only 'tests/unit_tests/test_process_groups.py' \
    --only 'tests/unit_tests/tensor_parallel/*' --only 'tests/unit_tests/distributed/*' \
    --only 'tests/unit_tests/optimizer/*' --only 'tests/unit_tests/pipeline_parallel/*' \
    --only 'tests/unit_tests/models/hybrid/*' 2>&1 | tee "$OUT/bucket_gpu2.log" | tail -n 5
fi

train_case() {  # name entry nproc flags...
  local name=$1 entry=$2 nproc=$3; shift 3
  torchrun --standalone --nproc-per-node "$nproc" "$entry" "$@" --bf16 --distributed-backend nccl \
    --metrics-jsonl "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -n 20 "$OUT/$name.log"; }
}
if [[ $what == train || $what == all ]]; then
  gpt=$(python3 -c 'import json; print(" ".join(json.load(open("tests/functional_tests/cases/gpt_tp2_pp2.json"))["flags"]))')
  hyb=$(python3 -c 'import json; print(" ".join(json.load(open("tests/functional_tests/cases/hybrid_tp2_gtp2.json"))["flags"]))')
  train_case gpt_1gpu examples/pretrain_gpt.py 1 $gpt --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  train_case gpt_tp2 examples/pretrain_gpt.py 2 $gpt --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
  train_case gpt_pp2 examples/pretrain_gpt.py 2 $gpt --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
  train_case hybrid_1gpu examples/pretrain_hybrid.py 1 $hyb --tensor-model-parallel-size 1 --generalized-tensor-parallel-size 1
  train_case hybrid_tp2 examples/pretrain_hybrid.py 2 $hyb --tensor-model-parallel-size 2 --generalized-tensor-parallel-size 1
  train_case hybrid_pp2 examples/pretrain_hybrid.py 2 $hyb --tensor-model-parallel-size 1 --generalized-tensor-parallel-size 1 --pipeline-model-parallel-size 2
  python3 tools/compare_to_goldens.py "$OUT" 2>&1 | tee "$OUT/train_summary.txt"
fi

if [[ $what == kernels || $what == all ]]; then
  python3 -m benchmarks.mamba_kernels_gpu 2>&1 | tee "$OUT/mamba_kernels.log" | tail -n 15
fi

if [[ $what == perf ]]; then
  [[ $ngpu -ge 1 ]] || { echo "gpu_checks.sh perf: needs a CUDA GPU" >&2; exit 2; }
  timeout 180 python3 benchmarks/gpu_train.py --config gpt2,llama --quick --budget-s 165 \
    --output-json "$OUT/gpu_train.json" > "$OUT/gpu_train.log" 2>&1; echo "gpu_train gpt2,llama: exit $?"
  timeout 200 python3 benchmarks/gpu_train.py --config hybrid --quick --budget-s 185 \
    --output-json "$OUT/gpu_train_hybrid.json" > "$OUT/gpu_train_hybrid.log" 2>&1; echo "gpu_train hybrid: exit $?"
  grep -hE "^(must show|== |   (ours|plain|ratios|error|mode|sequential))" "$OUT/gpu_train.log" "$OUT/gpu_train_hybrid.log"
  python3 - "$OUT" <<'PY' || true
import json, sys
tflops = {}
for name in ("gpu_train.json", "gpu_train_hybrid.json"):
    for config, result in json.load(open(f"{sys.argv[1]}/{name}")).get("configs", {}).items():
        tflops[config] = result.get("variants", {}).get("ours", {}).get("tflops")
if tflops.get("gpt2") and tflops.get("hybrid"):
    print(f"hybrid / gpt2 TFLOP/s (ours): {tflops['hybrid'] / tflops['gpt2']:.3f} (target >= 0.7)")
PY
  timeout 140 python3 -m benchmarks.gpu_decode --models gpt --concurrency 64,1 --trials 2 --no-unpadded \
    --run-budget-s 20 --model-budget-s 110 --output-json "$OUT/gpu_decode.json" > "$OUT/gpu_decode.log" 2>&1
  echo "gpu_decode: exit $?"; grep -E "^gpt|copy bandwidth" "$OUT/gpu_decode.log"
  timeout 50 python3 tools/run_test_bucket.py gpu1 --only 'tests/unit_tests/fusions/*' > "$OUT/fusions.log" 2>&1
  echo "fused-kernel tests: exit $?"; grep -E "^rank 0: " "$OUT/fusions.log"
fi
