# Two commands that work on a fresh machine: `make demo` and `make test`.
# Each creates (once) and reuses .venv with stof-cc installed in editable mode.
# torch: `pip install torch==2.13.0` takes a CPU wheel where pip's configuration points at one
# (the development machines keep one on disk); elsewhere it downloads the CUDA build (several GB).
# For the CPU build from PyTorch's own index: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# On a GPU machine install the CUDA build of torch and the `gpu` extra instead (README).

PYTHON ?= python3
TORCH_INDEX ?=
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stof-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing torch 2.13.0 into $(VENV) (a CPU wheel where pip finds one, else the CUDA build: several GB)"
	$(PY) -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m stof_cc.cli inspect examples/tiny_bert.py:factory --quiet-graph --check
	$(PY) -m stof_cc.cli inspect examples/tiny_bert.py:factory --quiet-graph --check --passes
	$(PY) -m stof_cc.cli inspect examples/gpt2_block.py:factory --quiet-graph --check
	$(PY) -m stof_cc.cli inspect examples/encoder_layer.py:factory --quiet-graph --check
	@echo "make demo: the same layer with its mask described (a boolean mask input is known only at run time: above, torch ran it)"
	$(PY) -m stof_cc.cli inspect examples/encoder_layer.py:factory --quiet-graph --check --mask sliding:w=8
	$(PY) -m stof_cc.cli compile examples/gpt2_block.py:factory --build-dir stof_build
	$(PY) -m stof_cc.cli masks show longformer:w=128,g=32 --seq 2048 --out stof_build/masks/longformer.png
	$(PY) -m stof_cc.cli attention --mask longformer:w=128,g=32 --seq 2048 --batch 2 --build-dir stof_build \
		$$($(PY) -c 'import torch; print("--check" if torch.cuda.is_available() else "")')  # --check runs the kernel: GPUs only

test: $(STAMP)
	@echo "make test 1/2: the CPU suite (GPU tests skip without a GPU), on every core"
	$(PY) -m pytest -q -n auto -m "not slow"
	@echo "make test 2/2: the slow tests: every kernel template rendered and compiled for sm_90 by nvcc"
	@echo "  (minutes on 2 cores the first time; the cubins are kept in $${STOF_CC_CACHE:-~/.cache/stof-cc}/cubin, so later runs are quick)"
	$(PY) -m pytest -q -n auto -m slow --durations=5

lint: $(STAMP)
	$(VENV)/bin/ruff check stof_cc tests examples benchmarks

clean:
	rm -rf stof_build .pytest_cache
