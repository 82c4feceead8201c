"""AdaptiveBatchTrainer composed with TRL's SFTTrainer: the probe's trial is SFT's own step (its
loss, entropy and token accuracy), on the batch its collator makes (padded, or padding-free)."""

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from adaptive_batch.hf import AdaptiveBatchTrainer  # noqa: E402
from tests.adaptive_batch.hf.test_trainer import memtracker_peak  # noqa: E402


class AdaptiveSFTTrainer(AdaptiveBatchTrainer, trl.SFTTrainer):
    """What the docs tell a TRL user to write."""


def letter_tokenizer():
    """A tokenizer of the 26 letters, made here (no download): a character a token."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(ord("a") + i): 3 + i for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft_trainer(cls, out, per_device, sft, **kwargs):
    """Every text 60 letters long, so SFT's own batches are the probe's worst case."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    texts = ["".join(chr(ord("a") + int(c)) for c in torch.randint(0, 26, (60,), generator=generator)) for _ in range(48)]
    config = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
                         max_steps=2, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                         **{"logging_strategy": "no", **sft})
    return cls(model=LlamaForCausalLM(config), args=args, train_dataset=Dataset.from_dict({"text": texts}),
               processing_class=letter_tokenizer(), **kwargs)


@pytest.mark.parametrize("sft", [{"max_length": 64}, {"max_length": None, "padding_free": True}],
                         ids=["padded", "padding-free"])
def test_the_answer_is_memtrackers_on_sfts_own_accumulated_loop(tmp_path, sft):
    def sft_peak(micro_batch):
        out = tmp_path / f"plain{micro_batch}"
        return memtracker_peak(trl.SFTTrainer, lambda cls: sft_trainer(cls, out, micro_batch, sft))

    lines = []
    probed = sft_trainer(AdaptiveSFTTrainer, tmp_path / "probed", 16, sft, max_memory="40MiB", probe_eval=False,
                         log=lines.append)
    probed.train()
    state = probed.adaptive_batch
    found = state["max_micro_batch_size"]
    assert state["per_device_train_batch_size"] * state["gradient_accumulation_steps"] == 32  # the user's batch
    assert probed.state.global_step == 2
    budget = int(40 * 2**20 * 0.99)
    assert sft_peak(found) <= budget < sft_peak(found + 1), found


def test_sfts_logged_token_count_and_metrics_leave_out_the_probes_steps(tmp_path):
    """SFT counts the tokens it trained and averages entropy and token accuracy over the logged
    steps; the probe's trials and checks went through the same compute_loss and were counted."""
    probed = sft_trainer(AdaptiveSFTTrainer, tmp_path, 16, {"max_length": 64, "logging_steps": 1,
                                                           "logging_strategy": "steps"},
                         max_memory="40MiB", probe_eval=False)
    probed.train()
    logged = [h["num_tokens"] for h in probed.state.log_history if "num_tokens" in h]
    # every text is 60 letters and an end-of-sequence token: 32 at the first step, the 16 left of
    # the 48 at the second
    assert logged == [32 * 61, 48 * 61]


def test_sfts_own_init_keeps_the_trials_in_the_training_process_and_says_so(tmp_path):
    from adaptive_batch.data.worst_case import RepeatedSample
    from adaptive_batch.hf.trainer_build import TrainerTrialBuild

    trainer = sft_trainer(AdaptiveSFTTrainer, tmp_path, 16, {"max_length": 64})
    reason = TrainerTrialBuild.of(trainer, RepeatedSample.longest(trainer.train_dataset, trainer.data_collator))
    assert reason.startswith("SFTTrainer has an __init__ of its own")


def test_packing_beside_growth_and_trainers_of_stacked_rows_are_one_line(tmp_path):
    """Packed rows hold many samples: growth counted each as one, never split a step (8 rows in
    one forward where 1 fit) and scaled the LR by rows. DPO and reward batches stack chosen and
    rejected rows: the LR rule counted 8 pairs as 16 samples."""
    from adaptive_batch import ConfigError

    with pytest.raises(ConfigError, match=r"packing=True with batch_increase_function: .* set packing=False"):
        sft_trainer(AdaptiveSFTTrainer, tmp_path, 2, {"max_length": 64, "packing": True},
                    batch_increase_function=lambda k, current_batch_size: current_batch_size)
    for stacked in (trl.DPOTrainer, trl.RewardTrainer):
        composed = type("Composed", (AdaptiveBatchTrainer, stacked), {})
        with pytest.raises(ConfigError, match=rf"{stacked.__name__} with AdaptiveBatchTrainer: .* composes with TRL's SFTTrainer"):
            composed(model=None)
