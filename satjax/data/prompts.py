"""Prompt templates: how an example's text becomes the prompt's token ids.

``task.prompt_template`` is "raw" (the question as is), "chat" (the tokenizer's chat
template: one user turn, after ``task.system_prompt`` if set, then the assistant's turn
opened) or a Python format string over the row's fields (``{prompt}`` is the question),
e.g. ``"Question: {question}\nAnswer:"`` for a base model.

BOS: "raw" and format strings get the BOS the tokenizer itself adds (Llama's does,
Qwen's does not, satjax's character tokenizer does); "chat" gets what the template
writes. A BOS is never doubled.
"""

from __future__ import annotations

import dataclasses

from satjax.data.tasks import Example

TEMPLATES = ("raw", "chat")  # anything else is a format string


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    template: str = "raw"
    system_prompt: str = ""

    def text(self, tokenizer, example: Example) -> str:
        """The prompt as text (for "chat": the template applied, generation prompt on)."""
        if self.template == "raw":
            return example.prompt
        if self.template == "chat":
            chat = getattr(tokenizer, "chat_text", None)
            if chat is None:
                raise ValueError("task.prompt_template 'chat': needs a Hugging Face tokenizer "
                                 "with a chat template (task.tokenizer_path)")
            messages = [{"role": "system", "content": self.system_prompt}] \
                if self.system_prompt else []
            return chat([*messages, {"role": "user", "content": example.prompt}])
        # a null field (JSON null; a Parquet row without it: a column holds every field)
        # is absent, not the text "None"
        fields = {k: v for k, v in example.fields.items() if v is not None}
        try:
            return self.template.format(**{"prompt": example.prompt, **fields})
        except (KeyError, IndexError) as e:
            what = "a null" if e.args[0] in example.fields else "no field"
            raise ValueError(f"task.prompt_template: row {example.index} has {what} "
                             f"{e.args[0]!r} (fields: prompt, "
                             f"{', '.join(map(str, example.fields))})") from None

    def encode(self, tokenizer, example: Example) -> list[int]:
        """The prompt's token ids: the text of :meth:`text`, with BOS as described above."""
        return self.encode_text(tokenizer, self.text(tokenizer, example))

    def encode_text(self, tokenizer, text: str) -> list[int]:
        """The token ids of a prompt's :meth:`text`, with BOS as described above."""
        ids = tokenizer.encode(text, add_bos=self.template != "chat")
        bos = tokenizer.bos_id
        while bos is not None and ids[:2] == [bos, bos]:  # a template that wrote one too
            ids = ids[1:]
        return ids


RAW = PromptFormat()  # the question as is, BOS as the tokenizer adds it
