# artlike: `make demo` and `make test` set everything up themselves (venv, engine, default model).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.artlike-setup
MODEL_STAMP := $(VENV)/.artlike-default-model
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-unit test-learning bench email-agent lint clean

setup: $(STAMP) $(MODEL_STAMP)

$(STAMP): pyproject.toml server/install.sh
	bash server/install.sh $(VENV)
	touch $@

# Converting the embedded GGUF model into a safetensors directory happens once, into the user cache.
$(MODEL_STAMP): $(STAMP)
	$(PY) -m artlike_server.default_model
	touch $@

demo: setup
	$(PY) -m examples.arithmetic.demo

# Two workers (the target machine has two cores): the shared server's tests leave a core idle between requests (tests/conftest.py
# gives each worker whole groups: a session server's tests, or one module).
test: setup
	$(PY) -m pytest -q -ra --durations=40 -m "not learning" -n 2 --dist loadgroup --no-loadscope-reorder

# Slow learning evidence (e.g. PPO raising a reward model's score over four jobs): not in `make test`.
test-learning: setup
	$(PY) -m pytest -q -ra -m learning

test-unit: setup
	$(PY) -m pytest -x -q -m "not integration"

bench: setup
	$(PY) -m bench.proxy_overhead
	$(PY) -m bench.proxy_cpu
	$(PY) -m bench.scale
	$(PY) -m bench.engine_start
	$(PY) -m bench.tinker_api
	$(PY) -m bench.train_throughput
	$(PY) -m bench.soak
	$(PY) -m bench.job_learning
	$(PY) -m bench.feedback_loop
	$(PY) -m bench.rl_step --core-split
	$(PY) -m bench.lora_serving
	$(PY) -m bench.policy_engine
	$(PY) -m bench.ceiling
	$(PY) -m bench.plateau --configs baseline combined
	$(PY) -m bench.plateau --configs baseline dynamic_sampling curriculum entropy_bonus clip_higher temperature \
		--output bench/results/plateau_sampling.json
	$(PY) -m bench.plateau --configs baseline guidance --output bench/results/plateau_guidance.json
	$(PY) -m bench.plateau --configs baseline clip_higher clip_higher_entropy --output bench/results/plateau_clip.json
	$(PY) -m bench.plateau --configs clip_higher --output bench/results/plateau_clip_3.json
	$(PY) -m bench.plateau --configs baseline higher_lr retry_failed --output bench/results/plateau_explore.json
	$(PY) -m bench.plateau --configs baseline clip_cov --output bench/results/plateau_clip_cov.json
	$(PY) -m bench.plateau --configs baseline --output bench/results/plateau_clip_cov_2.json
	$(PY) -m bench.plateau --configs baseline w_reinforce --output bench/results/plateau_w_reinforce.json
	$(PY) -m bench.plateau --configs baseline entropy_control --output bench/results/plateau_entropy_control.json
	$(PY) -m bench.plateau --configs baseline entropy_control_strong --output bench/results/plateau_entropy_control_strong.json
	$(PY) -m bench.plateau --configs baseline entropy_control_answer --output bench/results/plateau_entropy_control_answer.json
	$(PY) -m bench.plateau --configs baseline kl_penalty --output bench/results/plateau_kl_penalty.json
	$(PY) -m pytest -q -ra -m learning

# The CPU run whose results examples/email_agent/README.md reports (GRPO on subject questions, shaped
# training reward, lr 2e-4, 81 held-out questions).
EMAIL_AGENT_ARGS ?= --inboxes 8 --tool-choice required --eval-limit 81 --eval-kinds subject --eval-concurrency 16 \
	--kinds subject --steps 60 --train-minutes 46 --questions-per-step 4 --group-size 4 --learning-rate 2e-4 \
	--temperature 0.7 --max-turns 4 --reward-weight found=0.5 --reward-weight wrong=-0.5
email-agent: setup
	$(PY) -m examples.email_agent.train --start-server $(EMAIL_AGENT_ARGS)

# ruff, mypy (strict) and the import contracts of pyproject.toml ([tool.importlinter]: the server's layers).
lint: setup
	$(VENV)/bin/ruff check src server tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
