"""Prompt tokenization in the ingress: chat template, then token ids.

The ingress tokenizes so that routing sees the tokens the engine will cache.
"""

from __future__ import annotations

from pathlib import Path

from router.protocol import ChatMessage


class PromptTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not self._tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template")
        self.vocab_size = len(self._tokenizer)

    def encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        text = self._tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.encode_text(str(text))
