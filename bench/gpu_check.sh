#!/usr/bin/env bash
# Device checks of issue 10, in one go, from the repo root of a plain checkout (no install):
#   1. the kernel, layer-op, sampler and sync-free tests natively on the GPU (incl. CUDA
#      graphs), the hierarchical cache's copy stream (tests/test_hicache_faults_engine.py
#      -k cuda) and the whole Engine on CUDA against the CPU's (tests/test_engine_gpu.py);
#   2. bench/gpu_kernels.py (decode attention and fused layer ops alone, Llama-3-8B shapes);
#   3. bench/gpu_bench.py (Llama-3-8B shape, random weights).
# Usage: bench/gpu_check.sh [tests|bench|all]  (default all). The device tool runs a command
# for at most 600 s and all of this can take longer: run `tests` (step 1) and `bench` (steps 2
# and 3) as two calls. Logs and the JSON summaries go to $OUT (default /tmp/gpu_check).
# BENCH_ARGS passes options to gpu_bench.py (e.g. BENCH_ARGS=--smoke for a dry run on a CPU).
set -u
STAGE=${1:-all}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
export OUT
mkdir -p "$OUT"

python - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
for name in ("triton", "flashinfer", "pytest", "safetensors", "transformers"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
EOF

# the repo root is the package: link it as `radixray` instead of installing
LINK=$(mktemp -d)
ln -s "$PWD" "$LINK/radixray"
export PYTHONPATH="$LINK${PYTHONPATH:+:$PYTHONPATH}"

if [ "$STAGE" != bench ]; then
# --noconftest: the shared conftest pulls in Ray and tokenizer fixtures these tests never use
timeout "${TEST_TIMEOUT:-120}" python -m pytest tests/test_kernels.py tests/test_layer_ops.py \
    tests/test_sampler.py tests/test_sync_free.py -q -rs --noconftest -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest.txt"
timeout "${TEST_TIMEOUT:-180}" python -m pytest tests/test_hicache_faults_engine.py -k cuda \
    tests/test_engine_gpu.py -q -rs --noconftest -p no:cacheprovider 2>&1 | tail -20 \
    | tee "$OUT/pytest_engine.txt"
fi

if [ "$STAGE" != tests ]; then
timeout "${KERNELS_TIMEOUT:-150}" python bench/gpu_kernels.py 2>&1 | tee "$OUT/gpu_kernels.txt"

timeout "${BENCH_TIMEOUT:-280}" python bench/gpu_bench.py ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_bench.txt"
fi
echo "gpu_check $STAGE done; files in $OUT"
