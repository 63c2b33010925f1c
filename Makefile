# Two commands set up everything on a fresh machine:
#   make demo   train the tiny tied GPT on 4 CPU processes (pp=2 x dp=2) and check it
#   make test   the whole suite
# torch is pinned to the CPU wheel: an unpinned torch would pull gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test gpu-test bench clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) examples/demo.py

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=12 tests

# On a CUDA machine, with its own CUDA torch (no venv: the pinned CPU wheel has no CUDA).
# The editable install maps gradsched.passes to passes/ (no network needed: no build isolation).
gpu-test:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest -q -m gpu tests
	$(PYTHON) benchmarks/triton_kernel.py --out ''
	$(PYTHON) benchmarks/cp_rank_compute.py --device cuda --cp 2 4 8 --accumulate fp32 input --out ''

bench: $(VENV)/.installed
	$(PY) benchmarks/tied_grad_sync.py --pp 2 --dp 2 --steps 3
	$(PY) benchmarks/resume_parity.py
	$(PY) benchmarks/mistakes.py
	$(PY) benchmarks/overlap.py --pp 2 --dp 2
	$(PY) benchmarks/overlap.py --pp 1 --dp 4
	$(PY) benchmarks/cp_numerics.py --cp 8 --seq 4096 --heads 12 --dim 128 --dtype bf16 --causal
	$(PY) benchmarks/cp_speed.py
	$(PY) -m pip install -q matplotlib
	$(PY) benchmarks/train_parity.py --model hf_gpt2 --dtype float32 --steps 5
	$(PY) benchmarks/train_parity.py --model hf_gpt2 --dtype bfloat16 --steps 50 --pp 2 --dp 1 --cp 4 \
		--seq 256 --accumulate fp32 input

clean:
	rm -rf $(VENV) *.egg-info
