import json

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2

from adaptive_batch import BatchSizeTooLargeError
from adaptive_batch.memory.device import DeviceCapacity, device_capacity
from adaptive_batch.memory.budget import memory_budget, training_state_bytes
from adaptive_batch.probe.report import PROBE_FILENAME, read_probe_report, report_of_search, write_probe_report
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import probe_max_batch_size, worst_case_text_batch

SEQ = 64
VOCAB = 128
CPU = torch.device("cpu")


def tiny():
    torch.manual_seed(0)
    model = llama3_2(vocab_size=VOCAB, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=64, max_seq_len=SEQ)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_fn(model, opt):
    def train_step(batch):
        logits = model(batch["tokens"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return train_step


def make_batch(b):
    return worst_case_text_batch(b, seq_len=SEQ, vocab_size=VOCAB, device=CPU)


def test_worst_case_batch_is_full_length_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    batch = make_batch(3)
    assert batch["tokens"].shape == (3, SEQ) and torch.equal(batch["tokens"], batch["labels"])
    assert torch.equal(torch.get_rng_state(), state)


def test_probe_finds_a_bracketed_size_and_leaves_training_untouched(tmp_path):
    model, opt = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    live = training_state_bytes(model, opt)
    budget = live * 3 + 40 * 1024**2
    result = probe_max_batch_size(
        ProbeTarget(step_fn(model, opt), make_batch, model, opt, CPU), budget_bytes=budget, snapshot_dir=str(tmp_path),
    )
    fits = {t.batch_size: t for t in result.trials if t.fits}
    assert result.max_batch_size in fits and fits[result.max_batch_size].peak_bytes <= budget
    above = [t for t in result.trials if t.batch_size == result.max_batch_size + 1]
    assert above and not above[0].fits and above[0].peak_bytes > budget
    # the estimate was close: at most one size off
    assert abs(result.predicted_max_batch_size - result.max_batch_size) <= 1
    assert result.num_trials <= 6
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.state_dict()["state"] == {}
    assert torch.equal(torch.get_rng_state(), rng)


def test_each_trial_gives_back_mkls_buffers_for_its_shapes(tmp_path, monkeypatch):
    # Given back only after a trial that ran out of memory, the buffers of every size that fitted
    # piled up: the 152K-vocabulary config with 2 threads held 26 MiB by its 6th trial, and its
    # true maximum ran out of memory in the probe.
    from adaptive_batch.probe import trials

    freed = []
    monkeypatch.setattr(trials, "free_mkl_buffers", lambda: freed.append(True))
    model, opt = tiny()
    result = probe_max_batch_size(
        ProbeTarget(step_fn(model, opt), make_batch, model, opt, CPU), budget_bytes=training_state_bytes(model, opt) * 3 + 40 * 1024**2, snapshot_dir=str(tmp_path),
    )
    assert any(t.fits for t in result.trials) and len(freed) == result.num_trials


def test_trials_collect_only_the_garbage_made_since_the_probe_started(tmp_path, unfrozen_heap):
    """Each trial's collection once visited every object of the process: 30% of a probe's
    seconds where Transformers is imported. The objects there before the probe are set aside
    while it runs, and put back after."""
    import gc

    model, opt = tiny()
    train_step = step_fn(model, opt)
    set_aside = []

    def counted_step(batch):
        set_aside.append(gc.get_freeze_count())
        train_step(batch)

    result = probe_max_batch_size(ProbeTarget(counted_step, make_batch, model, opt, CPU),
                                  budget_bytes=training_state_bytes(model, opt) * 3 + 40 * 1024**2,
                                  snapshot_dir=str(tmp_path))
    assert len(set_aside) == result.num_trials and min(set_aside) > 1000
    assert gc.get_freeze_count() == 0


UNDER_A_LIMIT = """
import json, sys
from adaptive_batch.memory.budget import memory_budget, training_state_bytes
from adaptive_batch.memory.device import device_capacity
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import probe_max_batch_size
from tests.adaptive_batch.conftest import address_space_headroom
from tests.adaptive_batch.probe.test_trials import CPU, make_batch, step_fn, tiny

model, opt = tiny()
with address_space_headroom(100 * 1024**2):
    budget = memory_budget(max_memory_bytes=None, capacity=device_capacity(CPU),
                           live_bytes=training_state_bytes(model, opt), safety_margin=0.0)
    # Hold the search to real allocation failures: the budget is the whole limit and more.
    result = probe_max_batch_size(
        ProbeTarget(step_fn(model, opt), make_batch, model, opt, CPU), budget_bytes=budget.budget_bytes * 4, snapshot_dir=sys.argv[1])
step_fn(model, opt)(make_batch(result.max_batch_size))  # the limit lifted: training goes on
print(json.dumps({"source": budget.source, "found": result.max_batch_size,
                  "oom": [t.batch_size for t in result.trials if t.oom]}))
"""


def test_probe_under_a_real_address_space_limit(tmp_path):
    # In a process of its own: a worker's heap, freed by earlier tests but still mapped, would
    # hold trials far past the limit's 100 MiB without a new mapping (and so without a failure).
    import subprocess
    import sys

    from tests.recipes.conftest import REPO

    run = subprocess.run([sys.executable, "-c", UNDER_A_LIMIT, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["source"] == "RLIMIT_AS" and got["oom"], "the limit should have stopped a trial"
    # The search closes on a failure just above its answer. (Not "the smallest failure": a heap an
    # out-of-memory trial left may fail a size below one that fitted before it.)
    assert got["found"] >= 2 and got["found"] + 1 in got["oom"]


def test_batch_one_too_large(tmp_path):
    model, opt = tiny()
    with pytest.raises(BatchSizeTooLargeError) as info:
        probe_max_batch_size(
        ProbeTarget(step_fn(model, opt), make_batch, model, opt, CPU), budget_bytes=1024, snapshot_dir=str(tmp_path),
        )
    assert info.value.bytes_needed > 1024
    assert torch.equal(model.tok_embeddings.weight, tiny()[0].tok_embeddings.weight)


def test_report_has_the_documented_fields(tmp_path):
    model, opt = tiny()
    result = probe_max_batch_size(
        ProbeTarget(step_fn(model, opt), make_batch, model, opt, CPU), budget_bytes=training_state_bytes(model, opt) * 3 + 20 * 1024**2,
        max_batch_size=4, snapshot_dir=str(tmp_path),
    )
    cap = DeviceCapacity(device="cpu", headroom_bytes=10**9, source="MemAvailable", hard_limit=False)
    budget = memory_budget(max_memory_bytes=None, capacity=cap, live_bytes=0, safety_margin=0.01)
    path = write_probe_report(
        report_of_search(result, batch_size=4, seq_len=SEQ, device=CPU, budget=budget), str(tmp_path)
    )
    assert path.endswith(PROBE_FILENAME)
    report = json.loads(open(path).read())
    assert report["max_batch_size"] == 4 and report["seq_len"] == SEQ and report["device"] == "cpu"
    assert {"fixed_bytes", "bytes_per_sample", "predicted_max_batch_size"} <= set(report["estimate"])
    assert {"batch_size", "fits", "peak_bytes", "seconds"} <= set(report["trials"][0])
    assert report["total_seconds"] > 0 and "budget_bytes" in report
    typed = read_probe_report(path)
    assert report["format"] == 2 and typed.trials == result.trials and typed.budget == budget
