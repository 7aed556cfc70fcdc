"""The tokenizer seam, and a character tokenizer for toy tasks.

:class:`Tokenizer` is all that producers, the gateway and inference ask of a tokenizer: text to
ids and back, the special ids (``eos_id`` and ``stop_ids`` end a model turn), and chat rendering
(a conversation to the prompt text the model was trained on; with no template, the messages'
texts joined by a space). :func:`make_tokenizer` builds the one ``[model] tokenizer`` names in
the plugin registry (jetrl/plugins.py, ``TOKENIZERS``: a built-in, an installed package's, or any
``package.module:attr``), a factory taking ``[model] hf_path`` (the checkpoint directory, or
None). :class:`CharTokenizer` is the first implementation: ids 0, 1, 2 are ``<pad>``,
``<bos>``, ``<eos>``; the alphabet follows in order, one id per character. The default alphabet
yields 58 ids, inside the tiny models' vocabulary of 64. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from jetrl.plugins import TOKENIZERS

if TYPE_CHECKING:
    from jetrl.policy.settings import ModelSettings

ChatMessage = Mapping[str, str]  # {"role": ..., "content": text}


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a model turn: EOS, and a chat template's end-of-turn tokens."""
        ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        """Ids of ``text``; raises ValueError for text the tokenizer cannot write."""
        ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = True, stop_at_eos: bool = True) -> str: ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of a conversation, ending where the assistant's turn begins."""
        ...

    def encode_reply(self, text: str, *, role: str = "user") -> list[int]:
        """Ids that follow a finished model turn (one that ended on a stop id): another role's
        message (``user``, ``tool``) and the opening of the model's next turn, as the chat
        template writes them. Token in, token out: a multi-turn episode's next prompt is the
        previous prompt + the completion + these ids, never a re-tokenisation of the history."""
        ...


PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
REPLACEMENT = "\ufffd"
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*/%=<>()[],.:;? |"


class CharTokenizer:
    pad_id = 0
    bos_id = 1
    eos_id = 2
    stop_ids = (2,)
    special_ids = frozenset(range(len(SPECIAL_TOKENS)))

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

    def encode_reply(self, text: str, *, role: str = "user") -> list[int]:
        # No chat template: the reply's characters follow the model's turn as they are.
        return self.encode(text, bos=False)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        # No chat template: the model sees every message's text, in order, joined by a space.
        return " ".join(m["content"] for m in messages if m.get("content"))


def char_tokenizer(path: str | None = None) -> CharTokenizer:
    """The ``char`` tokenizer (no checkpoint's: ``path`` is not read)."""
    return CharTokenizer()


def make_tokenizer(name: str = "char", path: str | None = None) -> Tokenizer:
    """The tokenizer ``name`` names (``char``; ``hf``: the tokenizer files of checkpoint
    directory ``path``, policy/hf_tokenizer.py, transformers imported only then)."""
    tokenizer: Tokenizer = TOKENIZERS.load(name)(path)
    return tokenizer


def tokenizer_for(model: ModelSettings) -> Tokenizer:
    """The tokenizer of a run's ``[model]``."""
    return make_tokenizer(model.tokenizer_kind, model.hf_path)
