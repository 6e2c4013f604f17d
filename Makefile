# vramguard — the two commands a new machine needs:
#   make run    install what is missing, build, start `vramguard serve` on the embedded default
#   make test   install what is missing, then run every check CI runs
#
# ONNX Runtime comes from the pinned PyPI wheel (the only place it can be fetched here) and is
# installed into the git-ignored .deps/ folder; vramguard finds it there on its own.

ORT_VERSION := 1.31.1
ORT_DIR     := .deps/onnxruntime
ORT_LIB     := $(ORT_DIR)/onnxruntime/capi/libonnxruntime.so.$(ORT_VERSION)
PYTHON      ?= python3
CARGO       ?= cargo
SUDO        := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_STAMP   := .deps/.apt-updated
PYCLIENTS   := .deps/pyclients/.installed-4
PEER        := .deps/peer/.installed
MODELGEN    := .deps/modelgen/.installed
SYSTEMD_UNIT := deploy/systemd/vramguard.service
# The most `systemd-analyze security` exposure the unit may have, in tenths (20: 2.0 of 10), so
# removing a hardening directive fails the check.
SYSTEMD_EXPOSURE_MAX := 20

PREFIX      ?= /usr/local

.PHONY: run test install deps build-tools tools systemd-tools build release check-fmt clippy unit policy-tests model-check client-compat tour alert-tests dashboard-check systemd-check k8s-check drill bench bench-tools fixtures clean-deps

run: deps release
	./target/release/vramguard serve $(ARGS)

test: deps tools check-fmt clippy unit policy-tests model-check client-compat tour alert-tests dashboard-check systemd-check k8s-check drill
	@echo "make test: all checks passed"

# `vramguard` on PATH for the README's commands (and the systemd unit's /usr/local/bin/vramguard).
# It finds ONNX Runtime in this checkout's .deps/ (or ORT_DYLIB_PATH, or onnxruntime.library).
# The release profile's debug info (line tables for profiling target/release/vramguard) is
# 80 % of the binary (145 MB against 27 MB) and costs no build time: the installed copy goes
# without it, keeping its symbols (function names in backtraces and profiles).
install: deps release
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 target/release/vramguard $(DESTDIR)$(PREFIX)/bin/vramguard
	strip --strip-debug $(DESTDIR)$(PREFIX)/bin/vramguard
	@echo "installed $(DESTDIR)$(PREFIX)/bin/vramguard"

deps: $(ORT_LIB) build-tools

# cmake (Debian package `cmake`) builds the libopus that decodes Opus audio (Cargo.toml's
# symphonia-adapter-libopus, bundled and linked statically); cargo needs it before any build.
build-tools:
	@command -v cmake >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends cmake >/dev/null; }

$(ORT_LIB):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) is needed to fetch the onnxruntime wheel"; exit 1; }
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps --target $(ORT_DIR) onnxruntime==$(ORT_VERSION)
	@test -f $@ || { echo "error: the onnxruntime $(ORT_VERSION) wheel did not contain $@"; exit 1; }

# promtool and the Prometheus server (Debian package `prometheus`) run the alert-rule unit tests
# and the end-to-end test (tests/it/prometheus.rs); amtool (`prometheus-alertmanager`) checks the
# example Alertmanager routing; headless Chromium (`chromium`) renders the status page in
# tests/it/status_page.rs.
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@command -v amtool >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null; }
	@command -v chromium >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
	@promtool --version | head -1
	@amtool --version 2>&1 | head -1
	@chromium --version

# systemd-analyze (Debian package `systemd`) checks the unit; it works where systemd is not PID 1.
systemd-tools:
	@command -v systemd-analyze >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends systemd >/dev/null; }
	@systemd-analyze --version | head -1

# Triton's stock HTTP client and OpenAI's Python client, for the protocol compatibility checks,
# and srt and webvtt-py, which parse the transcription endpoint's subtitles as players would
# (never imported by vramguard).
$(PYCLIENTS):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .deps/pyclients 'tritonclient[http]==2.73.0' numpy openai==3.57.0 'jsonschema==4.26.0' srt==3.5.3 webvtt-py==0.6.0
	@touch $@

build: build-tools
	$(CARGO) build

release: build-tools
	$(CARGO) build --release

check-fmt:
	$(CARGO) fmt --check

clippy:
	$(CARGO) clippy --all-targets -- -D warnings

unit: $(MODELGEN)
	$(CARGO) test

# The shipped policies must compile and pass their own test cases (policies/tests/).
policy-tests:
	$(CARGO) build
	./target/debug/vramguard policy check policies/*.rhai
	./target/debug/vramguard policy test policies/tests

# The bundled models and the decoder fixture are what their generators make, byte for byte, and
# ONNX Runtime agrees with the generators' independent numpy references.
$(MODELGEN):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .deps/modelgen numpy==2.4.6 onnx==1.23.2 tokenizers==0.23.2
	@touch $@

model-check: deps $(MODELGEN)
	PYTHONPATH=.deps/modelgen $(PYTHON) models/generate.py --check
	PYTHONPATH=.deps/modelgen $(PYTHON) models/generate_decoder.py --check

client-compat: $(PYCLIENTS)
	$(CARGO) build
	$(PYTHON) tests/clients/triton_http.py target/debug/vramguard
	$(PYTHON) tests/clients/openai_client.py target/debug/vramguard
	$(PYTHON) tests/clients/structured_outputs.py target/debug/vramguard
	$(PYTHON) tests/clients/embeddings_client.py target/debug/vramguard
	$(PYTHON) tests/clients/rerank_client.py target/debug/vramguard
	$(PYTHON) tests/clients/image_search_client.py target/debug/vramguard
	$(PYTHON) tests/clients/transcription_client.py target/debug/vramguard

# The README's tour, in order, as written, against the embedded default (its Python examples use
# the clients of $(PYCLIENTS)).
tour: $(PYCLIENTS)
	$(CARGO) build
	$(PYTHON) tests/clients/readme_tour.py target/debug/vramguard

# Rules parse and behave (promtool); the example routing parses and pages on degraded mode and a
# down vramguard, while a warning goes to chat (amtool exits non-zero on another receiver).
AM_EXAMPLE := alerts/alertmanager.example.yaml
alert-tests:
	promtool check rules alerts/*.rules.yaml
	promtool test rules alerts/tests/*.yaml
	amtool check-config $(AM_EXAMPLE)
	amtool config routes test --config.file=$(AM_EXAMPLE) --verify.receivers=on-call alertname=VramguardDegraded reason=breaker_open 2>/dev/null
	amtool config routes test --config.file=$(AM_EXAMPLE) --verify.receivers=on-call alertname=VramguardDegraded reason=driver_fault 2>/dev/null
	amtool config routes test --config.file=$(AM_EXAMPLE) --verify.receivers=on-call alertname=VramguardDown 2>/dev/null
	amtool config routes test --config.file=$(AM_EXAMPLE) --verify.receivers=team-chat alertname=VramguardBreakerOpen 2>/dev/null

# Dashboards against the JSON schema derived from Grafana's @grafana/schema (committed under
# tests/dashboards/schema/, so no npm here), plus the house rules (units, descriptions, datasource).
DASHCHECK := .deps/dashcheck/.installed

$(DASHCHECK):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .deps/dashcheck 'jsonschema==4.26.0'
	@touch $@

dashboard-check: $(DASHCHECK)
	PYTHONPATH=.deps/dashcheck $(PYTHON) tests/dashboards/check.py dashboards/*.json

# The Kubernetes manifests (deploy/kubernetes/), offline: each against the JSON schema of its kind
# with check-jsonschema (schemas extracted from the Kubernetes API and the CRDs by
# deploy/kubernetes/schemas/extract.py, committed; unknown keys are refused), the PrometheusRule
# regenerated from alerts/vramguard.rules.yaml and compared, its rules through promtool, and the
# selectors, ports, probes and engine label checked against each other (tests/kubernetes/check.py).
# tests/it/picker.rs (in `unit`) checks the endpoint picker's metric names against a live /metrics.
K8SCHECK := .deps/k8scheck/.installed

$(K8SCHECK):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .deps/k8scheck 'check-jsonschema==0.39.0'
	@touch $@

k8s-check: $(K8SCHECK)
	PYTHONPATH=.deps/k8scheck $(PYTHON) tests/kubernetes/check.py

# `systemd-analyze verify` also checks that ExecStart's binary exists, and /usr/local/bin/vramguard
# does not on a build machine: so it verifies a copy of the unit, in a scratch folder, whose
# ExecStart names the binary just built. verify exits 0 on an unknown key or a bad value (it only
# prints them), so any message about the unit fails the check too. Then the unit's exposure score
# must stay within SYSTEMD_EXPOSURE_MAX.
systemd-check: systemd-tools build
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; unit="$$tmp/vramguard.service"; \
	sed 's|^ExecStart=/usr/local/bin/vramguard |ExecStart=$(CURDIR)/target/debug/vramguard |' $(SYSTEMD_UNIT) >"$$unit"; \
	grep -q '^ExecStart=$(CURDIR)/target/debug/vramguard ' "$$unit" || { \
		echo "error: $(SYSTEMD_UNIT) must start /usr/local/bin/vramguard (ExecStart=/usr/local/bin/vramguard serve …)"; exit 1; }; \
	if ! out=$$(systemd-analyze verify "$$unit" 2>&1) || printf '%s\n' "$$out" | grep -q 'vramguard\.service'; then \
		printf '%s\n' "$$out" | sed 's|'"$$unit"'|$(SYSTEMD_UNIT)|'; echo "error: systemd-analyze verify rejects $(SYSTEMD_UNIT)"; exit 1; fi; \
	if ! systemd-analyze security --offline=true --threshold=$(SYSTEMD_EXPOSURE_MAX) --no-pager "$$unit" >"$$tmp/security" 2>&1; then \
		grep -E '^(✗|→)' "$$tmp/security" || cat "$$tmp/security"; \
		echo "error: $(SYSTEMD_UNIT) is less hardened than allowed: its exposure must stay at or below $(SYSTEMD_EXPOSURE_MAX) tenths (the ✗ lines above say what is missing)"; exit 1; fi; \
	echo "$(SYSTEMD_UNIT): verify ok, $$(grep -o 'Overall exposure level.*' "$$tmp/security")"

# The acceptance drill, quick, on its own server (a squeezed simulated accelerator): exits 1
# naming any failed criterion; the full record is kept in target/drill.json.
drill: build
	./target/debug/vramguard drill --quick --json target/drill.json

# `make fixtures` (not part of `make test`): models/real/, tiny LLMs of five architectures made
# with the real exporters (Hugging Face Optimum and ONNX Runtime GenAI's builder) and their
# references from `transformers` (models/README.md); models/embed/ and models/speech/ (speech
# clips made by espeak-ng, sox and ffmpeg, installed from Debian when missing, and the tiny
# Whisper of models/speech/whisper/, exported by Optimum, with transformers' transcriptions, and
# its never-ending variant, models/speech/whisper-endless/). The two exporters need separate Python
# environments, each with torch (several GB): they are created under .deps/ from the pinned
# requirements when missing, or taken from FIXTURE_PYTHON_OPTIMUM / FIXTURE_PYTHON_GENAI.
FIXTURE_PYTHON_OPTIMUM ?= .deps/fixtures-venv-optimum/bin/python
FIXTURE_PYTHON_GENAI   ?= .deps/fixtures-venv-genai/bin/python
FIXTURE_PYTHON_EMBED   ?= .deps/fixtures-venv-embed/bin/python

.deps/fixtures-venv-%/.installed: models/real/requirements-%.txt
	rm -rf .deps/fixtures-venv-$*
	$(PYTHON) -m venv .deps/fixtures-venv-$*
	.deps/fixtures-venv-$*/bin/pip install --quiet --disable-pip-version-check -r $<
	@touch $@

# The embedders' venv: Optimum's pins and sentence-transformers (models/embed/make.py), and
# Pillow, which draws the image-search fixture's images and preprocesses them (make_clip.py).
.deps/fixtures-venv-embed/.installed: models/embed/requirements-embed.txt
	rm -rf .deps/fixtures-venv-embed
	$(PYTHON) -m venv .deps/fixtures-venv-embed
	.deps/fixtures-venv-embed/bin/pip install --quiet --disable-pip-version-check -r $<
	@touch $@

# sentence-transformers' current release beside the embed venv's (models/embed/make.py saves one
# folder with it, in a process of its own), on that venv's torch and transformers.
.deps/fixtures-st-current/.installed: models/embed/requirements-embed-current.txt
	rm -rf .deps/fixtures-st-current
	$(FIXTURE_PYTHON_EMBED) -m pip install --quiet --disable-pip-version-check --no-deps --target .deps/fixtures-st-current -r $<
	@touch $@

fixtures:
	@test -x "$(FIXTURE_PYTHON_OPTIMUM)" || $(MAKE) .deps/fixtures-venv-optimum/.installed
	@test -x "$(FIXTURE_PYTHON_GENAI)" || $(MAKE) .deps/fixtures-venv-genai/.installed
	@test -x "$(FIXTURE_PYTHON_EMBED)" || $(MAKE) .deps/fixtures-venv-embed/.installed
	$(MAKE) .deps/fixtures-st-current/.installed
	FIXTURE_PYTHON_OPTIMUM=$(FIXTURE_PYTHON_OPTIMUM) FIXTURE_PYTHON_GENAI=$(FIXTURE_PYTHON_GENAI) \
		$(PYTHON) models/real/make.py
	$(FIXTURE_PYTHON_EMBED) models/embed/make.py
	$(FIXTURE_PYTHON_EMBED) models/embed/make_clip.py
	@command -v espeak-ng >/dev/null && command -v sox >/dev/null && command -v ffmpeg >/dev/null || { \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		$(SUDO) apt-get install -y -qq --no-install-recommends espeak-ng sox ffmpeg; }
	$(FIXTURE_PYTHON_EMBED) models/speech/make.py
	$(FIXTURE_PYTHON_EMBED) models/speech/whisper/make.py
	$(FIXTURE_PYTHON_EMBED) models/speech/whisper/make_variants.py

# The overhead and generation benches drive the real `vramguard serve` from a separate process, as
# users' clients do: wrk (Debian package `wrk`) is that load generator. Not part of `make test`.
bench-tools:
	@command -v wrk >/dev/null || { \
		mkdir -p .deps; \
		[ -f $(APT_STAMP) ] || { $(SUDO) apt-get update -qq && touch $(APT_STAMP); }; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends wrk >/dev/null; }
	@wrk --version 2>&1 | head -1

# The overhead bench's peer (benches/peer/server.py): the same model behind FastAPI and uvicorn on
# the onnxruntime wheel of $(ORT_DIR), as a home-server user would serve it.
$(PEER):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .deps/peer fastapi==0.163.2 starlette==1.10.0 pydantic==2.14.4 uvicorn==0.54.0 numpy==2.4.6
	@touch $@

# `make bench`: every bench once, then one table (target/bench/results.json and results.md; the
# docs/performance.md shows the latest). Each bench also runs alone:
# `cargo bench --bench overhead`, then `cargo bench --bench report` for the table.
# `cargo bench --no-run` builds the release binary the server benches spawn
# (CARGO_BIN_EXE_vramguard); a `cargo build --release` first would build it a second time, since
# the benches' dev-dependencies change the features of shared crates (tokio, serde, …).
# The larger decoder of the generation bench is made once into target/bench/ (not committed).
BENCHES := policy estimate exporter failover overhead isolation generation residency
bench: deps bench-tools $(PEER) $(MODELGEN)
	PYTHONPATH=.deps/modelgen $(PYTHON) benches/larger_decoder.py target/bench/decoder-large
	$(CARGO) bench --no-run
	rm -f $(foreach b,$(BENCHES),target/bench/$(b).json)
	@set -e; for b in $(BENCHES); do echo "== cargo bench --bench $$b"; $(CARGO) bench --quiet --bench $$b; done
	$(CARGO) bench --quiet --bench report

clean-deps:
	rm -rf .deps
