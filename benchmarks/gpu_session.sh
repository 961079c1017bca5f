#!/usr/bin/env bash
# The GPU checks of issue 20 on a borrowed GPU machine that has PyTorch with CUDA but no
# internet and none of medfl's other dependencies (the "cuda" image of a lent device: Python
# 3.12, torch 2.11+cu130, numpy, pandas, matplotlib, scikit-image, grpcio, protobuf...).
#
#   bash benchmarks/gpu_session.sh wheels            # here, with PyPI: fill .whl/ (about 27 MB)
#   bash benchmarks/gpu_session.sh base REV          # here: unpack REV into .ab/base for "compare"
#   bash benchmarks/gpu_session.sh run WHAT [OUT]    # there: install .whl/, then run WHAT, logs in OUT
#
# WHAT: "tests" (tests/engine/test_cuda.py, the compute tests and the guard on the GPU), "bench"
# (engine_overhead.py on resnet2d and resnet3d, fp32, on $GPU_DEVICE, default cuda, interleaved
# repeats, figures also in JSON), "profile" (medfl's steady rounds of resnet2d under cProfile),
# "compare" (benchmarks/compare.py: .ab/base, or $AB_BASE, against this tree on resnet2d, 2 pairs
# with --steps; carry .ab), "guard" (payload_guard.py with the replies on $GPU_DEVICE, scanned
# there and, as before issue 50, on the host; device_reads.py), "flower" (flower_overhead.py on
# the demo bundle's job: a loopback Flower round on the lent machine's host cores, with where its
# time and CPU go; no GPU used), or several joined by commas
# ("bench,profile,tests": about 5 minutes on an H200, inside the 10 minutes a lent machine runs
# one command). OUT defaults to $OUT (what a lent machine sends back) or ./gpu_logs. Every step
# has its own time limit, so one that hangs does not take the others' time; the exit status is
# the first failing step's.
#
# "wheels" downloads, for CPython 3.12 on x86-64 Linux and without their dependencies, the
# distributions medfl needs that the image lacked when it was last listed (2026-11-17), at
# the versions installed in this checkout's .venv (run `make setup` first). Keep .whl/ out of
# git (.git/info/exclude); it travels with the working tree when named in the run's carry.
set -euo pipefail
cd "$(dirname "$0")/.."

# what medfl needs (its dependencies' dependencies included) that the GPU image does not have
MISSING="alembic annotated-types cffi cryptography fastapi fire flwr grpcio-health-checking
importlib-resources iterators mako monai nibabel opacus prompt-toolkit pycparser pycryptodome
pydantic pydantic-core pydicom shap slicer sqlalchemy starlette termcolor tomli tomli-w
typing-inspection tzdata uvicorn wcwidth"

wheels() {
    local py=.venv/bin/python pins=()
    [ -x "$py" ] || { echo "gpu_session.sh wheels: no .venv here; run 'make setup' first" >&2; exit 2; }
    for name in $MISSING; do
        pins+=("$name==$("$py" -c "import sys; from importlib.metadata import version; print(version(sys.argv[1]))" "$name")")
    done
    mkdir -p .whl
    local pyver=${WHEEL_PYTHON:-3.12}   # the GPU image's Python
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --abi "cp${pyver/./}" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/: name .whl in the run's carry"
}

step() {   # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in OUT/NAME.log
    local name=$1 limit=$2 t0 rc=0
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
    tail -n 25 "$OUT_DIR/$name.log"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
    [ "$rc" = 0 ] || [ "$FAILED" != 0 ] || FAILED=$rc
}

run() {
    local what=${1:-} py=${PYTHON:-python3} site=/tmp/medfl-site dev=${GPU_DEVICE:-cuda}
    local part
    for part in ${what//,/ }; do
        case "$part" in tests|bench|profile|compare|guard|flower) ;;
            *) echo "gpu_session.sh run: WHAT is tests, bench, profile, compare, guard or flower (or several, comma-separated), not '$what'" >&2; exit 2 ;;
        esac
    done
    [ -n "$what" ] || { echo "gpu_session.sh run: say WHAT: tests, bench, profile, compare, guard or flower" >&2; exit 2; }
    OUT_DIR=${2:-${OUT:-gpu_logs}}
    FAILED=0
    mkdir -p "$OUT_DIR"
    ls .whl/*.whl > /dev/null 2>&1 || { echo "gpu_session.sh run: no wheels in .whl/ (run 'wheels' where PyPI is reachable and carry .whl)" >&2; exit 2; }
    # the carried wheels and medfl itself (its entry points name the built-in plugins) beside the image's packages
    "$py" -m pip install -q --no-deps --no-index --target "$site" .whl/*.whl
    "$py" -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" .
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$py" - <<'EOF' | tee "$OUT_DIR/machine.txt"
import os, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{os.cpu_count()} host cores")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
import medfl, monai, flwr, opacus
print(f"medfl {medfl.__file__}, monai {monai.__version__}, flwr {flwr.__version__}, opacus {opacus.__version__}")
EOF
    for part in ${what//,/ }; do
        case "$part" in
        tests)
            step cuda_tests 240 "$py" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_compute.py tests/engine/test_guard_device_scan.py ;;
        bench)
            step bench_resnet2d 240 "$py" benchmarks/engine_overhead.py --workload resnet2d --device "$dev" --rounds 5 \
                --repeats 3 --skip-flower --skip-memory --json "$OUT_DIR/bench_resnet2d.json"
            step bench_resnet3d 150 "$py" benchmarks/engine_overhead.py --workload resnet3d --device "$dev" --rounds 5 \
                --repeats 3 --skip-flower --skip-memory --json "$OUT_DIR/bench_resnet3d.json" ;;
        profile)
            step profile_resnet2d 120 "$py" benchmarks/engine_overhead.py --workload resnet2d --device "$dev" --rounds 5 \
                --profile "$OUT_DIR/profile_resnet2d.pstats" ;;
        compare)
            step compare_resnet2d 480 "$py" benchmarks/compare.py "${AB_BASE:-.ab/base}" --pairs 2 --steps \
                --workdir "$OUT_DIR/compare" --json "$OUT_DIR/compare_resnet2d.json" -- --workload resnet2d \
                --device "$dev" --rounds 5 --repeats 2 ;;
        guard)
            step guard_device 120 "$py" benchmarks/payload_guard.py --device "$dev" --images 200 --repeats 5
            step guard_host 120 "$py" benchmarks/payload_guard.py --device "$dev" --scan host --images 200 --repeats 5
            step device_reads 90 "$py" benchmarks/device_reads.py --device "$dev" ;;
        flower)   # Flower's commands (flower-superlink, flwr-clientapp...) were installed in $site/bin
            PATH="$site/bin:$PATH" step flower_demo 300 "$py" benchmarks/flower_overhead.py \
                --bundle bundles/demo/configs/train.json --rounds 6 --skip-anchor --out "$OUT_DIR/flower_demo" ;;
        esac
    done
    return "$FAILED"
}

base() {   # base REV: REV unpacked into .ab/base (a lent machine has no .git), named in .ab/base/COMMIT
    local rev=${1:?gpu_session.sh base: say which revision} commit
    commit=$(git rev-parse --verify "$rev^{commit}")
    rm -rf .ab/base && mkdir -p .ab/base
    git archive "$commit" | tar -x -C .ab/base
    echo "$rev $commit" > .ab/base/COMMIT
    grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
    echo "$rev ($commit) in .ab/base: name .ab in the run's carry, then run compare"
}

case "${1:-}" in
    wheels) wheels ;;
    base) shift; base "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; [ "${1:-}" = -h ] || [ "${1:-}" = --help ] || exit 2 ;;
esac
