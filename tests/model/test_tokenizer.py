"""Tokenizer tests: char tokenizer round trip and the HF wrapper on a local directory."""

import pytest

from satjax.model import Qwen3MoeConfig
from satjax.model.tokenizer import CharTokenizer, load_hf_tokenizer


def test_char_tokenizer_roundtrip_and_specials():
    tok = CharTokenizer()
    assert tok.vocab_size <= Qwen3MoeConfig.tiny().vocab_size
    text = "12+34*5=182"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(set(ids[1:-1])) == len(set(text))
    assert min(ids[1:-1]) > 2 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    with pytest.raises(ValueError, match="'#'"):
        tok.encode("1#2")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_load_hf_tokenizer_from_local_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5, "1": 6}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="[UNK]")
    fast.save_pretrained(tmp_path)
    tok = load_hf_tokenizer(str(tmp_path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 7)
    ids = tok.encode("hello world 1", add_eos=True)
    assert ids == [4, 5, 6, 2]
    assert tok.decode(ids) == "hello world 1"
