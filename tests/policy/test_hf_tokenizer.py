"""The Hugging Face tokenizer behind the tokenizer seam: chat template, stops, token in/out."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetrl.deploy.tiny_hf_cmd import make_tokenizer_dir
from jetrl.policy.hf_tokenizer import HFTokenizer, TokenizerError
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import tokenizer_for

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> HFTokenizer:
    return HFTokenizer(tok_dir)


def test_specials_and_stops(tok: HFTokenizer, tok_dir: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_id == im_end and im_end in tok.stop_ids
    assert tok.pad_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_id == -1  # Qwen-style: no BOS, and encode adds none
    assert tok.encode("12 + 7") == ref.encode("12 + 7", add_special_tokens=False)
    assert tok.vocab_size == len(ref)


def test_chat_rendering_is_the_templates(tok: HFTokenizer, tok_dir: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    msgs = [{"role": "user", "content": "Ann has 3 apples."}]
    text = tok.render_chat(msgs)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode(text, bos=False) == list(
        ref.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


@pytest.mark.parametrize("role", ["user", "tool"])
def test_a_reply_appended_token_by_token_is_the_whole_conversation_rendered(
    tok: HFTokenizer, role: str
) -> None:
    """Turn 2's prompt = turn 1's prompt + the completion (ending on its stop token) + the
    reply's ids, and that is exactly what the template renders for the whole conversation."""
    first = [{"role": "user", "content": "What is 12 + 7?"}]
    prompt = tok.encode(tok.render_chat(first), bos=False)
    completion = [*tok.encode("<calc>12+7</calc>", bos=False), tok.eos_id]
    turn2 = [*prompt, *completion, *tok.encode_reply("19", role=role)]
    whole = [*first, {"role": "assistant", "content": "<calc>12+7</calc>"}, {"role": role, "content": "19"}]
    assert turn2 == tok.encode(tok.render_chat(whole), bos=False)


def test_decode_stops_at_the_end_of_turn(tok: HFTokenizer) -> None:
    ids = [*tok.encode("The answer is 19", bos=False), tok.eos_id, *tok.encode("junk", bos=False)]
    assert tok.decode(ids) == "The answer is 19"
    assert "junk" in tok.decode(ids, stop_at_eos=False)
    assert tok.decode([*tok.encode("7", bos=False), 10_000]) == "7"  # ids past the vocabulary


def test_tokenizer_for_picks_the_checkpoints(tok_dir: Path) -> None:
    assert isinstance(tokenizer_for(ModelSettings(hf_path=str(tok_dir))), HFTokenizer)
    assert (
        type(tokenizer_for(ModelSettings(hf_path=str(tok_dir), tokenizer="char"))).__name__ == "CharTokenizer"
    )
    with pytest.raises(ValueError, match="needs \\[model\\] hf_path"):
        tokenizer_for(ModelSettings(tokenizer="hf"))


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path, tok_dir: Path) -> None:
    import json
    import shutil

    d = shutil.copytree(tok_dir, tmp_path / "t")
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="no chat template"):
        HFTokenizer(d)
    with pytest.raises(TokenizerError, match="cannot load"):
        HFTokenizer(tmp_path / "nothing-here")
