# The two commands of the README, and the pieces they are made of.
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo demo-tiny mathematics number-words test test-fast bench lint

setup:            ## build .venv from scratch (fast no-op when up to date)
	bash scripts/setup.sh

demo: setup       ## set up, then run the DAPO demo (SmolLM2-135M-Instruct, about 22 min on 2 cores) on a local Ray cluster
	$(VENV)/bin/dapo-ray demo --config workflows/configs/smollm2_cpu.yaml

demo-tiny: setup  ## the fast path: the same recipe on a 0.6M-parameter model built here (about 8 min)
	$(VENV)/bin/dapo-ray demo --config workflows/configs/tiny_cpu.yaml

mathematics: setup  ## DeepMind's Mathematics Dataset from its PyPI generator, then 30 minutes of DAPO on SmolLM2 (docs/data.md)
	$(VENV)/bin/dapo-ray prepare-mathematics --shots 3 --out-dir runs/data/mathematics
	$(VENV)/bin/dapo-ray demo --config workflows/configs/mathematics_cpu.yaml

number-words: setup  ## a task of your own (README "Your own task"): its data, its reward probed, then DAPO on SmolLM2 (about 12 min)
	$(PY) workflows/tasks/number_words.py --out-dir runs/data/number_words
	$(VENV)/bin/dapo-ray probe-reward --config workflows/configs/number_words_cpu.yaml
	$(VENV)/bin/dapo-ray demo --config workflows/configs/number_words_cpu.yaml

test: setup       ## set up, then run the whole test suite
	$(PY) -m pytest tests --durations=15

test-fast:        ## the pure and unit tiers only (seconds)
	$(PY) -m pytest tests/algo tests/unit -q

bench:            ## benchmarks that print figures beside their baselines
	$(PY) bench/verifier.py
	$(PY) bench/logprob_memory.py
	$(PY) bench/weight_transport.py
	$(PY) bench/weight_sync.py
	$(PY) bench/share_prompts.py

lint:
	$(VENV)/bin/ruff check dapo_ray tests bench workflows
