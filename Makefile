# Quickstart: `make serve`, then `make test`. Both create .venv when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
# Two cores are the norm here; more threads than cores only adds contention.
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# vLLM's `speculators` (EAGLE-3 data tools) in a virtualenv of its own: it pins a transformers
# older than ours. The tests run its commands, unmodified, against a tierserve server. CPU torch
# first and as a constraint, or pip pulls CUDA torch and ~3 GB of nvidia wheels.
SPEC       := .venv-speculators
SPEC_STAMP := $(SPEC)/.installed

.PHONY: install serve test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Without CUDA, install the CPU build of torch first so the range in pyproject is already
	# satisfied and pip never pulls the multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install -q torch==2.13.0 || \
	  $(BIN)/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
	fi
	# Mooncake Store's client links against libibverbs and libnuma, even over TCP; the CPU
	# attention kernel is built with g++; pyright (make lint) runs on Node.js.
	if command -v apt-get >/dev/null 2>&1 && ! { dpkg -s libibverbs1 libnuma1 >/dev/null 2>&1 && command -v g++ >/dev/null && command -v node >/dev/null; }; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libibverbs1 libnuma1 g++ nodejs; \
	fi
	$(BIN)/pip install -q -e '.[dev,bench,storage]'
	touch $(STAMP)

# The CPU attention kernel, compiled for this CPU and torch (~15 s) into ~/.cache/tierserve;
# without it --attention-backend auto falls back to torch.
$(KERNELS): $(STAMP) $(wildcard tierserve/layers/kernels/*.cpp tierserve/layers/kernels/*.h tierserve/layers/kernels/__init__.py)
	$(BIN)/python -m tierserve.layers.kernels || echo "CPU kernels not built: attention runs on torch"
	touch $(KERNELS)

$(SPEC_STAMP):
	test -x $(SPEC)/bin/python || $(PY) -m venv $(SPEC)
	$(SPEC)/bin/pip install -q torch==2.13.0 || \
	  $(SPEC)/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	echo torch==2.13.0 > $(SPEC)/constraints.txt
	$(SPEC)/bin/pip install -q -c $(SPEC)/constraints.txt speculators==0.9.0
	$(SPEC)/bin/pip uninstall -q -y torchvision torchaudio
	touch $(SPEC_STAMP)

install: $(STAMP) $(KERNELS)

serve: $(STAMP) $(KERNELS)
	$(BIN)/tierserve serve $(ARGS)

# Two workers: most of the suite's time is servers and ranks starting, which overlap well on
# two cores. tests/conftest.py groups the tests (a file's servers start once).
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations 25

# The suite runs two workers, their servers and their ranks on two cores: many more OpenMP
# threads than cores. Spinning while they wait (libgomp's default) takes the core from a process
# that has work; passive waiting ran the TP, DP and DeepSeek files 8 % faster on 12 % less CPU.
#
# Python caches compiled modules, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1, as in some containers): the suite starts hundreds of servers, cores
# and ranks, each compiling tierserve anew without the cache (~0.7 s a process here), and pytest
# rewrote its plugins' asserts anew in each worker (collection 26 s instead of 12).
test: $(STAMP) $(KERNELS) $(SPEC_STAMP)
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} PYTHONDONTWRITEBYTECODE= \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright

clean:
	rm -rf $(VENV) $(SPEC) .pytest_cache .ruff_cache *.egg-info
