#!/usr/bin/env bash
# The torch paths on a GPU, for the first session lent one (the `device` tool runs this as is; about
# 5 minutes on an H200): the sink's layout tests and the transformers models with their tensors on
# cuda, the CUDA tests of the device diff, then the swap pause table on cuda. Results go to $OUT
# (or ./gpu-out): pytest's log and benchmarks/swap.py's table and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
python3 -c 'import torch, sys; print(torch.__version__, torch.cuda.get_device_name(0)); sys.exit(not torch.cuda.is_available())' \
  || { echo "no CUDA device visible to torch" >&2; exit 2; }
python3 -m pip install -q -e '.[test]' 2>&1 | tail -2
rc=0
WEIGHTSYNC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/functional/test_torch_layouts.py tests/functional/test_torch_transformers.py \
  tests/unit/test_devicediff.py tests/functional/test_device_publish.py 2>&1 | tee "$out/pytest.log" | tail -15
rc=$((rc | PIPESTATUS[0]))
timeout 240 python3 benchmarks/swap.py --device cuda --json "$out/swap-cuda.json" 2>&1 | tee "$out/swap-cuda.txt" | tail -8
rc=$((rc | PIPESTATUS[0]))
exit "$rc"
