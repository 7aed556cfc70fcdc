"""A character tokenizer for toy tasks (reversing or sorting short strings, modular arithmetic).

Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``; the alphabet follows in order, one id per
character. The default alphabet yields 58 ids, inside the tiny models' vocabulary of 64.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
REPLACEMENT = "\ufffd"
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*/%=<>()[],.:;? |"


class CharTokenizer:
    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(
        self, ids: Iterable[int], *, skip_special: bool = True, stop_at_eos: bool = True, strict: bool = False
    ) -> str:
        """Text of ``ids``. A model's vocabulary may be larger than the tokenizer's: ids past
        the alphabet become U+FFFD unless ``strict``."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(SPECIAL_TOKENS[i])
                continue
            if i >= self.vocab_size:
                if strict:
                    raise ValueError(f"id {i} is outside the vocabulary of {self.vocab_size}")
                out.append(REPLACEMENT)
                continue
            out.append(self.alphabet[i - len(SPECIAL_TOKENS)])
        return "".join(out)
