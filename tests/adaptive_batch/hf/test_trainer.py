"""AdaptiveBatchTrainer: transformers' Trainer with its batches probed, on a random-init Llama."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from adaptive_batch import ConfigError
from adaptive_batch.hf import AdaptiveBatchTrainer
from adaptive_batch.hf.refusals import refuse_what_changes_the_batch
from adaptive_batch.hf.trainer import STATE_FILE
from adaptive_batch.memory import device
from adaptive_batch.schedule.global_batch import micro_batch_sizes


class ByteCollator(DataCollatorForLanguageModeling):
    """Pads input_ids with 0 and labels with -100 (a tokenizer-free causal-LM collator)."""

    def __init__(self):  # no tokenizer: the samples are ids already
        pass

    def __call__(self, samples):
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.long)
        mask = torch.zeros(len(samples), longest, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
            mask[i, : len(s["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _samples(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 512, (int(n),), generator=generator).tolist()}
            for n in torch.randint(8, 64, (count,), generator=generator)]


def _trainer(tmp_path, per_device=16, accumulation=1, seed=0, training=None, **kwargs):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        learning_rate=1e-3, report_to=[], use_cpu=True, seed=seed, data_seed=seed, logging_steps=1, disable_tqdm=True,
        **{"max_steps": 2, "save_steps": 1, **(training or {})},
    )
    lines = []
    trainer = AdaptiveBatchTrainer(
        model=LlamaForCausalLM(config), args=args, train_dataset=_samples(64), eval_dataset=_samples(16, seed=1),
        data_collator=ByteCollator(), log=lines.append, **kwargs,
    )
    trainer.lines = lines
    return trainer


def test_the_effective_batch_trains_in_the_micro_batches_that_fit(tmp_path):
    trainer = _trainer(tmp_path, per_device=16, max_memory="20MiB")
    trainer.train()
    state = trainer.adaptive_batch
    found = state["max_micro_batch_size"]
    assert 1 < found < 16  # the budget holds less than the configured 16
    assert state["per_device_train_batch_size"] <= found and state["effective_batch_size"] == 16  # the user's batch
    # in the fewest micro-batches that fit, sizes differing by at most one
    assert state["gradient_accumulation_steps"] == -(-16 // found)
    sizes = micro_batch_sizes(16, state["per_device_train_batch_size"])
    assert len(sizes) == state["gradient_accumulation_steps"] and max(sizes) <= found
    assert trainer._update_rows in ([], sizes)  # the rows are counted where the micro-batches differ
    assert trainer.args.gradient_accumulation_steps == state["gradient_accumulation_steps"]
    assert trainer.state.global_step == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    # each logged step says the batch it trained (and the micro-batch), beside the LR in force
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and all(h["batch_size"] == 16 and "learning_rate" in h for h in steps)
    assert all(h["micro_batch_size"] == state["per_device_train_batch_size"] for h in steps)
    assert state["per_device_eval_batch_size"] >= found  # forward passes alone take less
    assert any(line.startswith("probe trial") for line in trainer.lines)
    # judged by tensor bytes, far below the machine, with no limit over the process: the probe sets
    # no allocator option (steps took 1.5x as long on them)
    assert not any(line.startswith("CPU allocator: glibc M_MMAP_THRESHOLD") for line in trainer.lines)
    assert "adaptive-batch (probed): the effective batch of 16 trains as" in trainer.lines[-1]
    saved = json.loads((Path(tmp_path) / "checkpoint-2" / STATE_FILE).read_text())
    assert saved == state


def test_a_soft_budget_near_the_machine_probes_on_the_settings_and_trains_on_glibcs_thresholds(tmp_path, monkeypatch):
    """Where the guard is near the budget (a fraction of the machine, or a size over half its
    headroom) the trials run on the probe's allocator; judged by tensor bytes with no limit over
    the process, training then goes back to glibc's fast thresholds (steps took 1.5x as long on
    the probe's), and each is said in one line."""
    monkeypatch.setattr(device, "probe_guard_needs_no_allocator_setting", lambda max_memory: False)
    monkeypatch.setattr(device, "_mmap_threshold_set", None)
    trainer = _trainer(tmp_path, max_memory="20MiB", probe_eval=False)
    trainer.train()
    settings = [i for i, line in enumerate(trainer.lines) if line.startswith("CPU allocator: glibc M_MMAP_THRESHOLD")]
    relaxed = [i for i, line in enumerate(trainer.lines) if line.startswith("CPU allocator: glibc's thresholds back to 32 MiB")]
    probed = [i for i, line in enumerate(trainer.lines) if line.startswith("probe trial")]
    assert len(settings) == len(relaxed) == 1 and settings[0] < probed[0] < probed[-1] < relaxed[0]
    assert device.glibc_mmap_threshold_set() is None


def test_a_resumed_run_takes_the_checkpoints_batches_without_probing(tmp_path, monkeypatch):
    first = _trainer(tmp_path, max_memory="20MiB")
    first.train()
    resumed = _trainer(tmp_path, max_memory="20MiB")
    resumed.args.max_steps = 3
    resumed._probe = lambda: pytest.fail("probed again")  # noqa: E731
    # under an address-space limit the saved batch trains on the allocator the probed run had
    monkeypatch.setattr(device, "address_space_limit", lambda: 2**40)
    monkeypatch.setattr(device, "return_freed_memory_to_os", lambda: True)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.adaptive_batch == first.adaptive_batch and resumed.state.global_step == 3
    assert resumed.lines[0].startswith("CPU allocator: glibc M_MMAP_THRESHOLD")
    assert resumed.lines[1].startswith("adaptive-batch (from the checkpoint")
    # asked for another batch or budget, a resume would train the checkpoint's: refused before any step
    for changed, key in (({"per_device": 8}, "effective batch"), ({"max_memory": "24MiB"}, "max_memory"),
                         ({"max_batch_size": 4}, "max_batch_size")):
        other = _trainer(tmp_path, **{"max_memory": "20MiB", **changed})
        with pytest.raises(ConfigError, match=rf"resume_from_checkpoint=.*checkpoint-3: it trained {key}.* this Trainer "
                           r"asks for .*put it back to resume that run, or train from the start in another output_dir"):
            other.train(resume_from_checkpoint=True)
        assert other.state.global_step == 0


def _padded_to_64(samples):
    batch = ByteCollator()(samples + [{"input_ids": [1] * 64}])
    return {key: value[:-1] for key, value in batch.items()}


def test_a_resume_on_another_step_probes_its_micro_batches_again(tmp_path):
    """Resumed with a collator padding every batch to 128, the checkpoint's micro-batch trained at
    10.3 MiB of a 6 MiB budget: what it was probed on is kept, and where it changed the same
    effective batch is split anew."""
    first = _trainer(tmp_path, max_memory="20MiB", probe_eval=False)
    first.train()
    resumed = _trainer(tmp_path, max_memory="20MiB", probe_eval=False, training={"max_steps": 3})
    resumed.data_collator = _padded_to_64
    resumed.train(resume_from_checkpoint=True)
    said = [line for line in resumed.lines if line.startswith("adaptive-batch (from the checkpoint")]
    assert said and "its micro-batches probed again: the longest sample's batch changed since" in said[0]
    assert any(line.startswith("probe trial") for line in resumed.lines)
    assert resumed.adaptive_batch["effective_batch_size"] == 16 and resumed.state.global_step == 3
    assert resumed.adaptive_batch["probed_step"] != first.adaptive_batch["probed_step"]


def test_the_micro_batched_run_trains_what_the_whole_batch_run_trains(tmp_path):
    probed = _trainer(tmp_path / "a", max_memory="20MiB", probe_eval=False)
    probed.train()
    assert probed.adaptive_batch["gradient_accumulation_steps"] > 1
    plain = _trainer(tmp_path / "b", max_memory="20MiB", probe_eval=False)
    plain._probe = lambda: {"effective_batch_size": 16, "max_micro_batch_size": 16,  # noqa: E731
                            "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1}
    plain.train()
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(probed) == pytest.approx(losses(plain), rel=1e-4)


class MeanLossLM(torch.nn.Module):
    """A causal LM whose forward takes no loss keyword arguments: ``Trainer`` then divides each
    micro-batch's mean loss by the micro-batches of its step, weighing every micro-batch the same."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(512, 32), torch.nn.Linear(32, 512)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("model", ["weighted by tokens", "mean loss"])
def test_uneven_micro_batches_train_what_the_whole_batch_trains(tmp_path, model):
    """16 samples a step where 6 fit: 6 + 5 + 5 (equal micro-batches would take 8 x 2), the same
    samples in the same order as a plain Trainer's batch of 16, and the same training. With a
    model that takes no loss keywords each micro-batch's loss is weighted by its rows (unweighted,
    a sample of a micro-batch of 5 weighed 6/5 of one in the micro-batch of 6)."""
    from transformers import Trainer

    def build(cls, out, **kwargs):
        torch.manual_seed(0)
        if model == "mean loss":
            net = MeanLossLM()
            samples = [{"input_ids": s["input_ids"][:8]} for s in _samples(64)]  # one length: a token mean is a sample mean
        else:
            net = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
            samples = _samples(64)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=16, max_steps=3, learning_rate=1e-2,
                                 report_to=[], use_cpu=True, seed=0, data_seed=0, logging_steps=1, disable_tqdm=True,
                                 save_strategy="no")
        return cls(model=net, args=args, train_dataset=samples, data_collator=ByteCollator(), **kwargs)

    uneven = build(AdaptiveBatchTrainer, tmp_path / "a", max_batch_size=6, probe_eval=False)
    uneven.train()
    state = uneven.adaptive_batch
    assert (state["per_device_train_batch_size"], state["gradient_accumulation_steps"]) == (6, 3)
    assert uneven._update_rows == [6, 5, 5]
    steps = [h for h in uneven.state.log_history if "loss" in h]
    assert [(h["batch_size"], h["micro_batch_size"]) for h in steps] == [(16, 6)] * 3
    whole = build(Trainer, tmp_path / "b")
    whole.train()
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(uneven) == pytest.approx(losses(whole), rel=1e-5)
    for a, b in zip(uneven.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-4)  # Adam magnifies a rounding in a rare token's row


CONSTANT_LR = {"lr_scheduler_type": "constant"}  # a run of 2 steps and one of 3 share their LRs


def test_uneven_micro_batches_resume_where_the_stopped_run_was(tmp_path):
    """Resuming, the Trainer skips the steps' micro-batches by count: they must be the same
    micro-batches, so step 3 after a resume trains what step 3 of the whole run trained."""
    whole = _trainer(tmp_path / "whole", max_batch_size=6, probe_eval=False, training=CONSTANT_LR)
    whole.args.max_steps = 3
    whole.train()
    assert whole._update_rows == [6, 5, 5]
    _trainer(tmp_path / "stopped", max_batch_size=6, probe_eval=False, training=CONSTANT_LR).train()  # 2 steps, checkpoint-2
    resumed = _trainer(tmp_path / "stopped", max_batch_size=6, probe_eval=False, training=CONSTANT_LR)
    resumed.args.max_steps = 3
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and resumed.adaptive_batch == whole.adaptive_batch
    last = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h][-1]  # noqa: E731
    assert last(resumed) == pytest.approx(last(whole), rel=1e-5)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-4)


def test_uneven_micro_batches_resumed_where_they_cannot_run_train_as_equal_ones(tmp_path, monkeypatch):
    """A checkpoint of 6 + 5 + 5 resumed under several processes, whose batches Accelerate shards
    by count: the same effective batch in the fewest equal micro-batches that fit."""
    import adaptive_batch.hf.trainer as hf_trainer

    trainer = _trainer(tmp_path)
    monkeypatch.setattr(hf_trainer, "uneven_allowed", lambda t: False)
    from adaptive_batch.logs import lines_to

    with lines_to(trainer.lines.append):
        trainer._apply({"effective_batch_size": 16, "max_micro_batch_size": 6, "per_device_train_batch_size": 6,
                        "gradient_accumulation_steps": 3}, "from a checkpoint")
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    assert not trainer._uneven() and "trains as 4 x 4 per device" in trainer.lines[-1]


def test_a_second_train_does_not_weigh_its_trials_by_the_last_runs_step(tmp_path):
    """The rows of the last run's last step were read by the next train()'s trials: a trial's
    loss scaled by up to 40x (and, under fp16, a skipped optimizer step the probe did not measure)."""
    trainer = _trainer(tmp_path)
    trainer.adaptive_batch = {"effective_batch_size": 16, "max_micro_batch_size": 6, "per_device_train_batch_size": 6,
                              "gradient_accumulation_steps": 3}
    trainer._update_rows = [6, 5, 1]
    seen = []

    def probe():
        seen.append(list(trainer._update_rows))
        raise RuntimeError("stop after the probe started")

    trainer._probe = probe
    with pytest.raises(RuntimeError, match="stop after"):
        trainer.train()
    assert seen == [[]]


def test_a_second_train_probes_and_trains_again(tmp_path):
    """The first train() leaves the optimizer wrapped by Accelerate, which has no step hooks for
    the probe's tracker: a second train() failed in its probe, where a plain Trainer trains twice."""
    trainer = _trainer(tmp_path, max_memory="20MiB", probe_eval=False, training={"save_strategy": "no"})
    trainer.train()
    trainer.train()
    probes = [line for line in trainer.lines if line.startswith("adaptive-batch (probed)")]
    assert len(probes) == 2 and probes[0] == probes[1] and trainer.state.global_step == 2


def test_a_max_batch_size_under_one_is_refused_before_the_model_is_touched(tmp_path):
    with pytest.raises(ConfigError, match="max_batch_size=0 must be a positive integer"):
        _trainer(tmp_path, max_batch_size=0)
    # "false" from a config file was taken as true: the evaluation batch probed and changed
    with pytest.raises(ConfigError, match="probe_eval='false' must be true or false: set probe_eval=True or "
                       "probe_eval=False"):
        _trainer(tmp_path, probe_eval="false")


def test_a_global_batch_sets_the_step_whatever_the_per_device_batch(tmp_path):
    """global_batch_size=16 with per_device_train_batch_size=4 (the Trainer's default is 8): the
    step trains 16 samples, in the fewest micro-batches that fit."""
    trainer = _trainer(tmp_path, per_device=4, global_batch_size=16, max_batch_size=6, probe_eval=False)
    trainer.train()
    state = trainer.adaptive_batch
    assert state["effective_batch_size"] == 16 and trainer._update_rows == [6, 5, 5]
    assert [h["batch_size"] for h in trainer.state.log_history if "loss" in h] == [16, 16]
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 with global_batch_size=16: .* set "
                       "gradient_accumulation_steps=1"):
        _trainer(tmp_path, accumulation=2, global_batch_size=16)
    with pytest.raises(ConfigError, match="global_batch_size=0 must be a positive integer"):
        _trainer(tmp_path, global_batch_size=0)


def _fixed_length_trainer(cls, out, per_device, accumulation, training=None, padded=False, **kwargs):
    """Every sample 64 tokens long (``padded``: every other one 63), so the Trainer's own batches
    are the probe's worst case."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(1, 512, (64 - (padded and i % 2),), generator=generator).tolist()}
               for i in range(64)]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accumulation, max_steps=2, learning_rate=1e-3, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no",
                             **(training or {}))
    return cls(model=LlamaForCausalLM(config), args=args, train_dataset=samples, data_collator=ByteCollator(), **kwargs)


def memtracker_peak(trainer_class, build):
    """The peak torch's MemTracker measures over the training of ``build(cls)``, where ``cls`` is
    ``trainer_class`` with MemTracker's module statistics reset at each ``training_step`` (it
    measures one forward at a time)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()

    class Tracked(trainer_class):
        def training_step(self, *args, **kwargs):
            tracker.reset_mod_stats()
            return super().training_step(*args, **kwargs)

    trainer = build(Tracked)
    tracker.track_external(trainer.model)
    with tracker:
        trainer.train()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("padded", [False, True], ids=["same-length", "padded"])
def test_under_accumulation_the_answer_is_memtrackers_on_the_trainers_own_loop(tmp_path, padded):
    """The trial is the Trainer's step: two micro-batches through training_step with the first
    one's gradients alive, then the optimizer step. A trial that dropped the gradients after each
    micro-batch answered 12 here, which torch's MemTracker puts over the budget in the Trainer's
    own accumulated loop; the answer fits there and one more does not. Where samples differ in
    length the Trainer's batches are padded and take an attention mask: trials on the longest
    sample repeated (never padded) answered 11, over the budget on the padded batches."""
    from transformers import Trainer

    def trainer_peak(micro_batch):
        out = tmp_path / f"plain{micro_batch}"
        return memtracker_peak(Trainer, lambda cls: _fixed_length_trainer(cls, out, micro_batch, 2, padded=padded))

    lines = []
    probed = _fixed_length_trainer(AdaptiveBatchTrainer, tmp_path / "probed", 16, 2, padded=padded,
                                   max_memory="24MiB", probe_eval=False, log=lines.append)
    probed.train()
    found = probed.adaptive_batch["max_micro_batch_size"]
    trials = [line for line in lines if line.startswith("probe trial")]
    assert len(trials) <= 6 and sum(" fits" not in line for line in trials) <= 1, trials
    budget = int(24 * 2**20 * 0.99)
    assert trainer_peak(found) <= budget < trainer_peak(found + 1)


def test_a_gpt2_mean_loss_split_weighs_its_micro_batches_by_the_labels_it_shifts(tmp_path):
    """GPT-2's LM head has no loss type the Trainer reads, so its labels were counted unshifted:
    a compute_loss_func's mean over the shifted labels, split 4 + 3 + 3, weighed each micro-batch
    by a label a row too many and moved the parameters by 3e-3 from the whole batch's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def shifted_mean(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    def run(trainer_class, out, **kwargs):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=512, n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=10, max_steps=1, optim="sgd",
                                 learning_rate=0.5, max_grad_norm=0.0, report_to=[], use_cpu=True, disable_tqdm=True,
                                 save_strategy="no", logging_strategy="no")
        trainer = trainer_class(model=GPT2LMHeadModel(config), args=args, train_dataset=_samples(10),
                                data_collator=ByteCollator(), compute_loss_func=shifted_mean, **kwargs)
        trainer.train()
        return trainer

    whole = run(Trainer, tmp_path / "whole")
    split = run(AdaptiveBatchTrainer, tmp_path / "split", max_batch_size=4, probe_eval=False)
    assert split._update_rows == [4, 3, 3]
    for a, b in zip(split.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _ImageClassifier(torch.nn.Module):
    """A conv net whose inputs (3 x 64 x 64 images) weigh more than its activations."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, pixel_values, labels=None):
        logits = self.head(torch.relu(self.conv(pixel_values)).mean((2, 3)))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_an_input_heavy_answer_holds_the_inputs_the_trainers_loop_holds(tmp_path):
    """The Trainer fetches every micro-batch of a step before its first forward, the next step's
    while its list still holds these, and Accelerate's loader keeps one more: a trial that held
    its one micro-batch answered 112 for a step of 112 images under 16 MiB, which the Trainer
    trained at 21 MiB. The trial at a micro-batch is now MemTracker's on the Trainer's own loop."""
    from transformers import Trainer
    from transformers.data.data_collator import default_data_collator

    from adaptive_batch.probe.trials import measure_training_step

    generator = torch.Generator().manual_seed(0)
    images = [{"pixel_values": torch.randn(3, 64, 64, generator=generator), "labels": i % 4} for i in range(448)]

    def build(cls, per_device, accumulation, **kwargs):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=per_device,
                                 gradient_accumulation_steps=accumulation, max_steps=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True, save_strategy="no", logging_strategy="no")
        return cls(model=_ImageClassifier(), args=args, train_dataset=images, **kwargs)

    probed = build(AdaptiveBatchTrainer, 112, 1, max_memory="16MiB", probe_eval=False)
    probed.train()
    state = probed.adaptive_batch
    assert state["gradient_accumulation_steps"] > 1
    trained = memtracker_peak(Trainer, lambda cls: build(
        cls, state["per_device_train_batch_size"], state["gradient_accumulation_steps"]))
    assert trained <= 16 * 2**20 * 0.99, (state, trained)
    # the trial at 56 of a step of 112 against the Trainer's own 56 x 2
    trial = build(AdaptiveBatchTrainer, 112, 1, probe_eval=False)
    trial.create_optimizer()
    make_batch = lambda b: default_data_collator([images[0]] * b)  # noqa: E731
    step = measure_training_step(trial.trial_target(make_batch).on_its_device(), make_batch(56))
    assert max(step.phase_peak_bytes.values()) == pytest.approx(
        memtracker_peak(Trainer, lambda cls: build(cls, 56, 2)), rel=0.01)
    # a budget the step's images alone pass: said, beside batch 1's line
    from adaptive_batch import BatchSizeTooLargeError

    with pytest.raises(BatchSizeTooLargeError, match=r"batch size 1 does not fit: .* Beside it the Trainer's step "
                       r"holds the inputs of 224 more samples \(10.50 MiB\): .* a smaller effective batch"):
        build(AdaptiveBatchTrainer, 112, 1, max_memory="8MiB", probe_eval=False).train()


def test_the_trials_train_the_model_train_prepares(tmp_path):
    """train() turns activation checkpointing on before its loop. The probe ran before train() and
    measured the model without it: 11, where the checkpointed step fits 23. (TRL's SFTConfig turns
    it on by default: test_trl.py holds that answer to MemTracker's on SFT's own loop.)"""
    checkpointed_in_trials = []

    class Recording(AdaptiveBatchTrainer):
        def _train_step(self, batch):
            checkpointed_in_trials.append(self.model.is_activation_checkpointing)
            return super()._train_step(batch)

    def found(cls, out, training=None):
        trainer = _fixed_length_trainer(cls, tmp_path / out, 16, 2, training, max_memory="24MiB", probe_eval=False)
        trainer.train()
        return trainer.adaptive_batch["max_micro_batch_size"]

    plain = found(AdaptiveBatchTrainer, "plain")
    checkpointed = found(Recording, "checkpointed", {"activation_checkpointing": True})
    assert checkpointed_in_trials and all(checkpointed_in_trials)
    assert checkpointed > 1.5 * plain, (plain, checkpointed)


def test_in_mixed_precision_the_trials_forward_runs_as_the_trainers_own(tmp_path):
    """Accelerate wraps the forward in autocast (its outputs cast to fp32) when train() prepares
    the model, after the probe. Without the same wrap the probe's bf16 trials ran in fp32: on an
    H200 they measured 1.84 GiB at 16 where the Trainer's own steps took 1.37 GiB."""
    from transformers import TrainerCallback

    trainer = _trainer(tmp_path, max_memory="20MiB", training={"bf16": True})
    seen = {"probe": set(), "training": set()}
    phase = ["probe"]

    def inside(module, args, output):  # under the forward's autocast, if any
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        seen[phase[0]].add(("lm_head", autocast, output.dtype))

    def outside(module, args, output):  # what the caller gets back
        seen[phase[0]].add(("logits", output.logits.dtype))

    class Training(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            phase[0] = "training"

    trainer.model.lm_head.register_forward_hook(inside)
    trainer.model.register_forward_hook(outside)
    trainer.add_callback(Training())
    trainer.train()
    assert any(line.startswith("probe trial") for line in trainer.lines)
    expected = {("lm_head", torch.bfloat16, torch.bfloat16), ("logits", torch.float32)}
    assert seen["probe"] == seen["training"] == expected, seen
    # The probe's wrap is gone before train() prepares the model: accelerate wrapped the model's own forward.
    assert trainer.model._original_forward.__func__ is type(trainer.model).forward


def test_the_evaluation_trial_runs_in_eval_mode_after_the_training_trials(tmp_path):
    """The training trials leave the model in train mode; the evaluation loop runs it in eval
    mode (dropout off, BatchNorm's statistics untouched), and so must its trial."""
    trainer = _trainer(tmp_path, max_memory="20MiB")
    trainer.create_optimizer()
    batch = trainer.data_collator(_samples(2))
    trainer._train_step(batch)
    assert trainer.model.training
    trainer._eval_step(batch)
    assert not trainer.model.training


def test_a_bad_budget_is_one_line_before_the_model_is_touched(tmp_path):
    with pytest.raises(ConfigError, match="max_memory='lots' cannot be parsed"):
        _trainer(tmp_path, max_memory="lots")


def test_samples_the_worst_case_cannot_be_made_from_are_one_line_before_any_trial(tmp_path):
    trainer = _trainer(tmp_path, max_memory="20MiB")
    # fields the collator does not read: training's batches would fail the same way
    trainer.train_dataset = [{"tokens": s["input_ids"]} for s in _samples(8)]
    with pytest.raises(ConfigError, match=r"the data collator could not collate the longest training sample "
                                          r"\(KeyError: 'input_ids'\).* pass make_batch=f"):
        trainer.train()
    trainer.train_dataset = [{"text": "no tokens"}] * 8  # nothing to size
    with pytest.raises(ConfigError, match=r"fields \['text'\] hold no sequence or tensor: pass make_batch=f"):
        trainer.train()
    trainer.train_dataset = [{"input_ids": [], "labels": []}] * 8
    with pytest.raises(ConfigError, match=r"the training samples have no tokens or values .* drop the empty samples"):
        trainer.train()
    # a make_batch of something else: a bare ValueError once named keys the Trainer does not take
    for made, got in (("junk", "a str with no tensor with a dimension of samples"),
                      ({"input_ids": torch.zeros(3, 8, dtype=torch.long)}, "a dict with 3 rows")):
        trainer._make_batch = lambda b, made=made: made
        with pytest.raises(ConfigError, match=f"make_batch: make_batch\\(2\\) returned {got}: it must return the "
                                              "collated batch of the b samples"):
            trainer.train()

    def its_own_error(b):
        raise ValueError("no such shard")

    trainer._make_batch = its_own_error  # its own error (it was lost to an UnboundLocalError)
    with pytest.raises(ValueError, match="no such shard"):
        trainer.train()
    assert not any(line.startswith("probe trial") for line in trainer.lines)


def test_the_worst_case_pads_every_field_to_its_longest_and_skips_columns_the_model_does_not_take(tmp_path):
    """A seq2seq sample's longest input is not its longest target: both are in the worst case, so
    the collator pads each field to its longest (by input_ids alone, the probe answered 64 and
    training ran out of memory at once). The Trainer drops the columns the model's forward does not
    take before collating; so does the worst case (a text column once crashed the probe)."""
    from adaptive_batch.data.worst_case import RepeatedSample

    trainer = _trainer(tmp_path)
    long_input = {"input_ids": list(range(1, 60)), "labels": [1, 2], "text": "a long question"}
    long_target = {"input_ids": [1, 2, 3], "labels": list(range(1, 50)), "text": "a short one"}
    dataset, collate = trainer._as_the_loader_takes([long_input, long_target] * 4)

    class PadBoth:  # pads inputs and labels each to its own longest
        def __call__(self, samples):
            assert all("text" not in s for s in samples)
            width = {key: max(len(s[key]) for s in samples) for key in ("input_ids", "labels")}
            return {key: torch.tensor([s[key] + [0] * (width[key] - len(s[key])) for s in samples]) for key in width}

    collate.data_collator = PadBoth()
    batch = RepeatedSample.longest(dataset, collate)(3)
    assert batch["input_ids"].shape == (3, 59) and batch["labels"].shape == (3, 49)
    assert RepeatedSample.longest(dataset, collate)(1)["input_ids"].shape == (1, 59)  # the larger of the two


RANKS_SCRIPT = '''
import json, os, sys
sys.path.insert(0, os.environ["TEST_DIR"])
import torch.distributed as dist
from test_trainer import _trainer

rank, seen = int(os.environ["RANK"]), []


def double_after_the_first(epoch, current_batch_size):
    seen.append(current_batch_size)
    return 0 if epoch == 0 else current_batch_size


# 64 samples, 32 a rank: 2 steps of 16 a rank at epoch 0, 1 of 32 at epoch 1
trainer = _trainer(os.environ["OUT"], max_memory=["40MiB", "20MiB"][rank], probe_eval=False,
                   batch_increase_function=double_after_the_first, lr_scaling="linear",
                   training={"max_steps": -1, "num_train_epochs": 2, "save_strategy": "no", "lr_scheduler_type": "constant"})
trainer.train()
fits = [int(line.split("batch_size=")[1].split()[0]) for line in trainer.lines if line.startswith("probe trial") and " fits" in line]
steps = [[h["batch_size"], h["learning_rate"]] for h in trainer.state.log_history if "loss" in h]
params = [p.detach().sum().item() for p in trainer.model.parameters()][:4]
# one file per rank: two ranks printing to one pipe can interleave their lines
os.makedirs(os.environ["OUT"], exist_ok=True)
with open(os.path.join(os.environ["OUT"], f"result{rank}.json"), "w") as f:
    json.dump([str(rank), str(dist.get_world_size()), max(fits), trainer.adaptive_batch, seen, steps, params], f)
# gloo's worker threads can abort a finished rank in the interpreter's teardown (SIGABRT,
# "terminate called without an active exception"): end as docs/library.md tells users to
dist.destroy_process_group()
from adaptive_batch.distributed import exit_past_teardown
exit_past_teardown(0)
'''


@pytest.mark.slow
def test_two_ranks_on_gloo_take_the_smaller_ranks_batch(tmp_path):
    """torchrun with 2 CPU processes, one budget each: both train the batch that fits the smaller,
    and grow it together: the function sees the batch over both ranks, the LR follows it, and the
    ranks stay one model."""
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = dict(os.environ, TEST_DIR=str(Path(__file__).parent), OUT=str(tmp_path / "out"),
               PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    run = subprocess.run([torchrun, "--nproc_per_node", "2", str(script)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((tmp_path / "out" / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert [result[:2] for result in results] == [["0", "2"], ["1", "2"]]
    (own0, first, seen, steps, params), (own1, second, *other) = [result[2:] for result in results]
    assert first == second and other == [seen, steps, pytest.approx(params)]  # the same batches, one model
    # the 40 MiB rank fitted more on its own; both train what the 20 MiB rank's probe answered
    assert own0 > first["max_micro_batch_size"] and first["max_micro_batch_size"] <= own1
    # 16 a rank (32 in all) at epoch 0, doubled over both ranks at epoch 1, the LR with it
    assert seen == [32, 32] and steps == [[32, 1e-3], [32, 1e-3], [64, 2e-3]]
    assert first["per_device_train_batch_size"] * first["gradient_accumulation_steps"] == 32


LIMIT_SCRIPT = '''
import json, os, resource, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from adaptive_batch.hf import AdaptiveBatchTrainer
from adaptive_batch.memory.device import proc_status_bytes, return_freed_memory_to_os

if __name__ == "__main__":  # the probe's trial processes import this script
    mode, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    samples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 8192, (64, 256))]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=3,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no")
    resource.setrlimit(resource.RLIMIT_AS, (proc_status_bytes("VmSize") + 256 * 2**20, resource.RLIM_INFINITY))
    if mode == "probe":
        lines = []
        trainer = AdaptiveBatchTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=samples, log=lines.append)
        trainer.train()  # the probe, then 3 steps at its answer in the process that probed
        trials = [line for line in lines if line.startswith("probe trial")]
        print("RESULT", json.dumps({"found": trainer.adaptive_batch["max_micro_batch_size"],
                                    "in_fresh_processes": any("in a fresh process" in line for line in lines)
                                    and not any("the trials run in this process" in line for line in lines),
                                    "oom_trials": sum("out of memory" in line for line in trials)}))
    else:
        # what the probed run trains: its effective batch in accumulated micro-batches
        args.gradient_accumulation_steps = 2
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=samples)
        return_freed_memory_to_os()  # the allocator the probed run trains with, set where it sets it
        try:
            trainer.train()
            print("RESULT", json.dumps({"trains": True}))
        except RuntimeError as e:
            assert "can't allocate memory" in str(e), e
            print("RESULT", json.dumps({"trains": False}))
'''


@pytest.mark.slow
def test_under_a_real_limit_it_finds_the_true_maximum(tmp_path):
    """Under 256 MiB of address space over the process (as ``prlimit --as`` gives), trials in
    fresh processes find the micro-batch that trains 3 accumulated steps (as the effective batch
    of 8 is trained) in the process that probed, and one more does not train in a fresh process,
    with at most one out-of-memory trial. The truth was a step of one micro-batch until the trial became
    the Trainer's accumulated step; on a larger model the probing process, its heap grown by the
    probe, once failed in training the answer fresh processes train."""
    import subprocess
    import sys

    script = tmp_path / "limit.py"
    script.write_text(LIMIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))

    def run(mode, batch):
        proc = subprocess.run([sys.executable, str(script), mode, str(batch), str(tmp_path / f"{mode}{batch}")],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.split("RESULT ", 1)[1])

    probed = run("probe", 8)
    found = probed["found"]
    assert probed["in_fresh_processes"], probed
    assert 1 < found < 8 and probed["oom_trials"] <= 1, probed
    # the probing process trained the answer (its heap is the probe's, not a fresh one's); one more
    # does not train in a fresh process
    assert not run("fresh", found + 1)["trains"], found


def test_a_budget_under_batch_one_names_the_trainers_own_fix(tmp_path):
    """The fix once named only torchtune's tokenizer.max_seq_len to a Hugging Face user."""
    from adaptive_batch import BatchSizeTooLargeError

    trainer = _trainer(tmp_path, max_memory="1MiB")
    with pytest.raises(BatchSizeTooLargeError, match=r"batch size 1 does not fit: .* Raise max_memory, shorten the "
                       r"longest sample \(.*the tokenizer's max_length with Hugging Face\)"):
        trainer.train()


def test_a_search_that_sets_the_micro_batch_probes_its_own_effective_batch(tmp_path, monkeypatch):
    """A hyperparameter search (a model_init, a model each trial) sets only what it searches: its
    trial's per-device batch once met the accumulation the last probe applied (8 x 4 = 32 where
    8 x 1 was asked)."""
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=1, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no")
    trainer = AdaptiveBatchTrainer(model_init=lambda: LlamaForCausalLM(config), args=args, train_dataset=_samples(64),
                                   data_collator=ByteCollator(), max_memory="20MiB", probe_eval=False)
    trainer.train()
    assert trainer.args.gradient_accumulation_steps > 1

    def a_trial_searching_the_micro_batch(trial):
        trainer.args.per_device_train_batch_size = 8  # as Trainer._hp_search_setup sets a searched key

    monkeypatch.setattr(trainer, "_hp_search_setup", a_trial_searching_the_micro_batch)
    trainer.train()
    assert trainer.adaptive_batch["effective_batch_size"] == 8


def test_a_failed_probe_leaves_the_trainer_as_train_found_it(tmp_path):
    """The probe runs inside train(), after NEFTune's hook is attached: a probe that failed left
    it attached, and the next train() on the same trainer attached a second (twice the noise)."""
    from adaptive_batch import BatchSizeTooLargeError

    trainer = _trainer(tmp_path, max_memory="1MiB", probe_eval=False, training={"neftune_noise_alpha": 5.0})
    embeddings = trainer.model.get_input_embeddings()
    with pytest.raises(BatchSizeTooLargeError):
        trainer.train()
    assert len(embeddings._forward_hooks) == 0 and not trainer.is_in_train
    trainer.max_memory = "20MiB"
    trainer.train()
    assert trainer.state.global_step == 2 and len(embeddings._forward_hooks) == 0  # train() removes its one hook


def test_what_would_change_or_shard_the_probed_batch_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="auto_find_batch_size=True with AdaptiveBatchTrainer: .* set auto_find_batch_size=False"):
        _trainer(tmp_path, training={"auto_find_batch_size": True})
    trainer = _trainer(tmp_path)
    for name in ("deepspeed", "fsdp"):
        flag = f"is_{name}_enabled"
        setattr(trainer, flag, True)
        with pytest.raises(ConfigError, match=f"{name} with AdaptiveBatchTrainer: .* remove {name} from TrainingArguments"):
            refuse_what_changes_the_batch(trainer)
        setattr(trainer, flag, False)


def test_group_by_length_groups_the_effective_batch_it_trains(tmp_path):
    trainer = _trainer(tmp_path, per_device=16, max_batch_size=6, probe_eval=False,
                       training={"train_sampling_strategy": "group_by_length"})
    trainer.train()
    state = trainer.adaptive_batch
    assert state["gradient_accumulation_steps"] == 3 and trainer.state.global_step == 2
    loader = trainer.get_train_dataloader()  # as train() built it: batches of 16 split 6 + 5 + 5
    batches = getattr(loader, "base_dataloader", loader).batch_sampler.batch_sampler
    from transformers.trainer_pt_utils import LengthGroupedSampler

    assert isinstance(batches.sampler, LengthGroupedSampler) and batches.sampler.batch_size == 16  # the user's batch
    assert [len(b) for b in list(getattr(loader, "base_dataloader", loader).batch_sampler)[:3]] == [6, 5, 5]


def _classifier_run(tmp_path, trainer_class, **kwargs):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    generator = torch.Generator().manual_seed(1)
    samples = [{"input_ids": ids.tolist(), "labels": int(label)}
               for ids, label in zip(torch.randint(1, 128, (8, 12), generator=generator),
                                     torch.randint(0, 3, (8,), generator=generator))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, optim="sgd",
                             learning_rate=0.5, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                             logging_steps=1)
    trainer = trainer_class(model=BertForSequenceClassification(config), args=args, train_dataset=samples, **kwargs)
    trainer.train()
    return trainer


def test_a_loss_that_ignores_the_item_count_is_averaged_over_the_micro_batches(tmp_path):
    """BERT's classification loss is a mean that ignores num_items_in_batch, though its forward
    takes **kwargs: split into 3 + 3 + 2, the Trainer added the three means up, a step of about
    twice the batch's gradient and loss. Averaged, the step is the whole batch's."""
    from transformers import Trainer

    whole = _classifier_run(tmp_path / "whole", Trainer)
    lines = []
    split = _classifier_run(tmp_path / "split", AdaptiveBatchTrainer, max_batch_size=3, probe_eval=False,
                            log=lines.append)
    assert split.adaptive_batch["gradient_accumulation_steps"] == 3
    assert any("BertForSequenceClassification's loss ignores num_items_in_batch" in line for line in lines)
    for a, b in zip(split.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    losses = [h["loss"] for t in (split, whole) for h in t.state.log_history if "loss" in h]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


class _MeanLossTrainer(Trainer):
    """A user's trainer whose compute_loss is a plain mean (the common override), on a model whose
    forward takes **kwargs, from which the Trainer infers the loss reads num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits, labels = outputs.logits[:, :-1], inputs["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return (loss, outputs) if return_outputs else loss


class _AdaptiveMeanLossTrainer(AdaptiveBatchTrainer, _MeanLossTrainer):
    pass


class _MeanLossMixin:
    compute_loss = _MeanLossTrainer.compute_loss


class _MixedInMeanLossTrainer(_MeanLossMixin, AdaptiveBatchTrainer):
    pass


class _SubclassMeanLossTrainer(AdaptiveBatchTrainer):
    compute_loss = _MeanLossTrainer.compute_loss


class _SuperCallingSubclass(_SubclassMeanLossTrainer):
    """An override over an override, reaching it through super(): weighed once, not twice."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("composed, owner", [
    (_AdaptiveMeanLossTrainer, "_MeanLossTrainer"), (_MixedInMeanLossTrainer, "_MeanLossMixin"),
    (_SubclassMeanLossTrainer, "_SubclassMeanLossTrainer"), (_SuperCallingSubclass, "_SuperCallingSubclass"),
], ids=["a-trainer-after", "a-mixin-before", "a-subclass", "a-subclass-calling-super"])
def test_a_trainers_own_compute_loss_that_ignores_the_item_count_is_averaged_over_the_micro_batches(
        tmp_path, composed, owner):
    """Split 3 + 3 + 2, a compute_loss override returning a mean took 3 times the batch's gradient:
    only the model's loss and compute_loss_func were asked whether they read the count. Then the
    override of a subclass or of a mixin before AdaptiveBatchTrainer shadowed its weighting: the
    mixin's means were added up undivided (3 times the gradient), the subclass's weighed alike
    (the log said otherwise)."""

    def run(trainer_class, out, **kwargs):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
        samples = [{"input_ids": ids, "labels": ids} for ids in tokens]
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=1, optim="sgd",
                                 learning_rate=0.5, max_grad_norm=0.0, report_to=[], use_cpu=True, disable_tqdm=True,
                                 save_strategy="no", logging_steps=1)
        trainer = trainer_class(model=LlamaForCausalLM(config), args=args, train_dataset=samples, **kwargs)
        trainer.train()
        return trainer

    whole = run(_MeanLossTrainer, tmp_path / "whole")
    lines = []
    split = run(composed, tmp_path / "split", max_batch_size=3, probe_eval=False, log=lines.append)
    assert split.adaptive_batch["gradient_accumulation_steps"] == 3
    assert any(f"{owner}.compute_loss ignores num_items_in_batch" in line for line in lines), lines
    for a, b in zip(split.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("asked", [2, 64])
def test_evaluation_in_training_fits_beside_the_optimizers_state_at_no_more_than_the_batch_asked(tmp_path, asked):
    """The evaluation batch was probed without the optimizer's state, which training holds when
    it evaluates (15.5 MiB of a 12 MiB budget), and up to the whole evaluation set, above the
    batch asked, which moved eval_loss with the budget."""
    from transformers import TrainerCallback

    from adaptive_batch.memory.tracker import LiveTensorCounter

    class EvaluationPeak(TrainerCallback):
        """Live tensor bytes from a step's end through the evaluation after it."""
        counter, peaks = None, []

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                    *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
            self.counter = LiveTensorCounter(held)
            self.counter.__enter__()

        def on_evaluate(self, args, state, control, **kwargs):
            self.counter.__exit__(None, None, None)
            self.peaks.append(self.counter.peak_bytes)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=asked,
                             max_steps=1, eval_strategy="steps", eval_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no")
    peak = EvaluationPeak()
    trainer = AdaptiveBatchTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=_samples(16),
                                   eval_dataset=_samples(256, seed=1), data_collator=ByteCollator(),
                                   max_memory="12MiB", callbacks=[peak])
    trainer.train()
    evaluation = trainer.adaptive_batch["per_device_eval_batch_size"]
    assert 1 <= evaluation <= asked and len(peak.peaks) == 1
    assert peak.peaks[0] <= 0.99 * 12 * 2**20, (evaluation, peak.peaks)


def test_the_callers_training_arguments_are_left_as_they_were(tmp_path):
    """The settled batches were written into the caller's TrainingArguments: a plain Trainer built
    with the same object afterwards trained 18 samples a step where 16 were asked."""
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=1, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no")
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    trainer = AdaptiveBatchTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=_samples(32),
                                   data_collator=ByteCollator(), max_memory="20MiB", probe_eval=False)
    trainer.train()
    assert trainer.args.gradient_accumulation_steps > 1  # the micro-batches it settled on
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 1)


def test_the_evaluation_probes_first_step_trains_2_where_batch_1_cannot(tmp_path, monkeypatch):
    """The step that makes the optimizer's state before the evaluation trials ran at batch 1, which
    a model with BatchNorm refuses: train() failed before the training probe ran."""
    from dataclasses import replace

    from adaptive_batch.data.layout import BatchLayout

    trainer = _trainer(tmp_path, max_memory="20MiB")
    real, rows = trainer.trial_target, []

    def a_target_refusing_1(make_batch):
        target = real(make_batch)

        def step(batch):
            rows.append(BatchLayout().rows(batch))
            if rows == [1]:
                raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8]")
            target.train_step(batch)

        return replace(target, train_step=step)

    monkeypatch.setattr(trainer, "trial_target", a_target_refusing_1)
    trainer.train()
    assert rows[:2] == [1, 2] and trainer.adaptive_batch["per_device_eval_batch_size"] >= 1
