import contextlib
import gc
import resource

import pytest

from adaptive_batch.memory.device import proc_status_bytes


def vm_size() -> int:
    return proc_status_bytes("VmSize")


@contextlib.contextmanager
def address_space_headroom(headroom_bytes: int):
    """A real process address-space limit: current size plus ``headroom_bytes``, then lifted."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom_bytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


@pytest.fixture
def limited_address_space():
    return address_space_headroom


@pytest.fixture
def unfrozen_heap(monkeypatch):
    """The process as a user's is, no object set aside from the garbage collector (tests/conftest.py
    freezes the imports' objects) and none seen set aside by an earlier probe, for the test's
    block; frozen again after it."""
    from adaptive_batch.memory import oom

    monkeypatch.setattr(oom, "_process_froze", False)
    gc.unfreeze()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()


def one_layer_qwen(vocab_size: int, tie: bool):
    """A builder of a one-layer Qwen2 with ``vocab_size`` tokens (``tie``: tied embeddings) and
    its chunked loss, the model set up for it."""
    from torchtune.models.qwen2 import qwen2
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    loss_fn = CEWithChunkedOutputLoss()

    def build():
        model = qwen2(vocab_size=vocab_size, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=64,
                      intermediate_dim=128, max_seq_len=64, tie_word_embeddings=tie)
        model.set_num_output_chunks(loss_fn.num_output_chunks)
        return model

    return build, loss_fn


def real_step_memory(build, loss_fn, vocab_size: int, seq_len: int = 64):
    """``measure(b)``: the memory of a real training step (AdamW) at batch ``b`` of a model
    ``build()`` makes (seeded), as the probe measures it."""
    import torch

    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.trials import measure_training_step, worst_case_text_batch
    from adaptive_batch.torchtune import next_token_loss

    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), fused=False)

    def step(batch):
        next_token_loss(model, loss_fn, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def measure(b):
        batch = worst_case_text_batch(b, seq_len=seq_len, vocab_size=vocab_size, device=torch.device("cpu"))
        return measure_training_step(ProbeTarget(step, None, model, optimizer, torch.device("cpu")), batch)

    return measure
