"""A Hugging Face tokenizer behind the tokenizer seam (policy/tokenizer.py).

transformers' ``AutoTokenizer`` over a checkpoint's local files (never a hub download), with its
chat template. What the seam adds to it:

* ``stop_ids``: EOS, the generation config's EOS ids, and the end-of-turn token the chat
  template writes after an assistant message (found by rendering one: ``<|im_end|>`` for Qwen,
  ``<|eot_id|>`` for Llama 3), so a model turn ends where the template would end it.
* ``encode_reply``: the ids that follow a finished model turn, as the template writes them: the
  text the template puts after the end-of-turn token (a newline for Qwen), the other role's
  message, and the opening of the next assistant turn. They are found by rendering a
  conversation with and without the reply and taking what the reply added, so they are exactly
  the template's, and a multi-turn prompt stays the previous prompt + completion + these ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jetrl.policy.tokenizer import ChatMessage

# Placeholder texts for rendering the template around a reply; any text the template leaves
# as it is would do.
_USER, _MODEL = "jetrl-user-text", "jetrl-model-text"


class TokenizerError(ValueError):
    pass


def hf_tokenizer(path: str | None) -> HFTokenizer:
    """The ``hf`` tokenizer: checkpoint directory ``path``'s own."""
    if not path:
        raise ValueError("the 'hf' tokenizer needs [model] hf_path (a checkpoint directory)")
    return HFTokenizer(path)


class HFTokenizer:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{self.path}: cannot load a tokenizer: {e}") from None
        if not self._tok.chat_template:
            raise TokenizerError(f"{self.path}: the tokenizer has no chat template")
        eos = self._tok.eos_token_id
        if eos is None:
            raise TokenizerError(f"{self.path}: the tokenizer has no EOS token")
        self._eos = int(eos)
        pad = self._tok.pad_token_id
        self._pad = int(pad) if pad is not None else self._eos
        bos = self._tok.bos_token_id
        self._bos = int(bos) if bos is not None else None
        self._special = frozenset(int(i) for i in self._tok.all_special_ids)
        self._stop = self._find_stop_ids()
        self._reply_prefix = self._text_after_turn()

    # ------------------------------------------------------------------ the seam

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int:
        """The BOS id, or -1 when the tokenizer has none (Qwen): then ``bos=True`` adds nothing."""
        return -1 if self._bos is None else self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        """Ids of ``text``; special tokens written in it (a rendered chat's) are parsed as such."""
        ids: list[int] = list(self._tok.encode(text, add_special_tokens=False))
        if bos and self._bos is not None and ids[:1] != [self._bos]:
            ids.insert(0, self._bos)
        if eos:
            ids.append(self._eos)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True, stop_at_eos: bool = True) -> str:
        out: list[int] = []
        for i in ids:
            i = int(i)
            if stop_at_eos and i in self._stop:
                break
            if 0 <= i < self.vocab_size:  # a model's vocabulary may be padded past the tokenizer's
                out.append(i)
        return str(self._tok.decode(out, skip_special_tokens=skip_special))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def encode_reply(self, text: str, *, role: str = "user") -> list[int]:
        convo = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
        before = self._render(convo, generation=False)
        after = self._render([*convo, {"role": role, "content": text}], generation=True)
        if not after.startswith(before):
            raise TokenizerError(
                f"{self.path}: the chat template rewrites earlier turns when a {role!r} message is "
                "added, so a reply cannot be appended token by token"
            )
        return self.encode(self._reply_prefix + after[len(before) :], bos=False)

    # ------------------------------------------------------------------ set-up

    def _render(self, messages: list[dict[str, str]], *, generation: bool) -> str:
        return str(self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))

    def _assistant_tail(self) -> str:
        """What the template writes after an assistant message's text."""
        convo = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
        rendered = self._render(convo, generation=False)
        at = rendered.rfind(_MODEL)
        if at < 0:
            raise TokenizerError(f"{self.path}: the chat template drops the assistant's text")
        return rendered[at + len(_MODEL) :]

    def _find_stop_ids(self) -> tuple[int, ...]:
        stops = [self._eos]
        gen = self.path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            stops += [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        tail_ids = self.encode(self._assistant_tail(), bos=False)
        stops += [i for i in tail_ids[:1] if i in self._special]  # the end-of-turn token
        return tuple(dict.fromkeys(stops))

    def _text_after_turn(self) -> str:
        """The template's text between the end-of-turn token (where generation stopped) and
        the next message, e.g. Qwen's newline: the completion holds the token, not the text."""
        tail = self._assistant_tail()
        ids = self.encode(tail, bos=False)
        if ids[:1] and ids[0] in self._stop:
            return str(self._tok.decode(ids[1:], skip_special_tokens=False))
        return tail
