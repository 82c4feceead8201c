import time

import pytest
import torch

from adaptive_batch.probe.throughput import choose_by_throughput, probe_throughput, throughput_candidates
from adaptive_batch.probe.target import ProbeTarget


def test_candidates_are_powers_of_two_and_the_maximum():
    assert throughput_candidates(19) == [1, 2, 4, 8, 16, 19]
    assert throughput_candidates(16) == [1, 2, 4, 8, 16]
    assert throughput_candidates(1) == [1]


def saturating(b):
    """A device that is busy from 8 samples on: 0.1 s overhead, then 10 ms a sample past 8."""
    return 0.1 + 0.01 * max(b, 8)


def test_smallest_batch_within_tolerance_of_the_best_rate():
    choice = choose_by_throughput(saturating, [1, 2, 4, 8, 16, 32, 64], tolerance=0.02)
    rates = {t.batch_size: t.samples_per_second for t in choice.trials}
    assert max(rates, key=rates.get) == 64
    # 64 gives 64/0.74 = 86.5/s; 32 gives 76.2/s (12% less); only 64 is within 2%
    assert choice.batch_size == 64
    loose = choose_by_throughput(saturating, [1, 2, 4, 8, 16, 32, 64], tolerance=0.15)
    assert loose.batch_size == 32
    assert choose_by_throughput(lambda b: 1.0, [1, 4, 2], tolerance=0.0).batch_size == 4


def test_a_slower_large_batch_loses():
    # past 16 a step gets slower per sample (e.g. memory pressure)
    choice = choose_by_throughput(lambda b: 0.05 * b if b <= 16 else 0.1 * b, [4, 8, 16, 32], tolerance=0.02)
    assert choice.batch_size == 4  # 4, 8 and 16 all give 20 samples/s: the smallest is kept


def test_bad_arguments():
    with pytest.raises(ValueError, match="no batch sizes"):
        choose_by_throughput(saturating, [], tolerance=0.02)
    with pytest.raises(ValueError, match="throughput_tolerance=1.5"):
        choose_by_throughput(saturating, [1], tolerance=1.5)


def test_probe_throughput_times_real_steps_and_restores_the_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def train_step(batch):
        seen.append(batch["x"].shape[0])
        batch.pop("x")  # a step may consume its dict; each step gets a fresh one
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(saturating(seen[-1]) / 5)  # 24-84 ms: timer noise stays small against 19% steps

    target = ProbeTarget(train_step, lambda b: {"x": torch.zeros(b, 8)}, model, opt, torch.device("cpu"))
    choice = probe_throughput(target, max_batch_size=32, tolerance=0.02, snapshot_dir=str(tmp_path))
    assert seen == [b for b in [1, 2, 4, 8, 16, 32] for _ in range(3)]  # one untimed, two timed each
    assert choice.batch_size == 32 and len(choice.trials) == 6
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
