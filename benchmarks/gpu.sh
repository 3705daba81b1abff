#!/usr/bin/env bash
# The torch paths on a GPU, for a session lent one (the `device` tool runs this as is: `bash
# benchmarks/gpu.sh` with timeout_s=600 and carry [".whl"]; 4-5 minutes on an H200, 8 on an H100): the codec's
# kernels compiled in 16 processes, the sink's layout tests and the transformers models with their
# tensors on cuda, the CUDA tests of the device diff, then an ans block decoded on the device against
# the host decoder (benchmarks/devicedecode.py), then the swap pause table on cuda and the rows of
# a larger model (rows print as they finish, so a cut run keeps what it measured). Results go to $OUT (or ./gpu-out): env.txt
# (with each step's end, in seconds), jit.txt, pytest.log, devicedecode-cuda.txt, swap-cuda.txt/.json
# and swap-cuda-large.txt/.json: 8 files, the most the device tool returns.
# The machine reaches no package index: its own python3 (torch with CUDA, numba, transformers,
# safetensors, xxhash, aiohttp ...) is used, and what it lacks travels as wheels in .whl/, fetched
# here beforehand (the device tool's README: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 ... -d .whl zstandard boto3 botocore s3transfer jmespath argcomplete
# cryptography cffi pycparser`). The package itself is used from the tree (PYTHONPATH), not
# installed: an editable install needs the index for its build backend. vLLM and SGLang are not
# run (no index, no model hub there); their layouts are tested on CPU against reference modules
# (tests/engine_ref.py).
set -uo pipefail
source "$(dirname "$0")/lent.sh" gpu-out
{
  date -u
  nvidia-smi -L
  lscpu | grep -E "Model name|^CPU\(s\)"
  grep -o -w "avx512[a-z_0-9]*\|bmi2\|avx2" /proc/cpuinfo | sort -u | tr "\n" " "; echo
  python3 -c 'import sys, torch, numba, numpy, transformers; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numba", numba.__version__, "numpy", numpy.__version__, "transformers", transformers.__version__)'
  python3 -c 'import llvmlite.binding as b; b.initialize_native_target(); print("llvm cpu", b.get_host_cpu_name())'
} 2>&1 | tee "$out/env.txt"
python3 -c 'import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, ok and torch.cuda.get_device_name(0)); sys.exit(not ok)' \
  || { echo "no CUDA build of torch, or no device visible to it" >&2; exit 2; }
python3 -c 'import weightsync, zstandard, xxhash, numba, safetensors, transformers, pytest, boto3' \
  || { echo "a module the runs need is missing (see above)" >&2; exit 2; }
rc=0
# A cold cache is minutes of one CPU (tests/conftest.py warms up before the first test): in parallel first.
timeout 200 python3 -m weightsync.codec.jit --jobs "$(nproc)" 2>&1 | tee "$out/jit.txt" | tail -3
rc=$((rc | PIPESTATUS[0]))
mark "kernels compiled"
WEIGHTSYNC_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=10 \
  tests/functional/test_torch_layouts.py tests/functional/test_torch_transformers.py \
  tests/unit/test_devicediff.py tests/functional/test_device_publish.py tests/unit/test_ans_torch.py 2>&1 | tee "$out/pytest.log" | tail -15
rc=$((rc | PIPESTATUS[0]))
mark "CUDA tests"
for changed in 0.03 0.15; do  # lr 1e-6-like and lr 1e-5-like densities
  timeout 60 python3 benchmarks/devicedecode.py --device cuda --changed "$changed" 2>&1 | tee -a "$out/devicedecode-cuda.txt"
  rc=$((rc | PIPESTATUS[0]))
done
mark "devicedecode"
timeout 200 python3 benchmarks/swap.py --device cuda --threads 8 --json "$out/swap-cuda.json" 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$out/swap-cuda.txt" | tail -12
rc=$((rc | PIPESTATUS[0]))
mark "swap table"
# A model about 3x larger (64 experts a layer), ans at 2.5%: the pause against a copy of more bytes.
timeout 150 python3 benchmarks/swap.py --device cuda --threads 8 --experts 64 --codec ans --change 0.025 \
  --json "$out/swap-cuda-large.json" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$out/swap-cuda-large.txt" | tail -6
rc=$((rc | PIPESTATUS[0]))
mark "swap table, 882 MB model"
exit "$rc"
