import pytest
from torchtune.data import Message

from adaptive_batch.torchtune import ByteTokenizer
from adaptive_batch.torchtune.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE


def test_encode_decode_round_trip_with_unicode():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, wörld")
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == "héllo, wörld"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|begin_of_text|>")
    assert tok.encode("ab", add_bos=False, add_eos=False) == [97, 98]


def test_tokenize_messages_masks_and_truncates():
    tok = ByteTokenizer(max_seq_len=8)
    messages = [Message(role="user", content="abc", masked=True), Message(role="assistant", content="defghij")]
    tokens, mask = tok.tokenize_messages(messages)
    assert len(tokens) == len(mask) == 8
    assert tokens[0] == BOS_ID and tokens[-1] == EOS_ID
    assert mask[1:4] == [True, True, True] and mask[4] is False


def test_transform_call_adds_tokens_and_mask():
    out = ByteTokenizer(max_seq_len=64)({"messages": [Message(role="user", content="hi")]})
    assert "messages" not in out and len(out["tokens"]) == len(out["mask"])


@pytest.mark.parametrize("bad", [1, 0, True])
def test_bad_max_seq_len(bad):
    with pytest.raises(ValueError, match="tokenizer.max_seq_len"):
        ByteTokenizer(max_seq_len=bad)
