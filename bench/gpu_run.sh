#!/usr/bin/env bash
# Issue 25's GPU check in ONE device call (<= 9 minutes), from the repository
# root; results and logs go to $OUT (default ./runs/gpu):
#
#   bash bench/gpu_run.sh [--cpu] [PHASE...]      (default: test small big)
#
# Every phase has its share of DEADLINE (540 s for the call) and stops
# inside it; a scheme that crashes or hangs is a row with its error and the
# call goes on. At the end bench/gpu_targets.py prints every target of issue
# 25's "What it must show" with its figure and PASS / FAIL / MISSING
# ($OUT/gpu_targets.json).
#
# Phases:
#   test    the GPU-relevant part of `make test-gpu`: the CUDA build (-Werror)
#           of nonstop._core and the tests whose behaviour depends on CUDA
#           (cuda_copy_engine_gpu_test, cuda_fallback_gpu_test and, where the
#           machine has GoogleTest, cuda_select_test, device_snapshot_test,
#           restore_device_test, restore_test, layerwise_test), CTest on
#           those, then tests/gpu/test_gpu_torch.py (resume after SIGKILL in
#           the concurrent and multistep modes, layer-wise, multistep replay,
#           device snapshots, restore into CUDA tensors). The rest of CTest
#           is CPU code: CI runs it. FULL_TEST=1: all of `make test-gpu`.
#   small   bench/gpu_overhead.py, the 111M GPT: none, nonstop-tiered (the
#           tiered cadence, disk_every="auto", device snapshot) at 1 and 10,
#           nonstop-auto at 10 (mode="auto", tiered: the mode it measured
#           cheaper, its figures in the row and in device_snapshot_$SMALL.txt),
#           DCP async_save thread and process mode at 10; then restore into
#           CUDA tensors vs DCP load (cold) and from the memory tier.
#   big     the 1.38B GPT (16.5 GB of state, max_in_flight 1): nonstop-tiered
#           at 10 and 50, and at 50 nonstop-direct (no device snapshot: the
#           whole device-to-host copy is the stall) beside nonstop-multistep.
#   fio     O_DIRECT write bandwidth of $BENCH_DIR (run by small/big when not
#           yet done in this call).
#
# --cpu (or CPU=1): the same plumbing on this CPU machine, to find Python
# errors before a device call: the torch test with --device cpu, the
# benches with the tiny model and short windows, the package from python/
# (the venv's build). Its figures mean nothing.
#
# Env:
#   DEADLINE=540     seconds for the whole call
#   TEST_BUDGET=230  seconds for the test phase (SMALL_BUDGET=130 for small;
#                    big gets what is left)
#   SRC=dir          build and run in that tree instead of .
#   BENCH_DIR=/tmp/nonstop-gpu-bench   where checkpoints are written
#   SMALL_RUNS="...", BIG_RUNS="..."   the runs (bench/gpu_overhead.py --runs)
#   BENCH_ARGS="..." extra arguments for bench/gpu_overhead.py
#   GPU_CTEST_ARGS="-E name"  leave a CTest test out
#   DRY_RUN=1        print the commands instead of running them
set -u
START=$(date +%s)
CPU=${CPU:-}
PHASES=()
for a in "$@"; do
  case $a in --cpu) CPU=1 ;; *) PHASES+=("$a") ;; esac
done
[ ${#PHASES[@]} -eq 0 ] && PHASES=(test small big)
for ph in "${PHASES[@]}"; do
  case $ph in test|fio|small|big) ;; *) echo "unknown phase $ph (test fio small big)"; exit 2 ;; esac
done
DEADLINE=${DEADLINE:-540}
TEST_BUDGET=${TEST_BUDGET:-230}
SMALL_BUDGET=${SMALL_BUDGET:-130}
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
cd "${SRC:-.}" || exit 2
JOBS=${JOBS:-$(nproc)}
BENCH_DIR=${BENCH_DIR:-/tmp/nonstop-gpu-bench}
PY=${PYTHON:-python3}
PKG=build-gpu/pkg
SMALL=125m BIG=1.4b
SMALL_RUNS=${SMALL_RUNS:-"nonstop-tiered/10 nonstop-auto/10 dcp/10 dcp-process/10 nonstop-tiered/1"}
BIG_RUNS=${BIG_RUNS:-"nonstop-tiered/10 nonstop-direct/50 nonstop-multistep/50 nonstop-tiered/50"}
if [ -n "$CPU" ]; then
  PY=${PYTHON:-$PWD/.venv/bin/python}
  PKG=python
  SMALL=tiny BIG=tiny-big
fi
run() {  # run (or, with DRY_RUN=1, print) a command
  if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi
}
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# Seconds a phase may take: its budget, within what is left of the call.
budget() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }

{
  date -u
  echo "phases: ${PHASES[*]}${CPU:+ (--cpu: a check of the plumbing, not a measurement)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)" 2>&1
  $PY -c "import pybind11; print('pybind11', pybind11.__version__)" 2>&1
  ${CXX:-c++} --version 2>&1 | head -1
  free -g 2>&1 | head -2
  df -h /tmp /dev/shm . 2>&1 | tail -n +2
  command -v fio || echo "no fio: the Python O_DIRECT writer measures the disk"
} | tee "$OUT/env-$START.txt"

rc=0
# The tests whose behaviour depends on a CUDA build or device (the others
# are CPU code that CI runs); those this machine can build (GoogleTest ones
# only where it has GoogleTest).
GPU_TESTS="cuda_copy_engine_gpu_test cuda_fallback_gpu_test cuda_select_test device_snapshot_test restore_device_test restore_test layerwise_test"

phase_test() {
  local t0 b r; t0=$(date +%s); b=$(budget "$TEST_BUDGET")
  : > "$OUT/test-gpu.log"
  if [ -n "$CPU" ]; then
    echo "== --cpu: tests/gpu/test_gpu_torch.py --device cpu (no C++ build)" | tee -a "$OUT/test-gpu.log"
    PYTHONPATH=$PKG run timeout "$b" $PY tests/gpu/test_gpu_torch.py --device cpu \
      --timeout $(( b - 5 )) >> "$OUT/test-gpu.log" 2>&1
    r=$?
    echo "== tests/gpu/test_gpu_torch.py: exit $r" | tee -a "$OUT/test-gpu.log"
  else
    if [ -n "${FULL_TEST:-}" ]; then
      run timeout $(( b - 10 )) make test-gpu JOBS="$JOBS" GPU_CTEST_ARGS="${GPU_CTEST_ARGS:-}" \
        >> "$OUT/test-gpu.log" 2>&1
      r=$?
      echo "== make test-gpu: exit $r after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/test-gpu.log"
    else
      run make test-gpu-configure >> "$OUT/test-gpu.log" 2>&1
      local have want="" re=""
      have=$(ninja -C build-gpu -t targets all 2>/dev/null | cut -d: -f1)
      for t in $GPU_TESTS; do
        if grep -qx "$t" <<< "$have"; then want="$want $t"; re="$re|$t"; fi
      done
      echo "== test: building _core$want" | tee -a "$OUT/test-gpu.log"
      run timeout $(( b - 20 )) cmake --build build-gpu -j "$JOBS" --target _core $want \
        >> "$OUT/test-gpu.log" 2>&1
      r=$?
      echo "== build: exit $r after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/test-gpu.log"
      if [ $r -eq 0 ] && [ -n "$re" ]; then
        (cd build-gpu && run timeout 150 ctest --output-on-failure -j "$JOBS" --timeout 120 \
           -R "^(${re#|})\$" ${GPU_CTEST_ARGS:-}) >> "$OUT/test-gpu.log" 2>&1
        local c=$?
        echo "== ctest: exit $c after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/test-gpu.log"
        [ $c -ne 0 ] && r=$c
      fi
    fi
    if ls build-gpu/src/python/_core*.so > /dev/null 2>&1; then
      assemble
      local tl; tl=$(( b - ($(date +%s) - t0) - 5 ))
      [ $tl -lt 60 ] && tl=60
      PYTHONPATH=$PKG run timeout "$tl" $PY tests/gpu/test_gpu_torch.py --timeout $(( tl - 5 )) \
        >> "$OUT/test-gpu.log" 2>&1
      local p=$?
      echo "== tests/gpu/test_gpu_torch.py: exit $p" | tee -a "$OUT/test-gpu.log"
      [ $p -ne 0 ] && r=$p
    fi
  fi
  echo "== test phase: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/test-gpu.log"
  grep -E "tests passed|tests failed|\*\*\*|Not Run|^PASS|^FAIL|^SKIP|stuck|nonstop from|^== " \
    "$OUT/test-gpu.log"
  [ $r -ne 0 ] && tail -40 "$OUT/test-gpu.log"
  [ $r -ne 0 ] && rc=$r
}

assemble() {  # build-gpu/pkg/nonstop: the Python package with the built _core
  mkdir -p build-gpu/pkg/nonstop
  cp python/nonstop/*.py build-gpu/pkg/nonstop/ && cp build-gpu/src/python/_core*.so build-gpu/pkg/nonstop/
}

ensure_pkg() {
  [ -n "$CPU" ] && return 0
  ls $PKG/nonstop/_core*.so > /dev/null 2>&1 && return 0
  if ! ls build-gpu/src/python/_core*.so > /dev/null 2>&1; then
    echo "== building nonstop._core (no build-gpu on this machine yet)"
    run make test-gpu-configure > "$OUT/build-pkg.log" 2>&1 &&
      run cmake --build build-gpu -j "$JOBS" --target _core >> "$OUT/build-pkg.log" 2>&1 ||
      { tail -20 "$OUT/build-pkg.log"; return 1; }
  fi
  [ -n "${DRY_RUN:-}" ] || assemble
}

DISK_GBPS=""
phase_fio() {
  mkdir -p "$BENCH_DIR"
  local f="$BENCH_DIR/disk-probe.dat"
  if [ -n "$CPU" ]; then DISK_GBPS=1.0; return 0; fi
  if command -v fio > /dev/null; then
    # Sequential 4 MiB O_DIRECT writes, 4 jobs (nonstop's default writers),
    # 2 GiB each, fsync at the end: what a checkpoint's writes can reach.
    run timeout 60 fio --name=ckpt --filename="$f" --rw=write --bs=4M --direct=1 --ioengine=psync \
      --numjobs=4 --size=2G --offset_increment=2G --end_fsync=1 --group_reporting \
      --output-format=json --output="$OUT/fio.json" > /dev/null 2>&1
    [ -n "${DRY_RUN:-}" ] && { DISK_GBPS=1.0; return 0; }
    DISK_GBPS=$($PY -c "import json; j = json.load(open('$OUT/fio.json')); print(round(j['jobs'][0]['write']['bw_bytes'] / 1e9, 3))" 2>/dev/null)
    [ -n "$DISK_GBPS" ] && echo "{\"tool\": \"fio\", \"GBps\": $DISK_GBPS}" > "$OUT/disk.json"
  else
    run timeout 60 $PY bench/gpu_overhead.py --measure-disk "$BENCH_DIR" --json "$OUT/disk.json"
    [ -n "${DRY_RUN:-}" ] && { DISK_GBPS=1.0; return 0; }
    DISK_GBPS=$($PY -c "import json; print(json.load(open('$OUT/disk.json'))['GBps'])" 2>/dev/null)
  fi
  rm -f "$f"
  [ -z "$DISK_GBPS" ] && DISK_GBPS=0
  echo "== O_DIRECT write bandwidth of $BENCH_DIR: $DISK_GBPS GB/s" | tee -a "$OUT/disk.log"
}

phase_bench() {  # $1: small | big
  ensure_pkg || { echo "== bench $1 skipped: nonstop._core not built"; rc=1; return; }
  local t0 b; t0=$(date +%s)
  [ -z "$DISK_GBPS" ] && phase_fio
  local size=$SMALL runs=$SMALL_RUNS args="--restore"
  b=$(budget "$SMALL_BUDGET")
  if [ "$1" = big ]; then
    size=$BIG runs=$BIG_RUNS b=$(budget "$(left)")
    args="--batch 4 --max-in-flight 1 --periods 1 --min-steps 10 --steps 3 --warmup 1 --none-steps 15"
  fi
  b=$(( b - ($(date +%s) - t0) ))
  if [ -n "$CPU" ]; then
    args="$args --device cpu --batch 2 --seq 64 --none-steps 6 --min-steps 4 --periods 1"
    [ "$1" = big ] && size=tiny  # the JSON is named $BIG all the same
  fi
  if [ $b -lt 30 ]; then echo "== bench $1: no time left ($b s)"; return; fi
  local name=$1; [ "$1" = small ] && name=$SMALL; [ "$1" = big ] && name=$BIG
  # The bench stops starting runs 15 s before its share ends (--time-budget),
  # and is killed 5 s before; what ran is in the JSON either way.
  echo "== bench $1 ($size): --time-budget $(( b - 15 )) s, runs: $runs"
  PYTHONPATH=$PKG run timeout $(( b - 5 )) \
    $PY bench/gpu_overhead.py --size $size $args --repeats 1 --disk-GBps "$DISK_GBPS" \
    --runs $runs --out "$BENCH_DIR" --json "$OUT/gpu_overhead_$name.json" \
    --time-budget $(( b - 15 )) --run-timeout $(( b / 2 )) ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_overhead_$name.log"
  local r=${PIPESTATUS[0]}
  echo "== bench $1: exit $r after $(( $(date +%s) - t0 )) s"
  # The device snapshot of the concurrent rows (issue 25): what each run
  # snapshotted and sent straight, the drain, and Register's one-line note.
  [ -z "${DRY_RUN:-}" ] && [ -e "$OUT/gpu_overhead_$name.json" ] && $PY - "$OUT/gpu_overhead_$name.json" <<'PYEOF' | tee "$OUT/device_snapshot_$name.txt"
import json, sys
j = json.load(open(sys.argv[1]))
for r in j.get("runs", []):
    if r["scheme"].startswith(("nonstop/", "nonstop-direct/", "nonstop-tiered/")):
        print(f"{r['scheme']:<20} stall/ckpt {r['stall_per_ckpt_s'] * 1e3:8.1f} ms  snapshot "
              f"{r.get('snapshot_bytes', 0) / 1e9:6.2f} GB  direct {r.get('direct_bytes', 0) / 1e9:6.2f} GB"
              f"  drain {r.get('snapshot_drain_s', 0):6.3f} s  busy {r.get('snapshot_busy', 0)}"
              f"  capacity {r.get('device_snapshot_capacity', 0) / 1e9:.2f} GB"
              f"  disk_every {r.get('disk_every', 1)} persisted {r.get('persisted', '-')}"
              f"  [{r.get('device_snapshot_note', '')}]")
    if r.get("mode_auto"):
        m = r["mode_auto"]
        print(f"{r['scheme']:<20} mode='auto' ran {m['active']} (decided {m['decided']}, "
              f"{m['switches']} switches): {m['reason']}")
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
WALL=$(( $(date +%s) - START ))
echo "== gpu_run.sh ${PHASES[*]}: exit $rc after $WALL s"
[ -z "${DRY_RUN:-}" ] && $PY bench/gpu_targets.py --out "$OUT" --small "$SMALL" --big "$BIG" \
  --wall-s "$WALL"
exit $rc
