"""Stop strings: end a generation once its text contains one of them (vLLM's ``stop``, transformers' ``stop_strings``).

A stop string may be split over several tokens, or be part of one token's text (a token ``".\\n\\n"`` completes the
stop string ``"\\n"``). After every verified token the decoder asks :meth:`StopStrings.hit` whether the text of the
generated tokens now contains a stop string; the first token for which it does is the last one returned, with
``finish_reason == "stop"``. The tokens are kept whole (a token-level result, so SPD and AR stay comparable token for
token); :meth:`StopStrings.truncate` cuts a decoded answer before its stop string, as vLLM returns it.

Only the tail of the generation is decoded each time (:attr:`StopStrings.window` tokens): a stop string of ``b``
UTF-8 bytes spans at most ``b`` tokens when every token decodes to at least one byte, and the window adds margin for
a partial multi-byte character at its start. Every decoder of the project (the SPD reference decoder, the DeepSpeed
engine's head rank, the AR decoders) checks through the same object, so where they stop is decided identically.
Token ids the tokenizer does not know (padded embedding rows) decode to nothing and so widen a
stop string's span by one token each: a window that missed it would miss it in every decoder alike (the stop is
still a function of the tokens alone, so SPD and AR stay identical). Stop strings apply to the generated tokens
only, never to the prompt. The text matched is the tokens' raw decoding:
special tokens count as their text (``<|im_end|>``), and a multi-byte character whose last byte has not been generated
yet reads as ``\ufffd`` (vLLM matches the detokenized text with special tokens left out).
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopStrings:
    """Which generations have produced one of ``strings``.

    Args:
        strings: the stop strings (each non-empty).
        decode: ``token ids -> text`` (the target's tokenizer, special tokens kept as text).

    Raises:
        ValueError: no strings, or an empty / non-string entry.
    """

    def __init__(self, strings: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        if isinstance(strings, str):
            raise ValueError(f"stop strings must be a list of strings, got the string {strings!r}: write [{strings!r}]")
        strings = tuple(strings)
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}")
        self.strings = strings
        self.decode = decode
        self.window = max(len(s.encode("utf-8")) for s in strings) + 4  # tokens decoded per check

    @classmethod
    def from_tokenizer(cls, strings: Sequence[str] | None, tokenizer) -> "StopStrings | None":
        """The matcher for ``strings`` with a transformers tokenizer; ``None`` when there are none."""
        if not strings:
            return None
        return cls(strings, lambda ids: tokenizer.decode(ids, skip_special_tokens=False,
                                                         clean_up_tokenization_spaces=False))

    def hit(self, tokens: Sequence[int]) -> bool:
        """Whether the text of ``tokens`` (int token ids: the generation so far, the newest last) contains a stop
        string.

        Called after every new token, so a stop string found here was completed by the newest token. Decodes the last
        :attr:`window` tokens (host work, no device access)."""
        text = self.decode(list(tokens[-self.window:]))
        return any(s in text for s in self.strings)

    def truncate(self, text: str) -> str:
        """``text`` up to (not including) the first stop string in it; unchanged when there is none."""
        cut = min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=len(text))
        return text[:cut]

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"
