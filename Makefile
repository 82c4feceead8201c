# The README's two commands: `make run` trains the embedded default, `make test` runs the suite.
# Each creates or updates the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch 2.13.0 lies on this kind of machine; an unpinned torch pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.adaptive-batch-installed
# torchtune's wheel ships a top-level `recipes` package: put the repo root first so ours wins.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: run run-distributed test test-fast test-unit bench bench-hf bench-zoo bench-plan bench-plan-torchtune bench-estimate bench-overhead bench-noise-scale bench-first-guess gpu-check gpu-check-cpu gpu-wheels venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[torchtune,hf,trl,lightning,test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tune run recipes/full_finetune_single_device.py --config configs/tiny/full_single_device.yaml \
		use_maximum_batch_size=True max_memory=512MiB epochs=3 $(ARGS)

# The same on 2 processes with FSDP2 (gloo on CPU): lockstep probe, growth decided on rank 0.
run-distributed: $(STAMP)
	$(BIN)/tune run --nproc_per_node $(or $(NPROC),2) recipes/full_finetune_distributed.py \
		--config configs/tiny/full_distributed.yaml use_maximum_batch_size=True max_memory=512MiB epochs=3 $(ARGS)

# Everything, as CI runs it (.ci/run): one pytest worker a core (pytest-xdist), a test file to a
# worker (its module-scoped runs are shared by its tests), in tests/conftest.py's order (the files
# of many slow tests first; xdist 3.8's own reorder by test count left the two-rank file, 7 tests and
# 2 minutes, for last). TEST_WORKERS=0 runs in this process. Bytecode caches are written, as Python
# does by default: under PYTHONDONTWRITEBYTECODE (set on this kind of machine) each of the suite's
# hundred-odd processes compiled the library and recipes again (0.5 s each), and each worker
# rewrote every test module's asserts.
TEST_WORKERS ?= auto
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# Without the tests that need processes of their own (real memory limits, torchrun, an install).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The library's unit tests alone (tests/adaptive_batch), in-process.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/adaptive_batch -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[torchtune,hf,test,bench]"
	$(BIN)/python benchmarks/bench_probe.py $(ARGS)

# The peers on a Hugging Face model (Trainer, Accelerate, Lightning): docs/benchmarks.md.
bench-hf: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[torchtune,hf,test,bench]"
	$(BIN)/python benchmarks/bench_hf.py $(ARGS)

# Models the recipes do not have, each under a soft and a hard budget, in fresh processes:
# docs/probe.md's zoo table (about 30 minutes).
bench-zoo: $(STAMP)
	$(BIN)/python benchmarks/bench_zoo.py $(ARGS)

bench-estimate: $(STAMP)
	$(BIN)/python benchmarks/bench_estimate.py $(ARGS)

# Every adaptive key off against torchtune 0.6.1's own recipe, in alternating pairs: docs/benchmarks.md.
bench-overhead: $(STAMP)
	$(BIN)/python benchmarks/bench_overhead.py $(ARGS)

# The noise scale's two estimators: their cost through the recipe, and both on the same runs.
bench-noise-scale: $(STAMP)
	$(BIN)/python benchmarks/bench_noise_scale.py $(ARGS)

# The probe with and without its first guess from fake steps: docs/probe.md (about 10 minutes).
bench-first-guess: $(STAMP)
	$(BIN)/python benchmarks/bench_first_guess.py $(ARGS)

bench-plan: $(STAMP)
	$(BIN)/python benchmarks/bench_plan.py $(ARGS)

# Every fine-tuning config torchtune's wheel ships, planned as shipped (about 30 minutes).
bench-plan-torchtune: $(STAMP)
	$(BIN)/python benchmarks/bench_plan_torchtune.py $(ARGS)

# The CUDA paths on a real card (real CUDA OOMs, set_per_process_memory_fraction, the planner
# against max_memory_allocated). A python3 whose torch sees CUDA is used as it is, never .venv's CPU
# wheel: what it lacks (torchtune, torchao, ...) goes into $(GPU_SITE), from the wheels in .whl/
# (`make gpu-wheels` on a machine with a package index) or else from the index. Without CUDA it
# runs nothing and says so (exit 0); `make gpu-check-cpu` is the same script on the CPU.
GPU_SITE ?= .gpu-site
GPU_WHEELS := torchtune==0.6.1 torchao==0.15.0 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 blobfile==3.3.0 kagglehub==1.0.2
CUDA_TORCH = $(shell $(PYTHON) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
gpu-check:
ifeq ($(CUDA_TORCH),1)
	@$(PYTHON) -c "import torchtune" 2>/dev/null || test -f $(GPU_SITE)/.installed || { \
		if ls .whl/*.whl >/dev/null 2>&1; then \
			$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl; \
		else $(PYTHON) -m pip install -q --no-deps --target $(GPU_SITE) $(GPU_WHEELS) || { \
			echo "gpu-check: no package index here: run make gpu-wheels where there is one and bring .whl/"; exit 1; }; fi \
		&& touch $(GPU_SITE)/.installed; }
	PYTHONPATH=$(abspath $(GPU_SITE)):$(PYTHONPATH) $(PYTHON) benchmarks/gpu_check.py $(ARGS)
else
	@echo "gpu-check: $(PYTHON)'s torch sees no CUDA device here; nothing to check (make gpu-check-cpu runs it on the CPU)."
endif

gpu-check-cpu: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --device cpu $(ARGS)

# The pure-Python wheels a CUDA image without torchtune lacks (the lent H100's and H200's, Python
# 3.12), into .whl/ (git-ignored), to carry there; README "On a GPU".
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf outputs .pytest_cache
