"""Prompts -> token ids, checked against the model before anything reaches the engine.

Tokenizing and rendering a chat template cost time in proportion to the text, and they hold the GIL in
pieces: on the event loop a multi-megabyte prompt would stall every other client (and /health) until it
was rejected as too long. So (1) text that cannot fit the context is refused before it is tokenized, on a
cheap bound: a prompt of at most max_model_len tokens holds at most max_model_len * (longest token in
bytes) bytes; twice that is allowed, for normalizers that drop characters; (2) tokenizing runs on a small
thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from detinfer import admission
from detinfer.server.protocol import bad_request

# Slack over the exact bound (see the module docstring): text a normalizer removes takes no token.
PROMPT_BYTES_SLACK = 2


class PromptChecker:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, longest_token_bytes: int,
                 executor: ThreadPoolExecutor):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_prompt_bytes = max_model_len * max(longest_token_bytes, 1) * PROMPT_BYTES_SLACK
        self._executor = executor

    def check_text_size(self, texts: list[str], param: str) -> None:
        """Refuse text that could never fit the context (before tokenizing it). len(str) <= UTF-8 bytes
        <= 4 * len(str), so the exact byte count is only needed near the bound."""
        if 4 * sum(len(t) for t in texts) <= self.max_prompt_bytes:
            return
        size = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)
        if size > self.max_prompt_bytes:
            raise bad_request(f"{param} is {size} bytes of text, more than can fit in this model's context of "
                                  f"{self.max_model_len} tokens (at most {self.max_prompt_bytes} bytes)",
                                  param=param, code="context_length_exceeded")

    async def _off_loop(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode(self, texts: list[str], param: str) -> list[list[int]]:
        self.check_text_size(texts, param)
        return await self._off_loop(lambda: [self.tokenizer.encode(t) for t in texts])

    async def decode(self, ids: list[int]) -> str:
        return await self._off_loop(lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    async def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        self.check_text_size([m["content"] for m in messages], "messages")

        def render() -> list[int]:
            try:
                return self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                          add_generation_prompt=add_generation_prompt)
            except Exception as e:  # any template failure is caused by the messages it was given
                raise bad_request(f"messages: the chat template failed: {e}", param="messages") from None

        return await self._off_loop(render)

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> list[int]:
        """The one admission check (`detinfer.admission`, the engine's too) as a 400 naming the field."""
        try:
            return admission.check_prompt(param, ids, self.vocab_size, self.max_model_len, max_tokens)
        except admission.PromptLengthError as e:
            blame = param if e.field == "prompt" else e.field
            code = None if e.field == "prompt" and not ids else "context_length_exceeded"
            raise bad_request(f"{param}: {e}", param=blame, code=code) from None
        except (TypeError, ValueError) as e:
            raise bad_request(str(e), param=param) from None
