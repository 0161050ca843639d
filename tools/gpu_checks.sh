#!/usr/bin/env bash
# GPU validation run (used on the lent H200 machines): NCCL bucket tests, bf16 training
# against the CPU goldens, and the Mamba kernel comparison. Logs go to ${OUT:-gpu_out}/.
#   bash tools/gpu_checks.sh [buckets|train|kernels|all]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in
  buckets|train|kernels|all) ;;
  -h|--help) echo "usage: bash tools/gpu_checks.sh [buckets|train|kernels|all]"; exit 0 ;;
  *) echo "usage: bash tools/gpu_checks.sh [buckets|train|kernels|all] (got '$what')" >&2; exit 2 ;;
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
