"""Real English text that ships with CPython, as a torchtune dataset: no download needed."""

import contextlib
import glob
import hashlib
import json
import os
import re
from typing import Any, List

from torchtune.datasets import text_completion_dataset
from torchtune.modules.transforms.tokenizers import ModelTokenizer

from adaptive_batch.files import atomic_write

DATA_FILENAME = "pydoc_topics.jsonl"


def pydoc_paragraphs(min_chars: int = 64) -> List[str]:
    """Paragraphs of CPython's help topics (``pydoc_data.topics``), in a fixed order.

    Raises:
        ValueError: if ``min_chars`` is negative.
    """
    if min_chars < 0:
        raise ValueError(f"dataset.min_chars={min_chars} must be zero or more.")
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            paragraph = paragraph.strip()
            if len(paragraph) >= max(min_chars, 1):
                paragraphs.append(paragraph)
    return paragraphs


def write_pydoc_jsonl(data_dir: str, min_chars: int = 64) -> str:
    """Writes the paragraphs as JSON lines (``{"text": ...}``) once, atomically; returns the path.

    The file name carries a hash of the content, so a change of ``min_chars`` or of CPython's
    topics writes a new file instead of reusing a stale one; the other such files go, so the
    folder (a run's own: the configs put it under ``output_dir``) holds what this run reads. A resume's fingerprint covers the folder: a refused resume
    with another ``min_chars`` once left its file there, and the resume with the key put back was
    refused too.
    """
    lines = [json.dumps({"text": p}) for p in pydoc_paragraphs(min_chars)]
    content = "\n".join(lines) + "\n"
    digest = hashlib.sha256(content.encode()).hexdigest()[:12]
    path = os.path.join(data_dir, f"{DATA_FILENAME[:-6]}_{digest}.jsonl")
    if not os.path.exists(path):
        atomic_write(path, lambda f: f.write(content), text=True)
    for other in glob.glob(os.path.join(glob.escape(data_dir), f"{DATA_FILENAME[:-6]}_*.jsonl")):
        if os.path.basename(other) != os.path.basename(path):
            with contextlib.suppress(FileNotFoundError):  # another rank removed it first
                os.remove(other)
    return path


def pydoc_text_dataset(
    tokenizer: ModelTokenizer,
    data_dir: str,
    min_chars: int = 64,
    packed: bool = False,
    split: str = "train",
    **kwargs: Any,
):
    """torchtune's ``text_completion_dataset`` over CPython's help topics, one paragraph a sample.

    Args:
        tokenizer: the model's tokenizer.
        data_dir: where the JSON-lines file is written (e.g. ``${output_dir}/data``).
        min_chars: shorter paragraphs are left out.
        packed: pack samples to ``tokenizer.max_seq_len`` (torchtune's ``PackedDataset``).
        split: the Hugging Face split, which may be sliced (``"train[:512]"``: the first 512).
        **kwargs: passed on to ``text_completion_dataset``.
    """
    path = write_pydoc_jsonl(data_dir, min_chars)
    return text_completion_dataset(
        tokenizer,
        source="json",
        data_files=path,
        column="text",
        split=split,
        packed=packed,
        **kwargs,
    )
