"""AdaptiveBatchTrainer growing its effective batch each epoch or every N steps: the batch the
function asks for up to what fits, the LR in force logged, the schedule counted in samples, and a
resumed run that trains what the uninterrupted one trains."""

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from adaptive_batch import ConfigError
from adaptive_batch.hf import AdaptiveBatchTrainer
from adaptive_batch.hf.trainer import STATE_FILE
from tests.adaptive_batch.hf.test_trainer import ByteCollator, _samples

SAMPLES, EPOCHS, FIRST = 32, 3, 4


def double_after_the_first(epoch, current_batch_size):
    return current_batch_size if epoch > 0 else 0


def _trainer(out, net=None, samples=None, collator=None, **kwargs):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    training = dict(output_dir=str(out), per_device_train_batch_size=FIRST, num_train_epochs=EPOCHS,
                    learning_rate=1e-3, lr_scheduler_type="linear", report_to=[], use_cpu=True, seed=0, data_seed=0,
                    logging_steps=1, disable_tqdm=True, save_strategy="steps", save_steps=2)
    training.update(kwargs.pop("training", {}))
    lines = []
    trainer = AdaptiveBatchTrainer(
        model=net() if net else LlamaForCausalLM(config), args=TrainingArguments(**training),
        train_dataset=samples or _samples(SAMPLES),
        data_collator=collator or ByteCollator(), probe_eval=False, log=lines.append,
        **{"max_memory": "20MiB", "max_batch_size": 6, "batch_increase_function": double_after_the_first,
           "lr_scaling": "linear", **kwargs},
    )
    trainer.lines = lines
    return trainer


def _worst_case(batch_size):
    return ByteCollator()(_samples(batch_size))


def _steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("whole"))
    trainer.train()
    return trainer


def test_each_epoch_grows_up_to_the_answer_with_the_lr_in_force_on_a_schedule_counted_in_samples(whole):
    """4 a step, then 8, then 16 asked where 6 fit: 6. The linear schedule, sized for 3 epochs
    at 4 (24 steps), advances by samples (steps of 4) and ends with the last sample, its LR
    times the step's samples over 4 logged with each step, as the recipes scale it."""
    steps = _steps(whole)
    trained = [4] * 8 + [6, 6, 6, 6, 6, 2] * 2  # epoch 1: 8 asked, 6 fit (32 = 5 x 6 + 2)
    assert [h["batch_size"] for h in steps] == trained
    assert "adaptive-batch: epoch 1: the effective batch 4 -> 6 (8 asked; the largest that trains), trained as 1 x 6; " \
           "LR x 1.5." in whole.lines
    seen = [sum(trained[:i]) for i in range(len(trained))]
    expected = [1e-3 * max(0.0, 1 - s / FIRST / (EPOCHS * SAMPLES / FIRST)) * b / FIRST for s, b in zip(seen, trained)]
    assert [h["learning_rate"] for h in steps] == pytest.approx(expected, rel=1e-6)
    assert sum(trained) == EPOCHS * SAMPLES and whole.state.global_step == len(trained)


@pytest.mark.parametrize("step", [10, 14], ids=["mid-epoch", "at-an-epoch-end"])
def test_a_resumed_run_trains_what_the_uninterrupted_run_trains(whole, tmp_path, step):
    """The Trainer would place step 10 in epoch 1 at 8 steps an epoch (right by chance) and step
    14 in epoch 1 too (it is epoch 1's last): here the checkpoint's position says."""
    resumed = _trainer(tmp_path)
    resumed.train(resume_from_checkpoint=f"{whole.args.output_dir}/checkpoint-{step}")
    assert not [line for line in resumed.lines if line.startswith("probe trial")]
    _assert_trains_the_rest_of(whole, resumed, step)


def _assert_trains_the_rest_of(whole, resumed, step):
    """``resumed``, from ``whole``'s checkpoint at ``step``, trained ``whole``'s steps after it."""
    after = [h for h in _steps(resumed) if h["step"] > step]  # the checkpoint's history comes first
    expected = _steps(whole)[step:]
    assert len(after) == len(expected) > 0
    for key in ("batch_size", "learning_rate", "epoch"):
        assert [h[key] for h in after] == pytest.approx([h[key] for h in expected], rel=1e-6), key
    assert [h["loss"] for h in after] == pytest.approx([h["loss"] for h in expected], rel=1e-4)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_resume_with_another_growth_setting_is_refused(whole, tmp_path):
    changed = _trainer(tmp_path, training={})
    changed._growth.lr = type(changed._growth.lr)(lr_scaling="sqrt")
    with pytest.raises(ConfigError, match=r"it trained lr_scaling='linear', this Trainer asks for 'sqrt'"):
        changed.train(resume_from_checkpoint=f"{whole.args.output_dir}/checkpoint-10")


def test_a_resume_on_another_number_of_ranks_is_refused(whole, tmp_path):
    """The position and the schedule count each rank's samples: a checkpoint of 2 ranks resumed by
    one would land elsewhere in its data and schedule."""
    checkpoint = tmp_path / "checkpoint-10"
    shutil.copytree(f"{whole.args.output_dir}/checkpoint-10", checkpoint)
    state = json.loads((checkpoint / STATE_FILE).read_text())
    assert state["world_size"] == 1
    (checkpoint / STATE_FILE).write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(ConfigError, match=r"it trained world_size=2, this Trainer asks for 1"):
        _trainer(tmp_path / "out", training={}).train(resume_from_checkpoint=str(checkpoint))


def test_what_growth_cannot_follow_is_one_line_before_any_step(tmp_path):
    with pytest.raises(ConfigError, match=r"max_steps=5 with batch_increase_function: .* set num_train_epochs"):
        _trainer(tmp_path, training={"max_steps": 5})
    with pytest.raises(ConfigError, match="no_such_module"):
        _trainer(tmp_path, batch_increase_function="no_such_module.grow")
    # the recipes' key: the loader counts the steps and samples it cuts, not tokens
    with pytest.raises(ConfigError, match=r"batch_increase_interval='100 tokens': .* grow every N steps or N samples"):
        _trainer(tmp_path, batch_increase_interval="100 tokens")
    with pytest.raises(ConfigError, match=r"batch_increase_interval='weekly' is not an interval"):
        _trainer(tmp_path, batch_increase_interval="weekly")
    stepped = _trainer(tmp_path)  # a scheduler of the user's that cannot be counted in samples
    stepped.lr_scheduler = torch.optim.lr_scheduler.StepLR(stepped.create_optimizer(), step_size=1)
    with pytest.raises(ConfigError, match="lr_scheduler_type with batch_increase_function: StepLR is not a LambdaLR"):
        stepped.train()
    assert not [line for line in stepped.lines if line.startswith("probe trial")]


def test_a_position_resumes_inside_its_epoch_or_at_the_next_ones_start():
    from adaptive_batch.hf.planned_loader import updates_in
    from adaptive_batch.hf.run_position import RunPosition

    position = RunPosition(epoch=1, epoch_start_step=8, epoch_updates=6)
    assert position.resume_point(global_step=10, accumulation=3) == (1, 6)  # 2 steps of 3 micro-batches in
    assert position.resume_point(global_step=14, accumulation=3) == (2, 0)
    assert updates_in(16, 3) == 6 and updates_in(15, 3) == 5 and updates_in(0, 3) == 1


def test_a_first_batch_that_accumulates_grows_in_micro_batches_and_resumes_inside_them(tmp_path):
    """8 asked as 2 x 4 where 6 fit: growth goes on in micro-batches (16 as 6 + 5 + 5, 32 as
    6 + 6 + 5 x 4), and a resume inside epoch 1 skips its steps' micro-batches by count."""
    training = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_steps": 1}
    whole = _trainer(tmp_path / "whole", training=training)
    whole.train()
    assert [h["batch_size"] for h in _steps(whole)] == [8] * 4 + [16] * 2 + [32]
    assert [h["micro_batch_size"] for h in _steps(whole)] == [4] * 4 + [6] * 2 + [6]
    resumed = _trainer(tmp_path / "resumed", training=training)
    resumed.train(resume_from_checkpoint=f"{whole.args.output_dir}/checkpoint-5")
    after = [h for h in _steps(resumed) if h["step"] > 5]
    assert [h["batch_size"] for h in after] == [16, 32]
    assert [h["loss"] for h in after] == pytest.approx([h["loss"] for h in _steps(whole)[5:]], rel=1e-4)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_that_did_not_grow_is_not_resumed_by_a_run_that_grows(tmp_path):
    plain = _trainer(tmp_path / "plain", batch_increase_function=None, lr_scaling="none",
                     training={"num_train_epochs": 1, "save_steps": 4})
    plain.train()
    with pytest.raises(ConfigError, match=r"it trained batch_increase_function=None, this Trainer asks for "
                                          r"'tests.adaptive_batch.hf.test_run_position.double_after_the_first'"):
        _trainer(tmp_path / "growing").train(resume_from_checkpoint=f"{plain.args.output_dir}/checkpoint-4")


def test_trials_of_a_run_that_grows_by_accumulation_run_two_micro_batches_here_and_in_a_trial_process(tmp_path):
    """A micro-batch at the first effective batch runs alone, but grown past the answer it is
    one of several: the trials measure two, with the first one's gradients alive."""
    from adaptive_batch.hf.trainer_build import TrainerTrialBuild

    trainer = _trainer(tmp_path, grow_with_accumulation=True)
    assert trainer.trials_grow_by_accumulation()
    build = TrainerTrialBuild.of(trainer, _worst_case)
    assert isinstance(build, TrainerTrialBuild) and build.grows_by_accumulation
    assert not _trainer(tmp_path).trials_grow_by_accumulation()


# ---------------------------------------------------------------- growth within epochs

def double_every_boundary_after_the_first(k, current_batch_size):
    return current_batch_size if k > 0 else 0


EVERY_3_STEPS = dict(batch_increase_function=double_every_boundary_after_the_first, batch_increase_interval="3 steps",
                     grow_with_accumulation=True)


class _LRSeen(TrainerCallback):
    """What a callback of the user's reads of the optimizer's LR, at a step's start and before its update."""

    def __init__(self):
        self.seen = {"on_step_begin": [], "on_pre_optimizer_step": []}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.seen["on_step_begin"].append(optimizer.param_groups[0]["lr"])

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.seen["on_pre_optimizer_step"].append(optimizer.param_groups[0]["lr"])


@pytest.fixture(scope="module")
def every_3_steps(tmp_path_factory):
    seen = _LRSeen()  # the user's own callback, given first, as users give theirs
    trainer = _trainer(tmp_path_factory.mktemp("steps"), training={"save_steps": 1}, callbacks=[seen], **EVERY_3_STEPS)
    trainer.lr_seen = seen
    trainer.train()
    return trainer


def test_every_n_steps_the_batch_grows_mid_epoch_with_the_lr_in_force(every_3_steps):
    """4, then 8 after 3 steps, 16 after 6, 32 after 9, past the 6 that fit in micro-batches:
    epoch 0 is 3 x 4 + 2 x 8 and the 4 left, epoch 1 two steps of 16, epoch 2 one of 16 and the
    16 left at 32. The epochs' lengths are the plan's; the LR is the schedule's at the samples
    seen times the step's samples over 4."""
    steps = _steps(every_3_steps)
    trained = [4, 4, 4, 8, 8, 4, 16, 16, 16, 16]
    assert [h["batch_size"] for h in steps] == trained
    assert [h["micro_batch_size"] for h in steps] == [4, 4, 4, 4, 4, 4, 6, 6, 6, 6]  # 8 as 4 + 4, 16 as 6 + 5 + 5
    assert [h["epoch"] for h in steps] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1, 1.5, 2, 2.5, 3])
    seen = [sum(trained[:i]) for i in range(len(trained))]
    expected = [1e-3 * (1 - s / (EPOCHS * SAMPLES)) * b / FIRST for s, b in zip(seen, trained)]
    assert [h["learning_rate"] for h in steps] == pytest.approx(expected, rel=1e-6)
    assert "adaptive-batch: interval 2 (6 steps): the batch 8 -> 16; LR x 4 from its first step." in every_3_steps.lines
    # a callback's own read of the optimizer is the LR in force too (it saw the unscaled one)
    for hook, seen in every_3_steps.lr_seen.seen.items():
        assert seen == pytest.approx(expected, rel=1e-6), hook


def test_a_boundary_the_run_ends_at_is_not_said_to_grow_the_batch(tmp_path):
    """Every 32 samples over 3 epochs of 32: the last batch cut reaches the boundary at 96, which
    no batch trains, and the log said "interval 3 (96 samples): the batch 16 -> 32"."""
    trainer = _trainer(tmp_path, training={"save_strategy": "no"}, batch_increase_function=double_every_boundary_after_the_first,
                       batch_increase_interval="32 samples", grow_with_accumulation=True)
    trainer.train()
    grew = [line for line in trainer.lines if line.startswith("adaptive-batch: interval")]
    assert [line.split(":")[1].strip() for line in grew] == ["interval 1 (32 samples)", "interval 2 (64 samples)"]
    assert sum(h["batch_size"] for h in _steps(trainer)) == EPOCHS * SAMPLES


class Seq2SeqCollator:
    """Pads sources with 0 and targets with -100: targets of different lengths, so a micro-batch's
    token mean is not its rows' share of the batch's."""

    def __call__(self, samples):
        def pad(key, value):
            longest = max(len(s[key]) for s in samples)
            return torch.tensor([s[key] + [value] * (longest - len(s[key])) for s in samples])

        ids = pad("input_ids", 0)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad("labels", -100)}


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                               decoder_start_token_id=0, pad_token_id=0,
                                               dropout_rate=0.0))  # split or whole, the same steps


def _seq2seq_samples():
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 512, (12,), generator=generator).tolist(),
             "labels": torch.randint(1, 512, (int(n),), generator=generator).tolist()}
            for n in torch.randint(2, 24, (SAMPLES,), generator=generator)]


def _token_mean(outputs, labels, num_items_in_batch=None):
    logits = outputs["logits"][:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _token_sum_over_items(outputs, labels, num_items_in_batch=None):
    logits = outputs["logits"][:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("model", ["weighted by tokens", "mean loss", "seq2seq token mean", "loss function's mean",
                                   "loss function over the step's tokens"])
def test_a_step_past_what_fits_trains_what_the_whole_batch_trains(tmp_path, model):
    """The same growth where 6 fit and where 32 do: steps of 8, 16 and 32 split into micro-batches
    (4 + 4, 6 + 5 + 5, ...) train what the whole batches train, with a loss divided by the step's
    tokens, one that is each micro-batch's mean (a row's, or a token's over targets of different
    lengths), and a compute_loss_func of either kind. Each micro-batch's mean weighed as its rows
    moved a T5's parameters by 1.5e-2; a loss function's mean was summed; one dividing by the
    step's tokens failed in the probe, which passed it none."""
    from tests.adaptive_batch.hf.test_trainer import MeanLossLM

    def run(out, **kwargs):
        if model == "mean loss":  # samples of one length: a token mean is a sample mean
            kwargs.update(net=MeanLossLM, samples=[{"input_ids": s["input_ids"][:8]} for s in _samples(SAMPLES)])
        elif model == "seq2seq token mean":
            kwargs.update(net=_t5, samples=_seq2seq_samples(), collator=Seq2SeqCollator())
        elif model.startswith("loss function"):
            kwargs.update(compute_loss_func=_token_mean if model.endswith("mean") else _token_sum_over_items)
        trainer = _trainer(out, training={"save_strategy": "no"}, **EVERY_3_STEPS, **kwargs)
        trainer.train()
        return trainer

    split, whole = run(tmp_path / "split"), run(tmp_path / "whole", max_batch_size=32, max_memory="2GiB")
    assert max(h["micro_batch_size"] for h in _steps(split)) == 6 and max(h["micro_batch_size"] for h in _steps(whole)) == 16
    assert [h["loss"] for h in _steps(split)] == pytest.approx([h["loss"] for h in _steps(whole)], rel=1e-5)
    for a, b in zip(split.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("step", [4, 6, 7], ids=["mid-epoch, past a boundary", "at-an-epoch-end", "mid-epoch, later"])
def test_a_run_growing_within_epochs_resumes_what_the_uninterrupted_run_trains(every_3_steps, tmp_path, step):
    """The loader cuts ahead of training, so the checkpoint keeps the growth of its epoch's start
    and the resume cuts the epoch's batches again, skipping those trained."""
    resumed = _trainer(tmp_path, **EVERY_3_STEPS)
    resumed.train(resume_from_checkpoint=f"{every_3_steps.args.output_dir}/checkpoint-{step}")
    _assert_trains_the_rest_of(every_3_steps, resumed, step)


def test_group_by_length_resumes_its_epochs_order_after_the_first(tmp_path):
    """Transformers' length-grouped sampler drew from the global RNG, which a resume restores at
    the checkpoint's step: resumed in epoch 1 it trained another order (a plain Trainer too). Its
    groups follow the batch it is built for: a resume built it at the grown batch (12, not 3)."""
    grouped = {"train_sampling_strategy": "group_by_length", "per_device_train_batch_size": 3}
    every_2 = {**EVERY_3_STEPS, "batch_increase_interval": "2 steps", "samples": _samples(40),
               "batch_increase_function": add_3_after_the_first}
    whole = _trainer(tmp_path / "whole", training={"save_steps": 1, **grouped}, **every_2)
    whole.train()
    assert [h["batch_size"] for h in _steps(whole)][7:10] == [12, 15, 13]  # epoch 1: grown, several batches
    resumed = _trainer(tmp_path / "resumed", training=grouped, **every_2)
    resumed.train(resume_from_checkpoint=f"{whole.args.output_dir}/checkpoint-8")
    _assert_trains_the_rest_of(whole, resumed, 8)


def add_3_after_the_first(k, current_batch_size):
    return 3 if k > 0 else 0


def test_growth_within_epochs_where_batches_are_shared_out_is_one_line(tmp_path, monkeypatch):
    import adaptive_batch.hf.trainer as hf_trainer

    monkeypatch.setattr(hf_trainer, "uneven_allowed", lambda trainer: False)  # as under several processes
    with pytest.raises(ConfigError, match=r"batch_increase_interval='3 steps' with several processes .* "
                                          r"set batch_increase_interval='epoch' there"):
        _trainer(tmp_path, **EVERY_3_STEPS)
    _trainer(tmp_path)  # per epoch, several processes grow


def test_evaluation_between_steps_leaves_them_split_and_the_function_is_asked_once_a_boundary(tmp_path):
    """The Trainer's evaluation leaves the model in eval mode: the next step trained its whole
    batch unsplit, each mean loss multiplied by the micro-batches it was planned in (2-3 times
    the gradient). And the epoch's length is simulated before its batches are cut: a function
    was asked up to 4 times for one boundary."""
    from tests.adaptive_batch.hf.test_trainer import MeanLossLM

    asked = []

    def double_and_count(k, current_batch_size):
        asked.append(k)
        return double_every_boundary_after_the_first(k, current_batch_size)

    def run(out, **training):
        trainer = _trainer(out, net=MeanLossLM, samples=[{"input_ids": s["input_ids"][:8]} for s in _samples(SAMPLES)],
                           training={"save_strategy": "no", **training}, eval_dataset=_samples(4),
                           **{**EVERY_3_STEPS, "batch_increase_function": double_and_count})
        trainer.train()
        return trainer

    plain = run(tmp_path / "plain")
    assert sorted(asked) == list(range(4))
    evaluated = run(tmp_path / "evaluated", eval_strategy="steps", eval_steps=1)
    assert [h["loss"] for h in _steps(evaluated)] == pytest.approx([h["loss"] for h in _steps(plain)], rel=1e-5)
    for a, b in zip(evaluated.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_fraction_of_an_epoch_ends_at_its_last_sample(tmp_path):
    """1.25 epochs of 32: the Trainer ends by its steps at the first batch, which a grown batch
    never reaches (it trained 2 whole epochs); here the last batch is cut to the 40th sample (it
    trained 16 of the 16 in force), and the schedule, sized for 1.25 epochs, ends there."""
    trainer = _trainer(tmp_path, training={"save_strategy": "no", "num_train_epochs": 1.25}, **EVERY_3_STEPS)
    trainer.train()
    steps = _steps(trainer)
    assert [h["batch_size"] for h in steps] == [4, 4, 4, 8, 8, 4, 8]
    assert steps[-1]["learning_rate"] == pytest.approx(1e-3 * (1 - 32 / 40) * 8 / FIRST)


def test_a_fraction_of_an_epoch_growing_by_epoch_ends_at_its_last_sample_in_micro_batches(tmp_path):
    """2.25 epochs of 32 growing each epoch by accumulation: the last epoch's step of 16 (6 + 5 + 5)
    trained all 16, 8 past the run's 72nd sample, at the LR of 16; it is cut to 8 (6 + 2, the third
    micro-batch empty: the Trainer steps after its count of them)."""
    trainer = _trainer(tmp_path, training={"save_strategy": "no", "num_train_epochs": 2.25}, grow_with_accumulation=True)
    trainer.train()
    steps = _steps(trainer)
    assert [h["batch_size"] for h in steps] == [4] * 8 + [8] * 4 + [8]
    assert sum(h["batch_size"] for h in steps) == 72
    assert steps[-1]["learning_rate"] == pytest.approx(1e-3 * (1 - 64 / 72) * 8 / FIRST)


def test_the_schedule_ends_with_the_last_sample_where_the_first_batch_does_not_divide_the_data(tmp_path):
    """30 samples at 4: 8 steps an epoch, 24 for the schedule, but 90 samples are 22.5 steps of 4:
    the decay counted in steps of the first batch stopped short of its end (40 at 16: at 5/6)."""
    trainer = _trainer(tmp_path, samples=_samples(30), training={"save_strategy": "no"},
                       batch_increase_function=lambda k, current_batch_size: 0)
    trainer.train()
    steps = _steps(trainer)
    trained = [4, 4, 4, 4, 4, 4, 4, 2] * EPOCHS
    seen = [sum(trained[:i]) for i in range(len(trained))]
    assert [h["batch_size"] for h in steps] == trained
    expected = [1e-3 * (1 - s / (EPOCHS * 30)) * b / FIRST for s, b in zip(seen, trained)]
    assert [h["learning_rate"] for h in steps] == pytest.approx(expected, rel=1e-6)


def test_a_resume_with_another_interval_is_refused(every_3_steps, tmp_path):
    """The interval decides which batches the checkpoint's run cut: resumed every 5 steps, or per
    epoch, it trained other batches from the same position, silently."""
    changed = _trainer(tmp_path, **{**EVERY_3_STEPS, "batch_increase_interval": "5 steps"})
    with pytest.raises(ConfigError, match=r"it trained batch_increase_interval='3 steps', this Trainer asks for '5 steps'"):
        changed.train(resume_from_checkpoint=f"{every_3_steps.args.output_dir}/checkpoint-4")


def test_growth_over_a_stream_is_one_line_before_the_trainers_own(tmp_path):
    """The Trainer asks a stream for max_steps, which growth then refused: a circle."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(_samples(SAMPLES))

    with pytest.raises(ConfigError, match=r"batch_increase_function with an IterableDataset: .* a dataset with a length"):
        _trainer(tmp_path, samples=Stream())


def test_a_resume_on_other_data_is_refused_and_one_recorded_before_its_size_was_kept_resumes(whole, tmp_path):
    """The position and the schedule count this data's samples: resumed on 40 samples where it
    trained 32, the run went on with another epoch's length and schedule, silently."""
    checkpoint = f"{whole.args.output_dir}/checkpoint-10"
    with pytest.raises(ConfigError, match=r"it trained dataset_size=32, this Trainer asks for 40; put it back"):
        _trainer(tmp_path / "other", samples=_samples(40)).train(resume_from_checkpoint=checkpoint)
    older = tmp_path / "checkpoint-10"
    shutil.copytree(checkpoint, older)
    state = json.loads((older / STATE_FILE).read_text())
    state.pop("dataset_size")
    state["growth"]["settings"].pop("dataset_size")
    (older / STATE_FILE).write_text(json.dumps(state))
    resumed = _trainer(tmp_path / "out")
    resumed.train(resume_from_checkpoint=str(older))
    _assert_trains_the_rest_of(whole, resumed, 10)


def test_a_growing_run_resumed_on_another_step_is_refused(whole, tmp_path):
    """Its growth is bounded by the probe's answer on the step it was probed on."""
    from tests.adaptive_batch.hf.test_trainer import _padded_to_64

    resumed = _trainer(tmp_path, collator=_padded_to_64)
    with pytest.raises(ConfigError, match=r"checkpoint-10: its batches were probed on another step \(the longest "
                                          r"sample's batch changed since\), and its growth is bounded by that answer"):
        resumed.train(resume_from_checkpoint=f"{whole.args.output_dir}/checkpoint-10")
    assert resumed.state.global_step == 0
