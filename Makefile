# artlike: `make demo` and `make test` set everything up themselves (venv, engine, default model).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.artlike-setup
MODEL_STAMP := $(VENV)/.artlike-default-model
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-unit bench email-agent lint clean

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

test: setup
	$(PY) -m pytest -q -ra --durations=15

test-unit: setup
	$(PY) -m pytest -x -q -m "not integration"

bench: setup
	$(PY) -m bench.proxy_overhead
	$(PY) -m bench.train_throughput

email-agent: setup
	$(PY) -m examples.email_agent.train --start-server

lint: setup
	$(VENV)/bin/ruff check src server tests bench examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache
