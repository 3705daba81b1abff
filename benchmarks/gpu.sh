#!/usr/bin/env bash
# The torch paths on a GPU, for the first session lent one (the `device` tool runs this as is, e.g.
# `bash benchmarks/gpu.sh` with timeout_s=540; about 5 minutes on an H200): the sink's layout tests
# and the transformers models with their tensors on cuda, the CUDA tests of the device diff, then
# an ans block decoded on the device against the host decoder (benchmarks/devicedecode.py), then
# the swap pause table on cuda (rows print as they finish, so a cut run keeps what it measured).
# Results go to $OUT (or ./gpu-out): pytest's log, devicedecode's table, benchmarks/swap.py's table and JSON.
# torch is not installed here: the machine's own CUDA build is used (the test extra pins a CPU
# wheel). vLLM and SGLang themselves are not run: the machine reaches no package index or model
# hub; their layouts are tested on CPU against reference modules (tests/engine_ref.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
python3 -c 'import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, ok and torch.cuda.get_device_name(0)); sys.exit(not ok)' \
  || { echo "no CUDA build of torch, or no device visible to it" >&2; exit 2; }
python3 -m pip install -q --no-deps -e . 2>&1 | tail -1
python3 -c 'import numpy, safetensors, zstandard, xxhash, numba, transformers, pytest' 2>/dev/null \
  || python3 -m pip install -q numpy safetensors zstandard xxhash numba 'transformers>=5' pytest hypothesis boto3 aiohttp prometheus-client tqdm argcomplete 2>&1 | tail -1
rc=0
WEIGHTSYNC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/test_torch_layouts.py tests/functional/test_torch_transformers.py \
  tests/unit/test_devicediff.py tests/functional/test_device_publish.py tests/unit/test_ans_torch.py 2>&1 | tee "$out/pytest.log" | tail -15
rc=$((rc | PIPESTATUS[0]))
timeout 120 python3 benchmarks/devicedecode.py --device cuda 2>&1 | tee "$out/devicedecode-cuda.txt"
rc=$((rc | PIPESTATUS[0]))
timeout 180 python3 benchmarks/swap.py --device cuda --threads 8 --json "$out/swap-cuda.json" 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$out/swap-cuda.txt" | tail -12
rc=$((rc | PIPESTATUS[0]))
exit "$rc"
