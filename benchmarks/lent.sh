# Sourced by benchmarks/gpu.sh and benchmarks/cores.sh, the scripts for a lent device machine: the
# repository root as the working folder, $out (the variable OUT the device tool sets, else the
# folder the caller names), and the packages that machine lacks, carried as wheels in .whl/ (gpu.sh
# says which and how they are fetched), installed beside the tree. Where they do not install (e.g.
# here, where the wheels are for the device's Python 3.12) it says so and goes on without them: the
# caller's module check then names what is missing. `mark STEP` appends the seconds since the start
# to $out/env.txt, so that a session can plan its device time by step (the device tool returns at
# most 8 files from $OUT: the scripts write fewer).
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
out="${OUT:-$1}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site:$PWD"
  else
    echo "the carried wheels did not install; going on without them" >&2
  fi
fi

mark() { echo "$SECONDS s: $*" >>"$out/env.txt"; }
