"""A byte-level tokenizer that implements torchtune's tokenizer protocols, for offline runs."""

from typing import Any, Dict, List, Mapping, Optional, Tuple

from torchtune.data import Message, truncate
from torchtune.modules.transforms.tokenizers import (
    BaseTokenizer,
    ModelTokenizer,
    tokenize_messages_no_special_tokens,
)

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


class ByteTokenizer(ModelTokenizer, BaseTokenizer):
    """UTF-8 bytes as tokens (ids 0-255) plus BOS, EOS and PAD: no vocabulary file needed.

    Args:
        max_seq_len: the longest token sequence it returns (BOS and EOS included); ``None``
            for no limit.

    Raises:
        ValueError: if ``max_seq_len`` is given and below 2.
    """

    special_tokens: Dict[str, int] = {
        "<|begin_of_text|>": BOS_ID,
        "<|end_of_text|>": EOS_ID,
        "<|pad|>": PAD_ID,
    }

    def __init__(self, max_seq_len: Optional[int] = None) -> None:
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or int(max_seq_len) < 2):
            raise ValueError(
                f"tokenizer.max_seq_len={max_seq_len!r} must be an integer of at least 2 or null."
            )
        self.max_seq_len = None if max_seq_len is None else int(max_seq_len)
        self.bos_id = BOS_ID
        self.eos_id = EOS_ID
        self.pad_id = PAD_ID
        self.vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **kwargs: Any) -> List[int]:
        """Text to token ids: its UTF-8 bytes, with BOS/EOS if asked."""
        tokens = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + tokens + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        """Token ids to text; special tokens are dropped, or shown by name."""
        names = {v: k for k, v in self.special_tokens.items()}
        out, pending = [], bytearray()
        for t in token_ids:
            if t < 256:
                pending.append(t)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append(names.get(t, f"<|{t}|>"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def tokenize_messages(self, messages: List[Message], **kwargs: Any) -> Tuple[List[int], List[bool]]:
        """Messages to tokens and loss mask, truncated to ``max_seq_len`` (EOS kept last)."""
        tokens, mask = tokenize_messages_no_special_tokens(
            self, messages, bos_id=self.bos_id, eos_id=self.eos_id
        )
        if self.max_seq_len is not None:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id)
            mask = truncate(mask, self.max_seq_len, True)
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """The transform torchtune's message datasets call: adds ``tokens`` and ``mask``."""
        sample = dict(sample)
        tokens, mask = self.tokenize_messages(sample.pop("messages"))
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def byte_tokenizer(max_seq_len: Optional[int] = None) -> ByteTokenizer:
    """Builder for configs: ``tokenizer: {_component_: adaptive_batch.byte_tokenizer}``."""
    return ByteTokenizer(max_seq_len=max_seq_len)
