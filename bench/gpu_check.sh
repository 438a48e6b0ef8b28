#!/usr/bin/env bash
# Device checks of issue 10, in one go, from the repo root of a plain checkout (no install):
#   1. the kernel tests natively on the GPU (tests/test_kernels.py, incl. CUDA graphs), and the
#      hierarchical cache's copy stream (tests/test_hicache_faults_engine.py -k cuda);
#   2. bench/gpu_kernels.py (decode attention and fused layer ops alone, Llama-3-8B shapes);
#   3. bench/gpu_bench.py (Llama-3-8B shape, random weights).
# Logs and the JSON summary go to $OUT (default /tmp/gpu_check). BENCH_ARGS passes options
# to the benchmark (e.g. BENCH_ARGS=--smoke for a dry run on a CPU machine).
set -u
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

# --noconftest: the shared conftest pulls in Ray and tokenizer fixtures these tests never use
timeout "${TEST_TIMEOUT:-120}" python -m pytest tests/test_kernels.py tests/test_layer_ops.py tests/test_sampler.py -q -rs --noconftest \
    -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest.txt"
timeout "${TEST_TIMEOUT:-120}" python -m pytest tests/test_hicache_faults_engine.py -k cuda -q -rs \
    --noconftest -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/pytest_hicache.txt"

timeout "${KERNELS_TIMEOUT:-150}" python bench/gpu_kernels.py 2>&1 | tee "$OUT/gpu_kernels.txt"

timeout "${BENCH_TIMEOUT:-280}" python bench/gpu_bench.py ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_bench.txt"
echo "gpu_check done; files in $OUT"
