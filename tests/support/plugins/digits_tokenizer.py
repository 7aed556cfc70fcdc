"""A tokenizer of digits and arithmetic signs, numbered the other way round from the character
tokenizer's (``9`` is id 3): a run whose parts did not all build it would not score its own
answers right."""

from __future__ import annotations

from jetrl.policy.tokenizer import CharTokenizer

ALPHABET = "9876543210-+="


class DigitsTokenizer(CharTokenizer):
    def __init__(self) -> None:
        super().__init__(ALPHABET)


def digits_tokenizer(path: str | None) -> DigitsTokenizer:
    """The tokenizer seam's factory (it reads no checkpoint)."""
    return DigitsTokenizer()
