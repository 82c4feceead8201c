"""The zoo's models, each a top-level ``build_*() -> ProbeTarget`` (picklable, so the probe's
child trials can build them too). Random weights, worst-case batches, AdamW, fp32, CPU."""

import torch
from torch import nn
import torch.nn.functional as F

from adaptive_batch.probe.target import ProbeTarget

SEQ_LEN = 128


def _target(model: nn.Module, loss_of, make_batch) -> ProbeTarget:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        loss_of(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return ProbeTarget(step, make_batch, model, optimizer)


def build_mlp() -> ProbeTarget:
    """256 -> 8192 -> 1, the soft-budget case that answered 2 to 747 in fresh processes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 8192), nn.ReLU(), nn.Linear(8192, 1))
    return _target(model, lambda b: F.mse_loss(model(b["x"]), b["y"]),
                   lambda n: {"x": torch.randn(n, 256), "y": torch.randn(n, 1)})


def build_convnet() -> ProbeTarget:
    """Three conv + BatchNorm layers on 3x96x96 images: the case whose probe crashed."""
    torch.manual_seed(0)

    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10))
    return _target(model, lambda b: F.cross_entropy(model(b["x"]), b["y"]),
                   lambda n: {"x": torch.randn(n, 3, 96, 96), "y": torch.randint(0, 10, (n,))})


def build_llama128k() -> ProbeTarget:
    """torchtune's Llama 3.2 layout with its real 128,256-token vocabulary (2 layers, dim 256)."""
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    vocab = 128_256
    model = llama3(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=256,
                   max_seq_len=SEQ_LEN, intermediate_dim=768)
    return _target(model, lambda t: F.cross_entropy(model(t).float().view(-1, vocab), t.view(-1)),
                   lambda n: torch.randint(0, vocab, (n, SEQ_LEN), generator=torch.Generator().manual_seed(n)))


def build_bert() -> ProbeTarget:
    """A transformers BERT encoder (4 layers, hidden 256, BERT's 30,522-token vocabulary), masked LM."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30_522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=SEQ_LEN)
    model = BertForMaskedLM(config)

    def make_batch(n):
        ids = torch.randint(0, 30_522, (n, SEQ_LEN), generator=torch.Generator().manual_seed(n))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    return _target(model, lambda b: model(**b).loss, make_batch)


def build_lstm() -> ProbeTarget:
    """A 2-layer LSTM language model (vocabulary 10,000, hidden 512) on 64-token sequences."""
    torch.manual_seed(0)

    class LSTMLanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10_000, 256)
            self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True)
            self.head = nn.Linear(512, 10_000)

        def forward(self, tokens):
            return self.head(self.lstm(self.embedding(tokens))[0])

    model = LSTMLanguageModel()
    return _target(model, lambda t: F.cross_entropy(model(t).view(-1, 10_000), t.view(-1)),
                   lambda n: torch.randint(0, 10_000, (n, 64), generator=torch.Generator().manual_seed(n)))


def build_vit() -> ProbeTarget:
    """A transformers ViT (96x96 images in 8x8 patches, 4 layers, hidden 192), 100 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=96, patch_size=8, hidden_size=192, num_hidden_layers=4,
                                                num_attention_heads=3, intermediate_size=768, num_labels=100))
    return _target(model, lambda b: model(pixel_values=b["x"], labels=b["y"]).loss,
                   lambda n: {"x": torch.randn(n, 3, 96, 96), "y": torch.randint(0, 100, (n,))})


def build_t5() -> ProbeTarget:
    """A transformers T5 encoder-decoder (2 + 2 layers, d_model 256, vocabulary 32,128): 128
    tokens in, 32 out."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32_128, d_model=256, d_kv=32, d_ff=1024, num_layers=2,
                                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                pad_token_id=0))

    def make_batch(n):
        generator = torch.Generator().manual_seed(n)
        return {"input_ids": torch.randint(0, 32_128, (n, SEQ_LEN), generator=generator),
                "labels": torch.randint(0, 32_128, (n, 32), generator=generator)}

    return _target(model, lambda b: model(**b).loss, make_batch)


def build_audio_conv() -> ProbeTarget:
    """1-D convolutions with GroupNorm and dropout on a second of 16 kHz audio, 35 classes."""
    torch.manual_seed(0)

    def block(i, o):
        return [nn.Conv1d(i, o, 9, padding=4), nn.GroupNorm(8, o), nn.GELU(), nn.Dropout(0.1)]

    model = nn.Sequential(*block(1, 64), *block(64, 128), nn.MaxPool1d(4), *block(128, 128), nn.AdaptiveAvgPool1d(1),
                          nn.Flatten(), nn.Linear(128, 35))
    return _target(model, lambda b: F.cross_entropy(model(b["x"]), b["y"]),
                   lambda n: {"x": torch.randn(n, 1, 16_000), "y": torch.randint(0, 35, (n,))})


BUILDERS = {"mlp": build_mlp, "convnet": build_convnet, "llama128k": build_llama128k, "bert": build_bert,
            "lstm": build_lstm, "vit": build_vit, "t5": build_t5, "audio-conv": build_audio_conv}
