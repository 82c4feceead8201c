"""The Lightning callback: the answer is MemTracker's on the same step, it is set where Lightning
reads the batch size, the fit trains it, and the fit is the one a run at that batch would make."""

import sys

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")  # the [lightning] extra; CI installs it

from adaptive_batch import ConfigError  # noqa: E402
from adaptive_batch.lightning import AdaptiveBatchFinder, find_batch_size  # noqa: E402

FEATURES, HIDDEN, ROWS = 256, 2048, 2048
BUDGET = "24MiB"


def _data():
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ROWS, FEATURES, generator=generator), torch.randn(ROWS, 1, generator=generator))


def _net():
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


class Regression(pl.LightningModule):
    """Reads its batch size where ``BatchSizeFinder`` would set it, and logs as modules do."""

    def __init__(self, batch_size=2):
        super().__init__()
        self.batch_size = batch_size
        self.net = _net()
        self.trained = []  # the batch sizes the fit loop ran

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.trained.append(len(batch[0]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=self.batch_size, shuffle=True)


def _trainer(*callbacks, steps=2, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kwargs)


def test_the_answer_is_memtrackers_on_the_same_step_and_the_fit_trains_it():
    sys.path.insert(0, "benchmarks")
    from truth import memtracker_max_batch_size

    from adaptive_batch.memory.device import parse_memory

    model, lines = Regression(), []
    finder = AdaptiveBatchFinder(max_memory=BUDGET, log=lines.append)
    _trainer(finder).fit(model)
    found = finder.optimal_batch_size
    assert found == model.batch_size and model.trained == [found, found]
    trials = [line for line in lines if line.startswith("probe trial")]
    assert 2 <= len(trials) <= 6 and sum("fits" not in line for line in trials) <= 1, trials
    assert lines[-1].startswith(f"adaptive-batch: batch_size={found} (was 2)")
    # The truth, on a plain PyTorch step of the same model: the budget less the CPU's 1% margin.
    net = _net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(batch):
        F.mse_loss(net(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Batches of their own (a slice of the dataset would be its whole storage to MemTracker).
    truth = memtracker_max_batch_size(step, lambda b: (torch.randn(b, FEATURES), torch.randn(b, 1)), model=net,
                                      optimizer=optimizer, budget_bytes=int(parse_memory(BUDGET) * 0.99), upper=ROWS)
    assert 1 < truth < ROWS and truth * 0.99 <= found <= truth


def test_the_fit_after_the_probe_is_the_fit_at_that_batch_without_it():
    """Model, optimizer, RNG and data order come out of the probe untouched."""
    pl.seed_everything(0)
    probed = Regression()
    finder = AdaptiveBatchFinder(max_memory=BUDGET)
    _trainer(finder, steps=3).fit(probed)
    pl.seed_everything(0)
    plain = Regression(batch_size=finder.optimal_batch_size)
    _trainer(steps=3).fit(plain)
    for a, b in zip(probed.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_the_tuner_function_sets_the_batch_without_a_training_step_and_a_fit_trains_it():
    model = Regression()
    found = find_batch_size(_trainer(), model, max_memory=BUDGET)
    assert found > 2 and model.batch_size == found and model.trained == []
    _trainer().fit(model)
    assert model.trained == [found, found]


def test_a_batch_size_in_the_datamodule_and_manual_optimization():
    class Data(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=self.batch_size)

    class Manual(pl.LightningModule):  # no batch_size of its own: the datamodule holds it
        def __init__(self):
            super().__init__()
            self.net, self.trained = _net(), []
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            self.manual_backward(F.mse_loss(self.net(batch[0]), batch[1]))
            optimizer.step()
            optimizer.zero_grad()

        def on_train_batch_start(self, batch, batch_idx):
            self.trained.append(len(batch[0]))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data, model = Data(), Manual()
    finder = AdaptiveBatchFinder(max_memory=BUDGET)
    _trainer(finder).fit(model, datamodule=data)
    assert data.batch_size == finder.optimal_batch_size > 2 and model.trained == [data.batch_size] * 2


def test_what_it_cannot_probe_is_one_line_before_any_trial():
    from lightning.pytorch.callbacks import BatchSizeFinder

    with pytest.raises(ConfigError, match="max_memory='lots' cannot be parsed"):
        AdaptiveBatchFinder(max_memory="lots")
    with pytest.raises(ConfigError, match="batch_arg_name='bs': neither the LightningModule"):
        _trainer(AdaptiveBatchFinder(batch_arg_name="bs")).fit(Regression())
    for callbacks in ([AdaptiveBatchFinder(), BatchSizeFinder()], [BatchSizeFinder(), AdaptiveBatchFinder()]):
        model = Regression()  # refused before either searches: the batch size is untouched
        with pytest.raises(ConfigError, match="BatchSizeFinder and AdaptiveBatchFinder both set the batch size"):
            _trainer(*callbacks).fit(model)
        assert model.batch_size == 2
    with pytest.raises(ConfigError, match=r"train_dataloaders passed to fit\(\) are built already"):
        _trainer(AdaptiveBatchFinder()).fit(Regression(), train_dataloaders=DataLoader(_data(), batch_size=2))

    class Fixed(Regression):  # has batch_size, but its dataloader never reads it
        def train_dataloader(self):
            return DataLoader(_data(), batch_size=2)

    with pytest.raises(ConfigError, match=r"train_dataloader\(\) still builds batches of 2: build its DataLoader "
                                          r"with batch_size=self.batch_size"):
        _trainer(AdaptiveBatchFinder(max_memory=BUDGET)).fit(Fixed())


def test_trials_take_the_precisions_inputs_and_leave_the_runs_logger_alone(tmp_path):
    """Under bf16-true the loop converts each batch to bf16 before the step, and so must a trial
    (an fp32 batch into bf16 weights fails). A callback's backward hook, which trials run too,
    must not write to the run's logger: a dummy one stands in during the trials."""
    from lightning.pytorch.loggers import CSVLogger

    seen = []

    class Loggers(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            seen.append((trainer.state.fn is not None and trainer.global_step, type(trainer.logger).__name__))

    model, finder = Regression(), AdaptiveBatchFinder(max_memory=BUDGET)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, precision="bf16-true", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[finder, Loggers()],
                         logger=CSVLogger(tmp_path))
    trainer.fit(model)
    assert model.batch_size == finder.optimal_batch_size > 2 and model.trained[0] == model.batch_size
    loggers = [name for _, name in seen]
    assert loggers[-2:] == ["CSVLogger", "CSVLogger"] and set(loggers[:-2]) == {"DummyLogger"}, loggers


def test_a_global_batch_trains_as_the_equal_micro_batches_that_fit_and_fits_as_the_whole_batch():
    """global_batch_size=16 where 6 fit: batch_size=4 and accumulate_grad_batches=4, the trials
    two micro-batches with the first one's gradients alive, and the fit the one a batch of 16
    makes, parameter for parameter."""
    pl.seed_everything(0)
    probed, lines = Regression(), []
    finder = AdaptiveBatchFinder(max_memory=BUDGET, global_batch_size=16, max_batch_size=6, log=lines.append)
    trainer = _trainer(finder)
    trainer.fit(probed)
    assert finder.optimal_batch_size == 6 and probed.batch_size == 4 and trainer.accumulate_grad_batches == 4
    assert probed.trained == [4] * 8  # 2 optimizer steps of 4 micro-batches
    assert lines[-1].startswith("adaptive-batch: global_batch_size=16 trains as 4 x 4 (batch_size=4, was 2; "
                                "accumulate_grad_batches=4); the largest that trains within max_memory=24MiB is 6.")
    pl.seed_everything(0)
    whole = Regression(batch_size=16)
    _trainer().fit(whole)
    for a, b in zip(probed.parameters(), whole.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # An epoch's last step of fewer micro-batches (2048 = 85 x 24 + 8: one micro-batch of 8 where
    # 3 x 8 make the step) is the mean of its samples, as a plain fit's last step at 24 is:
    # Lightning divided its loss by 3.
    class PlainSGD(Regression):  # Adam's update hardly sees a gradient a third of its size
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    fits = []
    for finder, batch_size in ((AdaptiveBatchFinder(max_memory=BUDGET, global_batch_size=24, max_batch_size=8), 2),
                               (None, 24)):
        pl.seed_everything(0)
        fits.append(PlainSGD(batch_size=batch_size))
        _trainer(*[finder] if finder else [], steps=-1, max_epochs=1).fit(fits[-1])
    assert fits[0].trained[-1] == 8 and fits[1].trained[-1] == 8
    for a, b in zip(fits[0].parameters(), fits[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2 with global_batch_size=16: .* set "
                       "accumulate_grad_batches=1"):
        _trainer(AdaptiveBatchFinder(global_batch_size=16), accumulate_grad_batches=2).fit(Regression())
    with pytest.raises(ConfigError, match="global_batch_size=0 must be a positive integer"):
        AdaptiveBatchFinder(global_batch_size=0)


class Scheduled(Regression):
    """A step-counted, chainable schedule (StepLR multiplies the LR it finds), the data in order
    from a loader that resumes mid-epoch, and the LR each batch of the fit trains with (the probe's trials run no batch hook)."""

    def __init__(self, batch_size=2):
        super().__init__(batch_size)
        self.lrs = []

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):  # resumable mid-epoch: Lightning saves and restores its position
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(_data(), batch_size=self.batch_size)


def double_after_the_first(epoch, current_batch_size):
    return current_batch_size if epoch > 0 else 0


class Shuffled(Scheduled):
    """Shuffled by a resumable loader; which samples each batch held."""

    def __init__(self, batch_size=2):
        super().__init__(batch_size)
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.seen.append(round(batch[1].sum().item(), 4))

    def train_dataloader(self):  # 8 rows: every epoch runs to its end (4 batches of 2, 2 of 4, 6 + 2)
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(TensorDataset(*_data()[:8]), batch_size=self.batch_size, shuffle=True)


class SeenLR(pl.Callback):
    """A monitor's view: the LR the optimizer holds when a batch starts (LearningRateMonitor's hook)."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _growth_trainer(*callbacks, epochs=3, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=4, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kwargs)


def _growing(**kwargs):
    return AdaptiveBatchFinder(max_memory=BUDGET, max_batch_size=6, batch_increase_function=double_after_the_first,
                               lr_scaling="linear", **kwargs)


def test_growth_follows_the_function_up_to_the_answer_with_the_lr_in_force_where_monitors_read_it():
    """The fit starts at the configured batch of 2 and doubles from epoch 1, clamped at the answer
    (6, the cap); each step's LR is StepLR's times batch / 2, never compounded, and a monitor
    that comes first in the callbacks sees it."""
    model, monitor, lines = Scheduled(), SeenLR(), []
    finder = _growing(log=lines.append)
    trainer = _growth_trainer(monitor, finder, enable_checkpointing=False)
    trainer.fit(model)
    assert finder.optimal_batch_size == 6
    assert model.trained == [2] * 4 + [4] * 4 + [6] * 4
    schedule = [1e-3 * 0.5 ** step for step in range(12)]  # one optimizer step a batch
    expected = [lr * batch / 2 for lr, batch in zip(schedule, model.trained)]
    assert model.lrs == pytest.approx(expected) and monitor.lrs == pytest.approx(expected)
    assert "adaptive-batch: epoch 2: batch 4 -> 6 (8 asked; the largest that trains), trained as 1 x 6." in lines
    assert trainer.callback_metrics["batch_size"] == 6


class AppliedLR(Regression):
    """Plain SGD: the LR an update applied is its change over its gradient, read on a bias."""

    def __init__(self, manual=False):
        super().__init__()
        self.automatic_optimization, self.applied = not manual, []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def on_before_optimizer_step(self, optimizer):
        bias = self.net[-1].bias
        self._before = (bias.detach().clone(), bias.grad.detach().clone())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        before, grad = self._before
        self.applied.append(((before - self.net[-1].bias.detach()) / grad).mean().item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual optimization"])
def test_the_update_applies_the_lr_in_force(manual):
    """Lightning runs the closure inside optimizer.step, after the step's pre-hook scaled the LR:
    the callback put the configured LR back there, so every update took 0.01 while every monitor
    showed 0.01 x batch / 2."""
    model = AppliedLR(manual)
    _growth_trainer(_growing(), enable_checkpointing=False, epochs=2).fit(model)
    assert model.trained == [2] * 4 + [4] * 4
    assert model.applied == pytest.approx([0.01 * batch / 2 for batch in model.trained], rel=1e-4)


def test_growth_with_accumulation_passes_the_answer_in_equal_micro_batches():
    model = Scheduled()
    trainer = _growth_trainer(_growing(grow_with_accumulation=True), enable_checkpointing=False)
    trainer.fit(model)
    # epoch 2: 8 as 2 x 4 (4 micro-batches, 2 optimizer steps)
    assert model.trained == [2] * 4 + [4] * 4 + [4] * 4 and trainer.accumulate_grad_batches == 2
    steps = [1e-3 * 0.5 ** step for step in range(10)]
    assert model.lrs[-4:] == pytest.approx([steps[8] * 4] * 2 + [steps[9] * 4] * 2)


def test_a_resumed_fit_trains_what_the_uninterrupted_one_trains_and_other_settings_are_refused(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    whole = Scheduled()
    _growth_trainer(_growing(), enable_checkpointing=False).fit(whole)

    pl.seed_everything(0)
    first = Scheduled()
    saved = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _growth_trainer(_growing(), saved, epochs=2).fit(first)
    resumed, lines = Scheduled(), []
    _growth_trainer(_growing(log=lines.append), epochs=3, enable_checkpointing=False).fit(
        resumed, ckpt_path=tmp_path / "last.ckpt")
    assert not [line for line in lines if line.startswith("probe trial")]
    assert resumed.batch_size == 6 and resumed.trained == whole.trained[-4:] and resumed.lrs == whole.lrs[-4:]
    for a, b in zip(resumed.parameters(), whole.parameters()):
        torch.testing.assert_close(a, b)

    # Mid-epoch: a checkpoint after step 6 (epoch 1's second batch of 4); the rest of epoch 1 at 4.
    pl.seed_everything(0)
    mid = ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=2, save_top_k=-1)
    _growth_trainer(_growing(), mid, epochs=2).fit(Scheduled())
    resumed = Scheduled()
    _growth_trainer(_growing(), epochs=3, enable_checkpointing=False).fit(
        resumed, ckpt_path=tmp_path / "mid" / "epoch=1-step=6.ckpt")
    assert resumed.trained == whole.trained[-6:] and resumed.lrs == pytest.approx(whole.lrs[-6:])
    for a, b in zip(resumed.parameters(), whole.parameters()):
        torch.testing.assert_close(a, b)

    # At an epoch's last batch: Lightning restarts the next epoch without on_train_epoch_start,
    # and the fit resumed there once trained epoch 1 at epoch 0's batch.
    resumed = Scheduled()
    _growth_trainer(_growing(), epochs=3, enable_checkpointing=False).fit(
        resumed, ckpt_path=tmp_path / "mid" / "epoch=0-step=4.ckpt")
    assert resumed.trained == whole.trained[4:] and resumed.lrs == pytest.approx(whole.lrs[4:])

    # Shuffled: the loader rebuilt for a grown epoch shuffles from the run's seed and the epoch.
    pl.seed_everything(0)
    whole = Shuffled()
    _growth_trainer(_growing(), enable_checkpointing=False).fit(whole)
    pl.seed_everything(0)
    shuffled = ModelCheckpoint(dirpath=tmp_path / "shuffled", every_n_train_steps=4, save_top_k=-1)
    _growth_trainer(_growing(), shuffled, epochs=1).fit(Shuffled())
    pl.seed_everything(0)  # the user's script, run again...
    torch.rand(3)  # ...where the global RNG has moved on otherwise (a checkpoint does not keep it)
    resumed = Shuffled()
    _growth_trainer(_growing(), epochs=3, enable_checkpointing=False).fit(
        resumed, ckpt_path=tmp_path / "shuffled" / "epoch=0-step=4.ckpt")
    assert resumed.seen == whole.seen[4:] and resumed.trained == [4, 4, 6, 2]

    with pytest.raises(ConfigError, match=r"lr_scaling='sqrt', but the checkpoint's fit ran with lr_scaling='linear'"):
        _growth_trainer(AdaptiveBatchFinder(max_memory=BUDGET, max_batch_size=6, lr_scaling="sqrt",
                                            batch_increase_function=double_after_the_first),
                        epochs=3, enable_checkpointing=False).fit(Scheduled(), ckpt_path=tmp_path / "last.ckpt")


def test_a_scheduled_accumulation_is_probed_as_accumulated_and_a_fixed_batch_sampler_is_refused():
    """An accumulation scheduled for a later epoch: the trials ran epoch 0's single micro-batch, and
    the answer ran out of memory where the fit accumulated 8. A loader of its own batch sampler
    has no batch_size to check: its sampler's is read (every step trained 4 where 256 was set)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from torch.utils.data import BatchSampler, SequentialSampler

    answers = []
    for callbacks, accumulate in (([GradientAccumulationScheduler({0: 1, 1: 4})], 1), ([], 4)):
        finder = AdaptiveBatchFinder(max_memory=BUDGET)
        _trainer(finder, *callbacks, accumulate_grad_batches=accumulate, steps=1).fit(Regression())
        answers.append(finder.optimal_batch_size)
    assert answers[0] == answers[1]

    class FixedSampler(Regression):
        def train_dataloader(self):
            return DataLoader(_data(), batch_sampler=BatchSampler(SequentialSampler(range(ROWS)), 4, False))

    with pytest.raises(ConfigError, match=r"train_dataloader\(\) still builds batches of 4"):
        _trainer(AdaptiveBatchFinder(max_memory=BUDGET)).fit(FixedSampler())


def test_bad_growth_settings_are_one_line_before_any_trial():
    with pytest.raises(ConfigError, match=r"max_batch_size=0 must be a positive integer"):  # was "no limit"
        AdaptiveBatchFinder(max_batch_size=0)
    with pytest.raises(ConfigError, match=r"make_batch=3 is not a function"):  # was a TypeError at fit start
        AdaptiveBatchFinder(make_batch=3)
    with pytest.raises(ConfigError, match=r"log=5 is not a function"):  # a bare TypeError at fit start
        AdaptiveBatchFinder(log=5)
    for name in (5, ""):  # Lightning's "attribute name must be string" at fit start; a line naming ``
        with pytest.raises(ConfigError, match=rf"batch_arg_name={name!r} must name the attribute"):
            AdaptiveBatchFinder(batch_arg_name=name)
    manual = AppliedLR(manual=True)  # every manual step took twice its gradient under the accumulation
    with pytest.raises(ConfigError, match=r"global_batch_size with manual optimization: .* automatic_optimization=True"):
        _trainer(AdaptiveBatchFinder(max_memory=BUDGET, global_batch_size=16, max_batch_size=4)).fit(manual)
    assert manual.trained == []
    with pytest.raises(ConfigError, match="no_such_module"):
        AdaptiveBatchFinder(batch_increase_function="no_such_module.grow")
    with pytest.raises(ConfigError, match="lr_scaling='cubic'"):
        AdaptiveBatchFinder(lr_scaling="cubic")
    with pytest.raises(ConfigError, match=r"batch_increase_interval='5000 samples': .* the epoch's start"):
        AdaptiveBatchFinder(batch_increase_function=double_after_the_first, batch_increase_interval="5000 samples")
    model = Regression()
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2 with batch_increase_function=.*double_after_the_first"):
        _trainer(_growing(), accumulate_grad_batches=2).fit(model)
    assert model.trained == []


def test_a_grown_batch_with_no_divisor_near_the_answer_is_said():
    from adaptive_batch.lightning.finder import FitBatch, _small_split

    assert FitBatch.of(13, 6) == FitBatch(13, 1, 13)
    assert "13 has no divisor near it" in _small_split(FitBatch.of(13, 6), 6)
    assert _small_split(FitBatch.of(12, 6), 6) == "" and _small_split(FitBatch.of(5, 6), 6) == ""


DDP_SCRIPT = '''
import json, os, sys
sys.path.insert(0, os.environ["TEST_DIR"])
import torch
from torch import nn
import torch.distributed as dist
from test_finder import Regression, pl
from adaptive_batch.lightning import AdaptiveBatchFinder

rank, out = int(os.environ["RANK"]), {}
seen = []  # the batches the growth function was called with


def double_after_the_first(epoch, current_batch_size):
    seen.append(current_batch_size)
    return 0 if epoch == 0 else current_batch_size


class Recorded(Regression):
    def training_step(self, batch, batch_idx):  # a log reduced over the ranks at every step, as DDP fits do
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.trained.append((len(batch[0]), self.trainer.optimizers[0].param_groups[0]["lr"]))


def trainer(finder, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[finder], **kwargs)


# 1. Each rank its own budget; growth of the batch over both ranks, with the LR following it.
lines, model = [], Recorded()
finder = AdaptiveBatchFinder(max_memory=["40MiB", "24MiB"][rank], batch_increase_function=double_after_the_first,
                             lr_scaling="linear", log=lines.append)
fit = trainer(finder, max_epochs=2, limit_train_batches=2)
fit.fit(model)
out["growth"] = dict(found=finder.optimal_batch_size, own=[line for line in lines if "this one alone" in line],
                     trained=model.trained, seen=seen, logged=float(fit.callback_metrics["batch_size"]),
                     params=[p.detach().sum().item() for p in model.parameters()])

# 2. A global batch: each rank's share in the equal micro-batches that fit.
lines, model = [], Regression()
finder = AdaptiveBatchFinder(max_memory="24MiB", global_batch_size=12, max_batch_size=4, log=lines.append)
trainer(finder, max_steps=1).fit(model)
out["global"] = dict(trained=model.trained, line=lines[-1])


# 3. SyncBatchNorm gathers every rank's statistics in its forward: the trials, whose number differs
# from rank to rank, must not. It runs on GPUs alone (DDP refuses it on CPU), so what is checked
# here is the group it would gather over: this rank alone, which torch's SyncBatchNorm does not sync.
from types import SimpleNamespace
from adaptive_batch.lightning.fit_trials import trials_on_this_rank_alone

norm = nn.SyncBatchNorm(4)
strategy = SimpleNamespace(lightning_module=nn.Sequential(norm), model="the DDP wrapper")
with trials_on_this_rank_alone(SimpleNamespace(world_size=2, strategy=strategy)):
    inside = [strategy.model is strategy.lightning_module, dist.get_world_size(norm.process_group)]
out["sync_norm"] = dict(inside=inside, after=[strategy.model, norm.process_group is None])

# 4. A synced log reduces at every step: inside the trials, over this rank alone (rank 1 reduces
# three times where rank 0 reduces once; reduced together, rank 1 would wait for a partner).
real = fit.strategy
with trials_on_this_rank_alone(SimpleNamespace(world_size=2, strategy=real)):
    out["reduced"] = [float(real.reduce(torch.tensor(float(rank + 1)))) for _ in range(1 + 2 * rank)]
    real.barrier()
out["reduced_after"] = float(real.reduce(torch.tensor(float(rank + 1))))  # both ranks: the mean again
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
from adaptive_batch.distributed import exit_past_teardown
exit_past_teardown(0)
'''


@pytest.mark.slow
def test_under_ddp_every_rank_trains_the_smallest_ranks_answer_and_grows_the_batch_over_both(tmp_path):
    """torchrun with 2 CPU ranks, one budget each: the trials run each rank's bare module (no
    gradient all-reduce, SyncBatchNorm over the rank alone), every rank takes the smallest
    answer, the growth function sees the batch over both ranks, and the ranks stay one model."""
    import json
    import os
    from pathlib import Path
    import subprocess

    script, out = tmp_path / "ddp.py", tmp_path / "out"
    script.write_text(DDP_SCRIPT)
    out.mkdir()
    env = dict(os.environ, TEST_DIR=str(Path(__file__).parent), OUT=str(out),
               PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    run = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rank0, rank1 = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    grown0, grown1 = rank0["growth"], rank1["growth"]
    own = [int(g["own"][0].split("this one alone: ")[1].split(")")[0]) for g in (grown0, grown1)]
    assert own[0] > own[1] and grown0["found"] == grown1["found"] == own[1]  # the 24 MiB rank's
    # 2 a rank (4 in all) at epoch 0, doubled over both ranks at epoch 1, the LR with it
    assert grown0["seen"] == grown1["seen"] == [4, 4]
    assert grown0["trained"] == grown1["trained"] == [[2, 1e-3]] * 2 + [[4, 2e-3]] * 2
    assert grown0["logged"] == 8.0  # the samples of the step over both ranks
    assert grown0["params"] == pytest.approx(grown1["params"])  # DDP kept one model

    assert rank0["global"]["trained"] == rank1["global"]["trained"] == [3, 3]  # 12 = 2 ranks x 2 x 3
    assert rank0["global"]["line"].startswith("adaptive-batch: global_batch_size=12 trains as 2 x 3 on each of 2 ranks")

    # the trials run the bare module, SyncBatchNorm over a group of one; afterwards, all as it was
    assert rank0["sync_norm"] == rank1["sync_norm"] == {"inside": [True, 1], "after": ["the DDP wrapper", True]}
    assert (rank0["reduced"], rank1["reduced"]) == ([1.0], [2.0] * 3)
    assert rank0["reduced_after"] == rank1["reduced_after"] == 1.5


def test_a_strategy_that_shards_the_model_is_refused_on_several_processes():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    trainer = SimpleNamespace(accumulate_grad_batches=1, world_size=2, strategy=FSDPStrategy(), callbacks=[])
    with pytest.raises(ConfigError, match="strategy=FSDPStrategy on 2 processes: it shards the model.*strategy='ddp'"):
        AdaptiveBatchFinder()._refuse_what_it_cannot_probe(trainer, Regression())


def test_a_checkpoint_of_another_number_of_devices_is_refused_and_one_from_before_ranks_were_kept_resumes():
    finder = _growing()
    _growth_trainer(finder, epochs=1, enable_checkpointing=False).fit(Regression())
    state = finder.state_dict()
    assert state["settings"]["world_size"] == 1
    two = _growing()
    two.load_state_dict({**state, "settings": {**state["settings"], "world_size": 2}})
    with pytest.raises(ConfigError, match=r"world_size=1, but the checkpoint's fit ran with world_size=2"):
        _growth_trainer(two, epochs=2, enable_checkpointing=False).fit(Regression())
    lines = []
    before = _growing(log=lines.append)  # a checkpoint written when every fit ran on one device
    before.load_state_dict({**state, "settings": {k: v for k, v in state["settings"].items() if k != "world_size"}})
    _growth_trainer(before, epochs=2, enable_checkpointing=False).fit(Regression())
    assert any(line.startswith("adaptive-batch: resumed at the checkpoint's batch") for line in lines)


class Streamed(pl.LightningModule):
    """Rows read from a stream (an ``IterableDataset``: no length), whose step holds about three
    times its inputs in activations."""

    def __init__(self, batch_size=2):
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(STREAM_FEATURES, STREAM_HIDDEN), nn.ReLU(), nn.Linear(STREAM_HIDDEN, 1))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(StreamedRows(), batch_size=self.batch_size)


class StreamedRows(torch.utils.data.IterableDataset):
    """Each row made as it is read: a dataset tensor's row is a view of its whole storage, which
    the fit's count would take for the step's."""

    def __iter__(self):
        for i in range(STREAM_ROWS):
            generator = torch.Generator().manual_seed(i)
            yield torch.randn(STREAM_FEATURES, generator=generator), torch.randn(1, generator=generator)


STREAM_FEATURES, STREAM_HIDDEN, STREAM_ROWS = 512, 768, 4096


@pytest.mark.parametrize("limit", [None, 5], ids=["read-ahead", "limited-to-5-batches"])
def test_from_a_stream_the_fits_peak_at_the_answer_holds_the_batch_its_loop_read_ahead(limit):
    """Lightning's fetcher reads one batch ahead of a loader with no length, to know the last one:
    on the CPU the next batch is in the step's memory. A trial of the step's batch alone answered
    a batch whose fit took 1.13 times the budget. An integer limit_train_batches gives the stream
    a length, and the fetcher no longer reads ahead: a trial that held the next batch there
    answered 15% low. The truth is the fit's own peak, counted over its steps; a loader with a
    length is not read ahead (the tests above)."""
    from adaptive_batch.memory.device import parse_memory
    from adaptive_batch.memory.tracker import LiveTensorCounter

    budget = int(parse_memory("16MiB") * 0.99)  # less the CPU's 1% margin
    finder = AdaptiveBatchFinder(max_memory="16MiB",
                                 make_batch=lambda b: (torch.randn(b, STREAM_FEATURES), torch.randn(b, 1)))
    _trainer(finder, limit_train_batches=limit).fit(Streamed())
    found = finder.optimal_batch_size

    def fit_peak(batch_size):
        module = Streamed(batch_size)
        with LiveTensorCounter(baseline=list(module.parameters())) as counter:
            _trainer(steps=3, limit_train_batches=limit).fit(module)
        return counter.peak_bytes

    assert 1 < found < STREAM_ROWS // 3  # three steps of the stream at 3% over the answer
    assert fit_peak(found) <= budget < fit_peak(int(found * 1.03) + 1)
