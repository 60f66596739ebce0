#!/usr/bin/env bash
# Flotilla next to vLLM's own server on one GPU: the serving-overhead comparison with real shapes.
#
# For a lent accelerator machine (one H200, 16 cores) or any CUDA host; never needed by the tests.
# It
#   1. installs vLLM's GPU build and Flotilla's runtime dependencies (from PyPI, or from wheels in
#      ./.whl when the machine has no network: put them there first),
#   2. makes a model with Llama-3-8B's shapes (`flotilla make-model llama3-8b-shape`: config and
#      tokenizer; vLLM makes random weights on the GPU with load_format dummy),
#   3. checks that Flotilla's CPU platform plugin stepped aside (vLLM runs on its CUDA platform),
#   4. runs bench/serve_overhead.py on the GPU (vLLM's `bench serve` client; targets vllm-uni,
#      vllm-ray, flotilla, flotilla-ray; one GPU hosts one engine at a time, so the two-engine arms
#      are left out) and prints its table and ratios.
#
#   bash bench/gpu_check.sh                 # results also under $OUT when that is set
#   GPU_CHECK_TARGETS=vllm-uni,flotilla bash bench/gpu_check.sh   # fewer targets: a shorter run
#
# Exit codes: 0 done; 2 no CUDA device; 3 vLLM's GPU build cannot be installed here (no network and
# no wheels); 4 the CPU plugin did not step aside.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TARGETS="${GPU_CHECK_TARGETS:-vllm-uni,flotilla,vllm-ray,flotilla-ray}"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-bench/results}"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled

say() { echo "gpu_check: $*"; }

"$PY" - <<'EOF' || { say "no CUDA device visible to torch"; exit 2; }
import torch
assert torch.cuda.is_available()
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

# --- 1. vLLM's GPU build and Flotilla ------------------------------------------------------------------
if ! "$PY" -c "import vllm, ray" 2>/dev/null; then
    if [ -d .whl ] && ls .whl/vllm-*.whl >/dev/null 2>&1; then
        say "installing vLLM ${VLLM_VERSION} and its dependencies from ./.whl (no index)"
        "$PY" -m pip install -q --no-index --find-links .whl "vllm==${VLLM_VERSION}" ray prometheus-client
    elif "$PY" -m pip download -q --no-deps -d /tmp/pip-probe "six" >/dev/null 2>&1; then
        say "installing vLLM ${VLLM_VERSION} from PyPI"
        "$PY" -m pip install -q "vllm==${VLLM_VERSION}" "ray[serve]"
    else
        say "cannot install vLLM's GPU build: this machine reaches no package index, and ./.whl holds no"
        say "vllm wheel (vLLM ${VLLM_VERSION}'s CUDA wheel and its torch are several hundred MB each, more"
        say "than a 64 MiB working-tree transfer can carry). Run this on a CUDA host with network."
        exit 3
    fi
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
say "vllm $("$PY" -c 'import vllm; print(vllm.__version__)'), ray $("$PY" -c 'import ray; print(ray.__version__)')"

# --- 2. a model with real shapes ------------------------------------------------------------------------
"$PY" -m flotilla.cli make-model llama3-8b-shape --out models

# --- 3. the CPU plugin steps aside ----------------------------------------------------------------------
"$PY" - <<'EOF' || { say "Flotilla's CPU platform plugin did not step aside"; exit 4; }
from flotilla.cluster.vllm_platform import register
from vllm.platforms import current_platform

chosen = register()
print(f"gpu_check: platform plugin -> {chosen}; vLLM platform {type(current_platform).__name__}")
assert chosen is None and current_platform.is_cuda(), "vLLM is not on its CUDA platform"
EOF

# --- 4. the comparison ----------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
"$PY" -m bench.serve_overhead --device gpu --model models/llama3-8b-shape --targets "$TARGETS" \
    --rounds 1 --input-len 1024 --output-len 128 --prompts-c1 8 --prompts-cn 64 --concurrency 8 --no-docs
cp bench/results/serve_overhead_gpu.md bench/results/serve_overhead_gpu.json "$OUT_DIR"/ 2>/dev/null || true
say "done: bench/results/serve_overhead_gpu.md"
