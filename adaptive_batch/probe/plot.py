"""Memory against batch size, drawn from a probe report (matplotlib, an optional extra)."""

from adaptive_batch.errors import ConfigError
from adaptive_batch.probe.report import ProbeReport

INSTALL_HINT = "pip install 'adaptive-batch[plot]'"


def plot_probe_report(report: ProbeReport, path: str) -> str:
    """Draws the measured trials, the fitted line, the budget and the chosen batch to ``path``.

    Returns:
        ``path``.

    Raises:
        ConfigError: when matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}.") from None

    mib = 2**20
    trials = [t for t in report.trials if t.peak_bytes is not None and t.phase != "warmup"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fits = [t for t in trials if t.fits]
    fails = [t for t in trials if not t.fits]
    planned = all(t.phase == "planned" for t in trials)
    fits_label = "planned step (fake tensors)" if planned else "trial: fits"
    ax.scatter([t.batch_size for t in fits], [t.peak_bytes / mib for t in fits], color="tab:green", label=fits_label, zorder=3)
    if fails:
        ax.scatter([t.batch_size for t in fails], [t.peak_bytes / mib for t in fails], color="tab:red", marker="x", label="trial: over budget", zorder=3)
    top = max([t.batch_size for t in trials] + [report.max_batch_size + 1])
    estimate = report.estimate
    if estimate.get("bytes_per_sample"):
        xs = [0, top]
        ax.plot(xs, [(estimate["fixed_bytes"] + estimate["bytes_per_sample"] * x) / mib for x in xs], "--", color="tab:blue", label="fitted line")
    ax.axhline(report.budget_bytes / mib, color="tab:gray", label="budget")
    ax.axvline(report.batch_size, color="tab:orange", linestyle=":", label=f"chosen batch {report.batch_size}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("peak memory of a step (MiB)")
    ax.set_title(f"seq_len {report.seq_len} on {report.device}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
