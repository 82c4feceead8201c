import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from adaptive_batch.probe.fake_step import _peak_only_mem_tracker


def _peak(tracker_class):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Sequential(nn.ReLU(), nn.Linear(256, 256)), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = tracker_class()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):
            model(torch.randn(32, 64)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")


def test_the_peak_only_tracker_has_memtrackers_peak_by_category():
    """It skips the per-module peaks torch's tracker keeps (most of a large model's plan time);
    the step's peak, by device and category, is the same."""
    stock, peak_only = _peak(MemTracker), _peak(_peak_only_mem_tracker())
    assert stock == peak_only and next(iter(stock.values()))["Total"] > 0
