"""The OpenAI-compatible gateway: a live run's policy answers chat completions through the bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.producers.gateway import ApiError, ChatGateway, GatewaySettings, RequestError, render


def test_messages_render_to_the_prompt_and_bad_requests_are_refused() -> None:
    assert render([{"role": "system", "content": "sum"}, {"role": "user", "content": "3+4="}]) == "sum 3+4="
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+1="}, {"type": "image_url"}]}]
    assert render(parts) == "1+1="
    gw = ChatGateway(None, "r", GatewaySettings(max_tokens=8, max_n=4))  # type: ignore[arg-type]  # parsing needs no bus
    ok = {"messages": [{"role": "user", "content": "ab="}]}
    req = gw._parse(ok)
    assert (req.tokens, req.n, req.max_tokens, req.temperature, req.logprobs, req.stream) == (
        gw.tok.encode("ab="),
        1,
        8,
        1.0,
        False,
        False,
    )
    streamed = gw._parse({**ok, "stream": True, "stream_options": {"include_usage": True}, "model": "jetrl"})
    assert streamed.stream and streamed.include_usage
    assert gw._parse({**ok, "max_completion_tokens": 3, "max_tokens": 8}).max_tokens == 3
    assert gw._parse({**ok, "temperature": 1e-300}).temperature == 0.0  # greedy, not a division by ~0
    for bad, why, param in (
        ([], "JSON object", None),
        ({"messages": []}, "non-empty", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role", "messages"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "role", "messages"),
        ({"messages": [{"role": "user", "content": "ABC"}]}, "tokenizer", "messages"),
        ({**ok, "n": 5}, "'n'", "n"),
        ({**ok, "n": True}, "'n'", "n"),
        ({**ok, "max_tokens": 9}, "max_tokens", "max_tokens"),
        ({**ok, "max_tokens": 0}, "max_tokens", "max_tokens"),  # not "the default"
        ({**ok, "temperature": -1}, "temperature", "temperature"),
        ({**ok, "temperature": float("nan")}, "temperature", "temperature"),
        ({**ok, "stream": "yes"}, "boolean", "stream"),
        ({**ok, "stream_options": {"include_usage": True}}, "only allowed", "stream_options"),
        ({**ok, "stream": True, "stream_options": []}, "object", "stream_options"),
        ({**ok, "model": 3}, "string", "model"),
    ):
        with pytest.raises(RequestError, match=why) as err:
            gw._parse(bad)
        assert err.value.status == 400 and err.value.param == param
    with pytest.raises(ApiError, match="does not exist") as missing:
        gw._parse({**ok, "model": "gpt-4o"})
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")


@pytest.mark.slow
async def test_a_live_run_answers_chat_completions(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            # Served until the requests below are answered (Supervisor.end): a step count could
            # end it first (the gateway would then time out, the workers gone); the time budget
            # is a guard.
            *("--trainer.max_steps", "100000", "--trainer.batch_groups", "2", "--run.max_wall_s", "240"),
            *("--inference.workers", "1", "--envs.0.group_size", "4", "--store.recorder", "false"),
            *("--bus.weights_store", "file", "--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
        ],
    )
    run_id = "gw1"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    run = asyncio.create_task(sup.run())
    bus = await Bus.connect(nats_server.url)
    while not (tmp_path / run_id / "nats_url").exists():  # the supervisor has created the run
        await asyncio.sleep(0.1)
    await bus.ensure_run(run_id, cfg.bus.limits())
    gw = ChatGateway(bus, run_id, GatewaySettings(port=0, max_tokens=4, timeout_s=90))
    await gw.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"{gw.url}/chat/completions"
            msgs = [{"role": "user", "content": "3+4="}]
            req = {"model": "jetrl", "messages": msgs, "n": 3, "max_tokens": 2}
            async with http.post(url, json={**req, "logprobs": True}) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            async with http.post(url, json={**req, "n": 100}) as r:
                assert r.status == 400 and "'n'" in (await r.json())["error"]["message"]
            async with http.post(url, data=b"{not json") as r:
                assert r.status == 400
            async with http.get(f"{gw.url}/models") as r:
                assert (await r.json())["data"][0]["id"] == "jetrl"
        assert answer["object"] == "chat.completion" and len(answer["choices"]) == 3
        for c in answer["choices"]:
            text = c["message"]["content"]
            assert c["message"]["role"] == "assistant" and len(text) <= 2
            assert 1 <= len(c["logprobs"]["content"]) <= 2  # one per sampled token (<eos> included)
            assert all(t["logprob"] <= 0.0 for t in c["logprobs"]["content"])
        assert answer["usage"]["prompt_tokens"] == len(gw.tok.encode("3+4="))
        assert (
            answer["usage"]["total_tokens"]
            == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        )
        assert answer["jetrl"]["policy_version"] >= 0 and len(answer["jetrl"]["generation_ids"]) == 3

        # The official client (the dev extra), streaming too, against the training run.
        client = AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
        out = await client.chat.completions.create(
            model="jetrl", messages=[{"role": "user", "content": "1+2="}], max_tokens=2, n=2
        )
        assert len(out.choices) == 2 and out.choices[0].message.role == "assistant"
        stream = await client.chat.completions.create(
            model="jetrl",
            messages=[{"role": "user", "content": "1+2="}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage is not None
        await client.close()
        assert not run.done()  # the run went on, untouched by the gateway
    finally:
        await gw.stop()
        sup.end("the gateway's requests are answered")
        assert await run == 0
    # The request and its answers are facts in the run's log, on the gateway's own subject.
    log = await bus.read_log(run_id)
    await bus.close()
    tasks = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.TaskSubmitted)]
    mine = [t for t in tasks if t.env == "gateway"]
    assert len(mine) >= 1 and mine[0].group_size == 3 and mine[0].prompt_text == "3+4="
    scored = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.RolloutsScored)]
    assert scored, "the run trained beside the gateway"
    assert not [r for r in scored if r.env == "gateway"], "a gateway answer was scored for training"
    # Its answers: one CompletionsGenerated with the request's 3 samples.
    gens = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.CompletionsGenerated)]
    answers = [g for g in gens if g.task_id == mine[0].task_id]
    assert len(answers) == 1 and sorted(s.sample_index for s in answers[0].samples) == [0, 1, 2]
