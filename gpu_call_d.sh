#!/bin/bash
export PYTHONPATH=$PWD
timeout 110 python3 tools/run_test_bucket.py gpu1 --only 'tests/unit_tests/inference/kernels/test_linear.py' --only 'tests/unit_tests/inference/engines/test_hybrid_buckets_and_graphs.py' --only 'tests/unit_tests/ssm/test_rowwise_invariance.py' > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "rank 0: (FAILED|[0-9]+ passed)" $OUT/tests.log | cut -c1-400 | tail -12
timeout 230 python3 -m benchmarks.gpu_decode --models gpt,hybrid --concurrency 1,64 --run-budget-s 25 --model-budget-s 100 --output-json $OUT/gpu_decode.json > $OUT/gpu_decode.log 2>&1; echo "decode rc=$?"
grep -E "^gpt|^hybrid|copy bandwidth|captured|Error" $OUT/gpu_decode.log | cut -c1-900
