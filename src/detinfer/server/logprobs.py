"""Logprobs as OpenAI shows them: each token's text and UTF-8 bytes, and (legacy completions) the
character offset of each token in the returned text."""

from __future__ import annotations

from typing import Any

from detinfer.server.responses import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a -inf logprob is reported as this (as vLLM does)


def clamp_logprob(x: float) -> float:
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (every byte drawn as a printable character): printable
    Latin-1 bytes stand for themselves, the rest are shifted to code points 256 and up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class TextOffsets:
    """`text_offset` of each token: where the token's text starts in the returned text.

    Offsets come from the cumulative detokenized text (the same incremental detokenizer the engine builds
    the output text with), not from summing per-token lengths: a character split over several byte tokens
    appears once, at the offset of its first token, and special tokens that decoding strips take no room.
    """

    def __init__(self, tokenizer: Any, start: int = 0, context_ids: Any = (), skip_special_tokens: bool = True):
        self.start = start
        self._detok = tokenizer.incremental_detokenizer(context_ids, skip_special_tokens=skip_special_tokens)

    def next(self, token_id: int) -> int:
        """The offset of `token_id`, the next token of the text."""
        offset = self.start + len(self._detok.raw_text)
        self._detok.add(token_id)
        return offset


class TokenFormatter:
    """Token ids as OpenAI shows them in logprobs: the token's UTF-8 bytes, and its text (or, for a token
    that is only part of a UTF-8 character, `bytes:\\xNN...` as OpenAI writes such tokens)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._decoder = _byte_level_decoder() if self._byte_level else {}
        self._special = set(tokenizer.all_special_ids)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode("utf-8")
        if self._byte_level and all(c in self._decoder for c in piece):
            return bytes(self._decoder[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte-fallback pieces
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def longest_token_bytes(self, vocab_size: int) -> int:
        """An upper bound on the UTF-8 bytes any one token stands for: the longest vocabulary piece in UTF-8
        (a piece's spelling is never shorter than the text it decodes to: byte-level and byte-fallback
        pieces spell one byte with 2 to 6, SentencePiece spells a space with a 3-byte '▁')."""
        pieces = (self.tokenizer.id_to_token(t) for t in range(vocab_size))
        return max((len(p.encode("utf-8")) for p in pieces if p is not None), default=1)

    def completion_logprobs(self, entries: Any, offsets: TextOffsets) -> CompletionLogprobs:
        """Legacy /v1/completions logprobs for `entries` (TokenLogprob, or a bare token id for a position
        without a logprob); `offsets` continues where the previous entries of this choice ended."""
        out = CompletionLogprobs()
        for e in entries:
            token_id = e if isinstance(e, int) else e.token_id
            out.tokens.append(self.token(token_id)[0])
            out.text_offset.append(offsets.next(token_id))
            if isinstance(e, int):  # a prompt token without context (position 0): no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(clamp_logprob(e.logprob))
                out.top_logprobs.append({self.token(t)[0]: clamp_logprob(lp) for t, lp in e.top_logprobs.items()})
        return out

    def chat_logprobs(self, entries: Any) -> ChatLogprobs:
        content = []
        for e in entries:
            text, raw = self.token(e.token_id)
            top = [TopLogprob(token=self.token(t)[0], logprob=clamp_logprob(lp), bytes=list(self.token(t)[1]))
                   for t, lp in e.top_logprobs.items()]
            content.append(TokenLogprob(token=text, logprob=clamp_logprob(e.logprob), bytes=list(raw),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, entries: Any) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first: no context) or {token id: logprob,
        rank, decoded_token} with the prompt's own token first, then the top-k alternatives by rank."""
        out: list[dict[str, PromptLogprob] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            row = {str(e.token_id): PromptLogprob(logprob=clamp_logprob(e.logprob), rank=e.rank,
                                                  decoded_token=self.token(e.token_id)[0])}
            for rank, (t, lp) in enumerate(e.top_logprobs.items(), start=1):
                row.setdefault(str(t), PromptLogprob(logprob=clamp_logprob(lp), rank=rank,
                                                     decoded_token=self.token(t)[0]))
            out.append(row)
        return out
