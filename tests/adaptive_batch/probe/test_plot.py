import sys

import pytest

from adaptive_batch import ConfigError
from adaptive_batch.probe.plot import plot_probe_report
from adaptive_batch.probe.report import ProbeReport

REPORT = ProbeReport.from_dict({
    "max_batch_size": 19, "batch_size": 16, "budget_bytes": 500 * 2**20, "seq_len": 256, "device": "cpu",
    "estimate": {"fixed_bytes": 40 * 2**20, "bytes_per_sample": 24 * 2**20},
    "trials": [
        {"phase": "warmup", "batch_size": 1, "fits": True, "peak_bytes": 52 * 2**20},
        {"phase": "estimate", "batch_size": 1, "fits": True, "peak_bytes": 62 * 2**20},
        {"phase": "estimate", "batch_size": 2, "fits": True, "peak_bytes": 86 * 2**20},
        {"phase": "search", "batch_size": 19, "fits": True, "peak_bytes": 490 * 2**20},
        {"phase": "search", "batch_size": 20, "fits": False, "peak_bytes": 514 * 2**20},
    ],
})


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_probe_report(REPORT, str(tmp_path / "probe.png"))
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_without_matplotlib_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ConfigError, match=r"needs matplotlib, which is not installed: pip install 'adaptive-batch\[plot\]'"):
        plot_probe_report(REPORT, str(tmp_path / "probe.png"))
    assert not (tmp_path / "probe.png").exists()
