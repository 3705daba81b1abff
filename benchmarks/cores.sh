#!/usr/bin/env bash
# The codec's throughput on a host of many cores, for a session lent a device machine (16 cores of
# a Xeon beside its GPU): the `device` tool runs this as is, `bash benchmarks/cores.sh` with
# timeout_s=600 (about 6 minutes on a bare machine) and carry [".whl"] (the wheels of
# benchmarks/gpu.sh). Issue 18 asks for `ans` at 0.5x memcpy or more on all cores for large
# tensors; the development machine has two, shared, where memcpy of two threads moved 1.4-1.85x one
# thread's bytes from run to run. This runs `benchmarks/codec.py --large-only` (benchmarks/e2e.py's
# 2.03 GiB pair; `ans` and `sparse`, memcpy beside them, one core and all it may use) on all cores,
# then limited to 8, 4 and 2 of them (taskset), so the ratios can be read against the core count.
# Results go to $OUT (or ./cores-out): env.txt (with each step's end), codec-large.txt (every
# run's tables) and codec-large-N.json for each N.
set -uo pipefail
source "$(dirname "$0")/lent.sh" cores-out
{
  date -u
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|L3"
  python3 -c 'import llvmlite.binding as b; b.initialize_native_target(); print("llvm cpu", b.get_host_cpu_name())'
} 2>&1 | tee "$out/env.txt"
python3 -c 'import weightsync, zstandard, xxhash, numba, safetensors' || { echo "a module is missing" >&2; exit 2; }
rc=0
# A bare machine has neither numba's cache nor the checkpoints: both first, each with its own limit
# (75 s for the kernels in 16 processes on the H100 machine; the pair ~90 s on one core here).
timeout 200 python3 -m weightsync.codec.jit --jobs "$(nproc)" 2>&1 | tail -1
rc=$((rc | PIPESTATUS[0]))
mark "kernels compiled"
timeout 240 python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import e2e; e2e.trajectory("full", 3)' \
  || { echo "the 2.03 GiB checkpoints were not built" >&2; exit 2; }
mark "pair built"
# The first N of the CPUs this process may use (their numbers need not start at 0).
cpus=$(python3 -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))')
n=$(wc -w <<<"$cpus")
for cores in $(printf "%s\n" "$n" 8 4 2 | awk -v n="$n" '$1 <= n' | sort -rnu); do
  list=$(tr " " "\n" <<<"$cpus" | head -n "$cores" | paste -sd,)
  echo "## $cores cores: $list" >>"$out/codec-large.txt"
  timeout 150 taskset -c "$list" python3 benchmarks/codec.py --large-only --json "$out/codec-large-$cores.json" \
    2>&1 | tee -a "$out/codec-large.txt" | grep -E "encode|decode|memcpy|CPU|load"
  rc=$((rc | PIPESTATUS[0]))
  mark "$cores cores"
done
exit "$rc"
