"""The first guess from fake steps: the real probe's own line, and the answer unchanged."""

import pytest
import torch
from torch import nn
from torchtune.models.llama3_2 import llama3_2

from adaptive_batch.logs import lines_to
from adaptive_batch.memory.budget import training_state_bytes
from adaptive_batch.memory.device import proc_status_bytes
from adaptive_batch.probe.first_guess import GUESS_SOURCE, guess_max_batch_size
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import probe_max_batch_size, worst_case_text_batch

SEQ = 32
CPU = torch.device("cpu")


class MLPLanguageModel(nn.Module):
    """Outside the transformer family: embeddings, a residual MLP with LayerNorm, a head."""

    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.mlp(self.norm(h)))


# Each model with the room past its training state its budget leaves for activations.
MODELS = {
    "llama-vocab128": lambda: llama3_2(vocab_size=128, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=64,
                                       max_seq_len=SEQ),
    "llama-vocab128k": lambda: llama3_2(vocab_size=128_256, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16,
                                        max_seq_len=SEQ),
    "mlp-layernorm": lambda: MLPLanguageModel(vocab=512),
}


HEADROOM_MIB = {"llama-vocab128": 12, "llama-vocab128k": 320, "mlp-layernorm": 12}


def vocab_of(model: nn.Module) -> int:
    return model.vocab if hasattr(model, "vocab") else model.tok_embeddings.num_embeddings


def forward_backward(model: nn.Module, batch: dict) -> None:
    logits = model(batch["tokens"])
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).backward()


def build_optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def real_target(build) -> ProbeTarget:
    torch.manual_seed(0)
    model = build()
    optimizer = build_optimizer(list(model.parameters()))

    def train_step(batch):
        forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    make_batch = lambda b: worst_case_text_batch(b, seq_len=SEQ, vocab_size=vocab_of(model), device=CPU)  # noqa: E731
    return ProbeTarget(train_step, make_batch, model, optimizer, CPU)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_guess_is_the_answer_and_the_search_from_it_finds_the_same_in_four_steps(name, tmp_path):
    """The fake steps' line per operator predicts what real trials find, and starting from it
    the search ends at the same answer, with the size above it tried, in at most 4 real steps."""
    build = MODELS[name]
    target = real_target(build)
    budget = training_state_bytes(target.model, target.optimizer) * 3 + HEADROOM_MIB[name] * 2**20
    plain = probe_max_batch_size(target, budget_bytes=budget, snapshot_dir=str(tmp_path))
    assert plain.max_batch_size >= 4, plain.max_batch_size  # a search with room to be wrong

    guess = guess_max_batch_size(build_model=build, build_optimizer=build_optimizer, forward_backward=forward_backward,
                                 seq_len=SEQ, budget_bytes=budget)
    assert guess is not None and guess.source == GUESS_SOURCE and guess.seconds > 0
    assert abs(guess.batch_size - plain.max_batch_size) <= 1, (guess.batch_size, plain.max_batch_size)

    guided = probe_max_batch_size(target, budget_bytes=budget, snapshot_dir=str(tmp_path), first_guess=guess)
    assert guided.max_batch_size == plain.max_batch_size
    # the warmup at batch 2 (checked against the fake step there), the guess, its neighbour
    assert guided.num_trials <= 4 and [(t.batch_size, t.phase) for t in guided.trials][:2] == [
        (2, "warmup"), (guess.batch_size, "guess")]
    assert any(t.batch_size == guided.max_batch_size + 1 and not t.fits for t in guided.trials)
    assert not any(t.phase == "estimate" for t in guided.trials)
    assert guided.total_seconds >= guess.seconds and guided.first_guess == guess.record(held=True)


def test_the_guess_allocates_nothing_for_a_model_larger_than_this_machine():
    """Fake steps of a model whose step needs far more than the process could hold."""
    huge = lambda: llama3_2(vocab_size=128_256, num_layers=2, num_heads=8, num_kv_heads=2, embed_dim=4096,  # noqa: E731
                            max_seq_len=SEQ)
    before = proc_status_bytes("VmRSS")
    guess = guess_max_batch_size(build_model=huge, build_optimizer=build_optimizer, forward_backward=forward_backward,
                                 seq_len=SEQ, budget_bytes=80 * 2**30)
    assert guess is not None and guess.batch_size > 1
    assert proc_status_bytes("VmRSS") - before < 512 * 2**20  # its weights alone would be 4 GiB


def test_no_guess_where_batch_two_is_already_over_the_budget():
    build = MODELS["llama-vocab128"]
    assert guess_max_batch_size(build_model=build, build_optimizer=build_optimizer, forward_backward=forward_backward,
                                seq_len=SEQ, budget_bytes=2**20) is None


class LSTMLanguageModel(nn.Module):
    """A recurrent model whose fake LSTM kernel holds less than the real one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 512)
        self.vocab = 512

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


def test_a_guess_whose_fake_kernels_are_not_the_real_ones_is_dropped_at_the_warmup(tmp_path):
    """The warmup at batch 2 adds more than the fake step at 2 did: the guess's step (at a size
    the real step cannot take) is not run, the real steps draw the line, and the answer is the
    search's without a guess."""
    target = real_target(LSTMLanguageModel)
    budget = training_state_bytes(target.model, target.optimizer) * 3 + 24 * 2**20
    guess = guess_max_batch_size(build_model=LSTMLanguageModel, build_optimizer=build_optimizer,
                                 forward_backward=forward_backward, seq_len=SEQ, budget_bytes=budget)
    plain = probe_max_batch_size(target, budget_bytes=budget, snapshot_dir=str(tmp_path))
    assert guess.batch_size > plain.max_batch_size + 1  # the fake LSTM holds less a sample
    lines = []
    with lines_to(lines.append):
        guided = probe_max_batch_size(target, budget_bytes=budget, snapshot_dir=str(tmp_path), first_guess=guess)
    assert guided.max_batch_size == plain.max_batch_size
    assert not any(t.phase == "guess" or t.batch_size == guess.batch_size for t in guided.trials)
    assert any("the guess is not this step's" in line for line in lines) and guided.first_guess.held is False
