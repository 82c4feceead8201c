import gc

import torch

from adaptive_batch import LiveTensorCounter, live_tensor_bytes, measure_peak_bytes


def test_counts_the_peak_of_live_tensors_not_the_sum():
    def step():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = torch.ones(1024, 1024)  # 4 MiB more: peak 8 MiB
        del a, b
        c = torch.ones(512, 1024)  # 2 MiB after both are gone
        del c

    peak = measure_peak_bytes(step, torch.device("cpu"))
    assert peak == 8 * 1024**2


def test_baseline_tensors_count_once_and_views_share_storage():
    w = torch.zeros(1024, 256)  # 1 MiB
    view = w[:10]
    assert live_tensor_bytes([w, view, w.t()]) == 1024**2
    peak = measure_peak_bytes(lambda: torch.ones(256, 1024) + 0, torch.device("cpu"), [w, view])
    # w (1 MiB) + ones (1 MiB) + the sum (1 MiB)
    assert peak == 3 * 1024**2


def test_freed_storages_are_uncounted():
    counter = LiveTensorCounter()
    with counter:
        x = torch.ones(1024, 1024)
        assert counter.live_bytes == 4 * 1024**2
        del x
        gc.collect()
    assert counter.live_bytes == 0
    assert counter.peak_bytes == 4 * 1024**2


def test_backward_and_optimizer_state_are_counted():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    params = live_tensor_bytes(model.parameters())

    def step():
        model(x).pow(2).sum().backward()
        opt.step()

    peak = measure_peak_bytes(step, torch.device("cpu"), list(model.parameters()) + [x])
    # parameters + gradients + two Adam moments at least
    assert peak >= 4 * params


def test_a_failed_step_leaves_nothing_alive(limited_address_space):
    def failing_step():
        activations = torch.ones(1024, 1024)  # noqa: F841  (alive when the next line fails)
        torch.empty(1024**3, dtype=torch.uint8)

    counter = LiveTensorCounter()
    with limited_address_space(100 * 1024**2):
        try:
            with counter:
                failing_step()
        except RuntimeError:
            pass
    gc.collect()
    assert counter.peak_bytes == 4 * 1024**2
    assert counter.live_bytes == 0
