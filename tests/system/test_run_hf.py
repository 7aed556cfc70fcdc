"""`jetrl run configs/hf-tiny.toml`: a Hugging Face checkpoint through every process.

A tiny Qwen3-MoE checkpoint with a locally trained BPE tokenizer and chat template is made on
the spot and warm-started to call the calculator tool (`jetrl make-hf-tiny`). The run's trainer
and inference worker load it, episodes go multi-turn through the tool (its output a masked
`tool` message of the template), and the last policy version is exported and loaded by
transformers with the same logits as jetrl's model."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.export_cmd import export
from jetrl.deploy.supervisor import Supervisor
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.origin import initial_model
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import load_into, weights_from_bytes
from tests.support.runlog import bodies, read_log, samples, scored_rollouts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


async def test_hf_tiny_run_multi_turn_with_the_tool(
    nats_server: EmbeddedServer, warm_moe_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = warm_moe_ckpt
    tok = HFTokenizer(ckpt)
    cfg = load_config(
        ROOT / "configs" / "hf-tiny.toml",
        [
            f"--model.hf_path={ckpt}",
            f"--trainer.max_steps={STEPS}",
            "--trainer.batch_groups=2",
            "--trainer.checkpoint_every=0",
            "--envs.0.group_size=4",
            "--envs.0.eval_every=2",
            "--envs.0.eval_tasks=4",
            "--envs.0.eval_samples=2",
            "--envs.0.params.max_tokens=24",
            "--bus.max_gib=0.25",
            "--bus.payload_max_gib=0.5",
        ],
    )
    run_id = "hf1"
    run_dir = tmp_path / run_id
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0
    log = await read_log(nats_server.url, run_id)

    steps = bodies(log, ev.StepCompleted)
    assert [s.step for s in steps] == list(range(STEPS))
    assert [p.version for p in bodies(log, ev.PolicyVersionPublished)] == list(range(STEPS + 1))
    scored = Counter(r.rollout_id for _, r in scored_rollouts(log))
    trained = Counter(rid for s in steps for rid in s.rollout_ids)
    assert all(n == 1 for n in scored.values()) and all(n == 1 for n in trained.values())
    assert set(trained) <= set(scored)
    assert not bodies(log, ev.DeadLettered)
    assert bodies(log, ev.RunFinished)[-1].status == "completed"
    # The held-out split was evaluated (version 0 as the baseline) and never trained on.
    evals = bodies(log, ev.EvaluationReported)
    assert evals and evals[0].policy_version == 0 and all(e.n_tasks == 4 and e.samples == 2 for e in evals)
    assert not [b for b in bodies(log, ev.RolloutsScored) if ids.is_eval_task(b.task_id)]

    # Prompts are the chat template's, token for token.
    tasks = bodies(log, ev.TaskSubmitted)
    first = [t for t in tasks if t.turn == 0 and not ids.is_eval_task(t.task_id)]
    assert first and all(t.prompt_text.endswith("<|im_start|>assistant\n") for t in first)
    assert all(t.prompt_tokens == tok.encode(t.prompt_text, bos=False) for t in first)
    # Multi-turn through the tool: turn 1's prompt starts with turn 0's exact tokens and its
    # completion, then the tool's message as the template writes it.
    later = [t for t in tasks if t.turn == 1 and not ids.is_eval_task(t.task_id)]
    assert later, "no episode called the tool"
    bus = await Bus.connect(nats_server.url)
    try:
        payloads = await Payloads.for_run(bus.js, run_id)
        gens = {(g.task_id, s.sample_index): s for g, s in samples(log)}
        for t in later:
            assert t.episode is not None
            origin = next(f for f in first if f.task_id == t.episode_id)
            assert t.prompt_tokens[: len(origin.prompt_tokens)] == origin.prompt_tokens
            g = gens[(origin.task_id, t.episode.sample_index)]
            completion = (await payloads.get_array(g.completion_tokens)).tolist()
            n = len(origin.prompt_tokens)
            assert t.prompt_tokens[n : n + len(completion)] == completion
            reply = t.prompt_tokens[n + len(completion) :]
            assert tok.decode(reply, skip_special=False, stop_at_eos=False).startswith(
                ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>tool\n")
            )
            assert t.prompt_tokens[-3:] == tok.encode("<|im_start|>assistant\n", bos=False)[-3:]
        # The tool's message is in the trained rollout but out of the loss.
        multi = [r for _, r in scored_rollouts(log) if r.turns > 1]
        assert multi and all(r.completion_mask is not None for r in multi)
        for r in multi[:4]:
            assert r.completion_mask is not None
            mask = (await payloads.get_array(r.completion_mask)).tolist()
            assert 0 in mask and mask[0] == 1
            assert "tool_calls" in r.reward_parts

        # Export the last version; transformers loads it, with jetrl's logits.
        out = tmp_path / "export"
        assert await export(nats_server.url, run_id, run_dir, None, out, None) == 0
        last = max(bodies(log, ev.WeightsReady), key=lambda w: w.version)
        tensors, _ = weights_from_bytes(
            await payloads.get_weights(last), expected_checksum=last.weights_checksum
        )
    finally:
        await bus.close()
    ours = initial_model(ModelSettings(hf_path=str(ckpt)))
    load_into(ours, tensors)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    x = torch.tensor([first[0].prompt_tokens[:40]])
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() <= 1e-5
    assert (out / "tokenizer_config.json").is_file()
