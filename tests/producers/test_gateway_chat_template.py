"""The gateway renders a request through the run's own chat template (a Hugging Face tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits
from jetrl.deploy.gateway_cmd import run_tokenizer
from jetrl.deploy.tiny_hf_cmd import make_tokenizer_dir
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.producers.gateway import ChatGateway, GatewaySettings


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_a_request_is_rendered_by_the_chat_template(tok_dir: Path) -> None:
    tok = HFTokenizer(tok_dir)
    gw = ChatGateway(None, "r", GatewaySettings(max_tokens=8), tok)  # type: ignore[arg-type]  # parsing needs no bus
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 + 4?"}]
    req = gw._parse({"messages": msgs})
    text, tokens = req.text, req.tokens
    want = "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
    assert text == want + "<|im_start|>assistant\n"
    assert tokens == tok.encode(text, bos=False) and tokens[0] == tok.encode("<|im_start|>", bos=False)[0]


async def test_the_gateway_takes_the_runs_tokenizer_from_its_log(
    nats_server: EmbeddedServer, tok_dir: Path
) -> None:
    bus = await Bus.connect(nats_server.url)
    try:
        await bus.ensure_run("gwtok", StreamLimits(max_bytes=64 * 1024**2, payload_max_bytes=64 * 1024**2))
        started = ev.RunStarted(config={"model": {"hf_path": str(tok_dir)}}, code_version="t")
        await bus.publish(ev.new_event(started, run_id="gwtok"))
        tok = await run_tokenizer(bus, "gwtok")
        assert isinstance(tok, HFTokenizer) and tok.path == tok_dir
    finally:
        await bus.close()
