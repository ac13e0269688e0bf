# The README's commands. All create .venv on first use (Python 3.12, from .python-version).
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=
# Side venv for the transformers parity tests (tests/interop): torch's CPU build is for Python 3.11.
HF_PYTHON ?= env PYENV_VERSION=3.11.7 python3
HF_VENV := .cache/hf-venv
HF_STAMP := $(HF_VENV)/.installed

DEMO_BPE_TOKENIZER := .cache/demo-bpe/tokenizer.json
NOTEBOOKS_STAMP := $(VENV)/.notebooks-installed
# jax's CUDA plugin at the jax pin, for `m3-plan --target h200` (XLA:GPU ahead of time, no GPU
# needed; pretrain/gpu_target.py). Beside the venv, not in it: there, every jax process would try
# to start CUDA.
PLAN_GPU := .cache/plan-gpu
PLAN_GPU_STAMP := $(PLAN_GPU)/.installed
JAX_PIN = $(shell sed -n 's/.*"jax==\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: demo demo-bpe test notebooks plan-gpu clean-demo

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "m3jax needs Python 3.12; found " + sys.version.split()[0] + " at " + sys.executable)'
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/m3-train --config configs/demo.yaml --run-dir runs/demo $(ARGS)

# configs/demo-bpe.yaml: the demo with a BPE tokenizer (trained once, offline), MTP, accumulation
demo-bpe: $(STAMP) $(DEMO_BPE_TOKENIZER)
	$(VENV)/bin/m3-train --config configs/demo-bpe.yaml --run-dir runs/demo-bpe $(ARGS)

$(DEMO_BPE_TOKENIZER): | $(STAMP)
	$(VENV)/bin/m3-tokenizer train --input demo:multimodal --input demo:text --vocab-size 1024 \
		--output $@

# The kernel tests (Pallas' and Mosaic GPU's interpreters) run in pytest processes of their own:
# in one process with the rest, a later XLA:CPU compile in a training test crashed in libgcc's
# unwinder on a stale registered eh_frame (benchmarks/RESULTS.md, 2026-12-02 and 2026-12-03); the
# same crash came to the kernel tests after the Mosaic GPU interpreter's (2026-12-07: twice in a
# row in test_msa_query_slots.py's compiles), so those run first in a process of their own, the
# other kernel tests then in another. Kernels and the rest run side by side (each mostly keeps one
# core busy; CI has two): the rest's output streams, the kernels' follows it from
# $(KERNEL_TEST_LOG); any failing fails the run. ARGS (paths, -k ...) run one process as given.
KERNEL_TEST_LOG := .cache/test-kernels.log
MOSAIC_TESTS := $(wildcard tests/pallas_kernels/test_*mosaic*.py)
test: $(STAMP) $(HF_STAMP) $(PLAN_GPU_STAMP)
ifeq ($(strip $(ARGS)),)
	@mkdir -p $(dir $(KERNEL_TEST_LOG))
	@echo "tests/pallas_kernels runs beside the rest (its output follows theirs)"
	@{ $(VENV)/bin/python -m pytest -q --durations=10 $(MOSAIC_TESTS); mosaic=$$?; \
		$(VENV)/bin/python -m pytest -q --durations=10 tests/pallas_kernels \
		$(addprefix --ignore=,$(MOSAIC_TESTS)); other=$$?; \
		test $$mosaic -eq 0 && test $$other -eq 0; } \
		> $(KERNEL_TEST_LOG) 2>&1 & kernels=$$!; \
	$(VENV)/bin/python -m pytest -q --durations=10 --ignore=tests/pallas_kernels; rest=$$?; \
	wait $$kernels; kernel_status=$$?; \
	echo "=== tests/pallas_kernels (exit $$kernel_status)"; cat $(KERNEL_TEST_LOG); \
	test $$rest -eq 0 && test $$kernel_status -eq 0
else
	$(VENV)/bin/python -m pytest -q $(ARGS)
endif

# JupyterLab on the research notebooks (the suite runs them without it: nbclient).
notebooks: $(NOTEBOOKS_STAMP)
	$(VENV)/bin/jupyter lab notebooks/

$(NOTEBOOKS_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[test,notebooks]'
	@touch $(NOTEBOOKS_STAMP)

plan-gpu: $(PLAN_GPU_STAMP)

$(PLAN_GPU_STAMP): pyproject.toml | $(STAMP)
	rm -rf $(PLAN_GPU)
	$(VENV)/bin/python -m pip install -q --no-deps --target $(PLAN_GPU) \
		jax-cuda13-plugin==$(JAX_PIN) jax-cuda13-pjrt==$(JAX_PIN)
	@touch $@

$(HF_STAMP):
	@$(HF_PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "parity tests need Python 3.11 (set HF_PYTHON); found " + sys.version.split()[0] + " at " + sys.executable)'
	@test -x $(HF_VENV)/bin/python || $(HF_PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.23.0
	@touch $(HF_STAMP)

clean-demo:
	rm -rf runs/demo runs/demo-bpe
