# make demo: set up and build + run the demo bundle.  make test: set up and run the tests.
# make test-fast: the tests that build nothing (under a minute).
PY := .venv/bin/python
# test processes (pytest-xdist); they share built bundles, so 2 suits a 2-core machine
TEST_WORKERS ?= 2
VENV_STAMP := .venv/.neffkit-installed

.PHONY: setup demo test test-fast lint bench lm-eval peers-venv peers clean

setup: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first (it lies on this machine's disk; other versions pull CUDA wheels)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,lower]'
	touch $(VENV_STAMP)

demo: setup
	$(PY) -m neffkit build manifests/demo.yaml -o bundles/demo-llama
	$(PY) -m neffkit inspect bundles/demo-llama
	$(PY) -m neffkit run bundles/demo-llama --prompt "def main(" --max-tokens 48

test: setup
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=25

# no bundle builds (no g++): manifest, plan, flags, audit rules, scheduler, protocol, layering
test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

lint: setup
	.venv/bin/ruff check neffkit tests bench tools
	.venv/bin/ruff format --check neffkit tests bench tools

# lm-eval (its own venv: its pins are not neffkit's) through `neffkit run`, checked against HF
lm-eval: setup
	test -x .venv-lmeval/bin/lm_eval || (python3 -m venv .venv-lmeval && \
		.venv-lmeval/bin/pip install -q 'lm-eval[api]==0.4.13' transformers)
	$(PY) bench/lm_eval.py

# the ahead-of-time CPU peers (ONNX Runtime GenAI, OpenVINO GenAI) in their own venv: optimum-intel
# pins its own transformers; bench/peers.py drives them through bench/peers_worker.py
peers-venv:
	test -x .venv-peers/bin/python || (python3 -m venv .venv-peers && \
		.venv-peers/bin/pip install -q torch==2.13.0 && \
		.venv-peers/bin/pip install -q onnxruntime-genai onnx onnx_ir 'optimum-intel[openvino]' \
			openvino-genai)

peers: setup peers-venv
	$(PY) bench/peers.py

bench: setup
	$(PY) -m pip install -q -e '.[dev,lower,bench]'
	$(PY) bench/decode.py --batch 1 4 8 --manifest manifests/demo-serve.yaml --bundle bundles/demo-llama-serve
	$(PY) bench/serve.py
	$(PY) bench/overhead.py
	$(PY) bench/startup.py
	$(PY) bench/matrix.py
	$(PY) bench/roofline.py
	$(PY) bench/build.py
	$(PY) bench/tp.py
	$(PY) bench/report.py --write-readme

clean:
	rm -rf bundles .pytest_cache
