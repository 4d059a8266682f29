#!/usr/bin/env bash
# Every GPU measurement of issue 15, for a lent GPU machine (run from the
# repository root; results and logs go to $OUT, default ./runs/gpu):
#
#   bash bench/gpu_run.sh [PHASE...]      (default: test small big)
#
# Phases:
#   test    `make test-gpu` from this tree: C++ build with CUDA (-Werror), all
#           of CTest (layerwise_test included: its watchdog names where a case
#           stops), nonstop._core, then tests/gpu/test_gpu_torch.py (stream
#           handles, SIGKILL/resume training, layer-wise on CUDA with
#           copy="host"/"device" checked bit for bit, multistep refused on CUDA).
#   fio     O_DIRECT write bandwidth of the checkpoint disk ($BENCH_DIR), fio
#           if present, else a Python O_DIRECT writer; -> $OUT/disk.json.
#           Run by `small` and `big` themselves when not yet done in this call,
#           so the disk-bound limit is measured in the same call.
#   small   bench/gpu_overhead.py, the 111M GPT (125m), all schemes interleaved
#           (nonstop concurrent with its device snapshot ("nonstop": the
#           default device_snapshot_bytes, a quarter of free GPU memory) and
#           without it ("nonstop-direct": device_snapshot_bytes=0, the stall
#           is the whole device-to-host copy), layerwise host/device, multistep (refused on
#           CUDA: recorded), torch.save, DCP async_save thread and process mode
#           with pinned staging) at every 1, 10, 50 steps, the disk-bound
#           limit, restore into CUDA tensors vs DCP load.
#   big     the same for the 1.38B-parameter GPT (1.4b, 16.5 GB of state),
#           max_in_flight 1 (the slot file holds 2 checkpoints: 33 GB of disk).
#
# One device call runs at most 10 minutes: run the phases in three calls,
#   bash bench/gpu_run.sh test      (build ~3 min + CTest + torch tests)
#   bash bench/gpu_run.sh small     (~9 min)
#   bash bench/gpu_run.sh big       (~9 min)
# (a warm machine keeps build-gpu between calls; `small`/`big` build the
# package first when it is missing). Env:
#   DEADLINE=560     seconds for this call; a bench phase starts no run that
#                    would end after it (its table then holds what ran)
#   SRC=dir          build and run in that tree instead of .
#   BENCH_DIR=/tmp/nonstop-gpu-bench   where checkpoints are written
#   BENCH_ARGS="..." extra arguments for bench/gpu_overhead.py
#   GPU_CTEST_ARGS="-E name"  leave a CTest test out
#   DRY_RUN=1        print the commands instead of running them (checks the
#                    script on a machine without a GPU)
set -u
START=$(date +%s)
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
cd "${SRC:-.}" || exit 2
JOBS=${JOBS:-$(nproc)}
BENCH_DIR=${BENCH_DIR:-/tmp/nonstop-gpu-bench}
PY=${PYTHON:-python3}
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(test small big)
for ph in "${PHASES[@]}"; do
  case $ph in test|fio|small|big) ;; *) echo "unknown phase $ph (test fio small big)"; exit 2 ;; esac
done
run() {  # run (or, with DRY_RUN=1, print) a command
  if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi
}
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

{
  date -u
  echo "phases: ${PHASES[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)" 2>&1
  $PY -c "import pybind11; print('pybind11', pybind11.__version__)" 2>&1
  ${CXX:-c++} --version 2>&1 | head -1
  free -g 2>&1 | head -2
  df -h /tmp . 2>&1 | tail -n +2
  command -v fio || echo "no fio: the Python O_DIRECT writer measures the disk"
} | tee "$OUT/env-$START.txt"

rc=0
phase_test() {
  rm -rf build-gpu/pkg  # assembled by make test-gpu after CTest
  local t0; t0=$(date +%s)
  run timeout $(( $(left) - 20 )) make test-gpu JOBS="$JOBS" GPU_CTEST_ARGS="${GPU_CTEST_ARGS:-}" \
    > "$OUT/test-gpu.log" 2>&1
  local r=$?
  echo "== make test-gpu: exit $r after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/test-gpu.log"
  if [ ! -e build-gpu/pkg/nonstop/__init__.py ] && ls build-gpu/src/python/_core*.so > /dev/null 2>&1; then
    # make stopped before the torch test (a CTest test failed or hung): run it alone.
    echo "== make test-gpu stopped before the torch test; running it on its own" | tee -a "$OUT/test-gpu.log"
    assemble
    PYTHONPATH=build-gpu/pkg run timeout $(( $(left) > 30 ? $(left) - 10 : 20 )) \
      $PY tests/gpu/test_gpu_torch.py >> "$OUT/test-gpu.log" 2>&1
    echo "== tests/gpu/test_gpu_torch.py: exit $?" | tee -a "$OUT/test-gpu.log"
  fi
  grep -E "tests passed|tests failed|\*\*\*|Not Run|PASS|FAIL|SKIP|stuck|nonstop from|^== " \
    "$OUT/test-gpu.log"
  [ $r -ne 0 ] && tail -40 "$OUT/test-gpu.log"
  [ $r -ne 0 ] && rc=$r
}

assemble() {  # build-gpu/pkg/nonstop: the Python package with the built _core
  mkdir -p build-gpu/pkg/nonstop
  cp python/nonstop/*.py build-gpu/pkg/nonstop/ && cp build-gpu/src/python/_core*.so build-gpu/pkg/nonstop/
}

ensure_pkg() {
  ls build-gpu/pkg/nonstop/_core*.so > /dev/null 2>&1 && return 0
  if ! ls build-gpu/src/python/_core*.so > /dev/null 2>&1; then
    echo "== building nonstop._core (no build-gpu on this machine yet)"
    PYB=$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null)
    run cmake -S . -B build-gpu -G Ninja -DNONSTOP_CUDA=ON -DNONSTOP_BUILD_TESTS=OFF \
      -DNONSTOP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$PYB" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build-pkg.log" 2>&1 &&
      run cmake --build build-gpu -j "$JOBS" --target _core >> "$OUT/build-pkg.log" 2>&1 ||
      { tail -20 "$OUT/build-pkg.log"; return 1; }
  fi
  [ -n "${DRY_RUN:-}" ] || assemble
}

DISK_GBPS=""
phase_fio() {
  mkdir -p "$BENCH_DIR"
  local f="$BENCH_DIR/disk-probe.dat"
  if command -v fio > /dev/null; then
    # Sequential 4 MiB O_DIRECT writes, 4 jobs (nonstop's default writers),
    # 4 GiB each, fsync at the end: what a checkpoint's writes can reach.
    run fio --name=ckpt --filename="$f" --rw=write --bs=4M --direct=1 --ioengine=psync \
      --numjobs=4 --size=4G --offset_increment=4G --end_fsync=1 --group_reporting \
      --output-format=json --output="$OUT/fio.json" > /dev/null 2>&1
    [ -n "${DRY_RUN:-}" ] && { DISK_GBPS=1.0; return 0; }
    DISK_GBPS=$($PY -c "import json; j = json.load(open('$OUT/fio.json')); print(round(j['jobs'][0]['write']['bw_bytes'] / 1e9, 3))")
    echo "{\"tool\": \"fio\", \"GBps\": $DISK_GBPS}" > "$OUT/disk.json"
  else
    run $PY bench/gpu_overhead.py --measure-disk "$BENCH_DIR" --json "$OUT/disk.json"
    [ -n "${DRY_RUN:-}" ] && { DISK_GBPS=1.0; return 0; }
    DISK_GBPS=$($PY -c "import json; print(json.load(open('$OUT/disk.json'))['GBps'])")
  fi
  rm -f "$f"
  echo "== O_DIRECT write bandwidth of $BENCH_DIR: $DISK_GBPS GB/s" | tee -a "$OUT/disk.log"
}

phase_bench() {  # $1: small | big
  ensure_pkg || { echo "== bench $1 skipped: nonstop._core not built"; rc=1; return; }
  [ -z "$DISK_GBPS" ] && phase_fio
  local size=125m args=""
  [ "$1" = big ] && { size=1.4b; args="--batch 4 --max-in-flight 1 --periods 2 --min-steps 20 --steps 3 --warmup 1"; }
  local budget=$(( $(left) - 90 ))
  [ "$1" = big ] && budget=$(( budget - 60 ))  # the restore of 16.5 GB after the rounds
  [ $budget -lt 60 ] && budget=60
  echo "== bench $size: --time-budget $budget s"
  PYTHONPATH=build-gpu/pkg run timeout $(( $(left) > 40 ? $(left) - 10 : 30 )) \
    $PY bench/gpu_overhead.py --size $size $args --repeats 1 --disk-GBps "$DISK_GBPS" --restore \
    --out "$BENCH_DIR" --json "$OUT/gpu_overhead_$size.json" --time-budget $budget \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_overhead_$size.log"
  local r=${PIPESTATUS[0]}
  echo "== bench $size: exit $r"
  # The device snapshot of the concurrent rows (issue 25): what each run
  # snapshotted and sent straight, the drain, and Register's one-line note.
  [ -z "${DRY_RUN:-}" ] && [ -e "$OUT/gpu_overhead_$size.json" ] && $PY - "$OUT/gpu_overhead_$size.json" <<'PYEOF' | tee "$OUT/device_snapshot_$size.txt"
import json, sys
j = json.load(open(sys.argv[1]))
for r in j.get("runs", []):
    if r["scheme"].startswith(("nonstop/", "nonstop-direct/")):
        print(f"{r['scheme']:<20} stall/ckpt {r['stall_per_ckpt_s'] * 1e3:8.1f} ms  snapshot "
              f"{r.get('snapshot_bytes', 0) / 1e9:6.2f} GB  direct {r.get('direct_bytes', 0) / 1e9:6.2f} GB"
              f"  drain {r.get('snapshot_drain_s', 0):6.3f} s  busy {r.get('snapshot_busy', 0)}"
              f"  capacity {r.get('device_snapshot_capacity', 0) / 1e9:.2f} GB"
              f"  [{r.get('device_snapshot_note', '')}]")
PYEOF
  [ $r -ne 0 ] && rc=$r
  rm -rf "$BENCH_DIR"
}

for ph in "${PHASES[@]}"; do
  case $ph in
    test) phase_test ;;
    fio) phase_fio ;;
    small|big) phase_bench $ph ;;
  esac
done
echo "== gpu_run.sh ${PHASES[*]}: exit $rc after $(( $(date +%s) - START )) s"
exit $rc
