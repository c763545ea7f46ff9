"""Tokenizers with one small interface: ``encode``, ``decode``, special ids, ``vocab_size``.

``CharTokenizer`` covers the built-in arithmetic task (one id per character, fits the tiny
model's 64-token vocabulary); ``load_hf_tokenizer`` wraps a local Hugging Face tokenizer
directory (e.g. a real Qwen3 checkpoint) behind the same interface.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_CHARS = "0123456789+-*/=()<>.,:;?! abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Character-level tokenizer: ids 0/1/2 are pad/bos/eos, then one id per character."""

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not contain duplicates")
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._specials = (PAD, BOS, EOS)
        self._to_id = {c: i + len(self._specials) for i, c in enumerate(chars)}
        self._to_char = dict(enumerate(self._specials)) | {i: c for c, i in self._to_id.items()}
        self.vocab_size = len(self._specials) + len(chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids; a character outside the alphabet raises ValueError naming it."""
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as err:
            raise ValueError(f"text contains character {err.args[0]!r} outside the "
                             "tokenizer alphabet") from None
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Ids -> text; special tokens dropped unless ``skip_special_tokens=False``."""
        out = []
        for i in ids:
            i = int(i)
            if i not in self._to_char:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
            if skip_special_tokens and i < len(self._specials):
                continue
            out.append(self._to_char[i])
        return "".join(out)

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one token of the vocabulary, else None."""
        return self._to_id.get(text)


class HFTokenizer:
    """A local HF tokenizer behind the CharTokenizer interface."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id
        # whether the tokenizer itself starts a text with BOS (Llama's does, Qwen's and a
        # BPE without a post-processor do not): what ``add_bos`` follows
        self.adds_bos = self.bos_id is not None and \
            list(tokenizer.encode("a", add_special_tokens=True))[:1] == [self.bos_id]
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids; ``add_bos``: the BOS the tokenizer adds itself, if any."""
        ids = list(self._tok.encode(text, add_special_tokens=False))
        bos = [self.bos_id] if add_bos and self.adds_bos else []
        eos = [self.eos_id] if add_eos and self.eos_id is not None else []
        return bos + ids + eos

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        """``messages`` through the chat template, the assistant's turn opened."""
        if not self.has_chat_template:
            raise ValueError("task.prompt_template 'chat': the tokenizer has no chat template")
        return self._tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one token of the vocabulary, else None."""
        ids = self._tok.encode(text, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    def save_pretrained(self, path: str) -> None:
        """Writes the tokenizer files (tokenizer.json, tokenizer_config.json, ...)."""
        self._tok.save_pretrained(path)


def load_hf_tokenizer(path: str) -> HFTokenizer:
    """Load the tokenizer files of a local HF checkpoint directory (never the network)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:  # transformers is an optional dependency
        raise ImportError("load_hf_tokenizer needs the 'transformers' package") from err
    return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
