"""`jetrl run configs/smollm2-parity.toml` on the real SmolLM2-135M-Instruct (`make
smollm2`): its own tokenizer and chat template write the prompts, the trainer and the inference
worker load the imported checkpoint, the held-out split is evaluated at version 0 (the pretrained
baseline), and the last version exports to a checkpoint transformers loads with jetrl's logits.
Kept to two small steps: a step of the 135M model takes seconds on two cores."""

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
from tests.support.runlog import bodies, read_log
from tests.support.smollm2 import smollm2_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


async def test_a_short_run_on_smollm2(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    ckpt = smollm2_dir()
    tok = HFTokenizer(ckpt)
    cfg = load_config(
        ROOT / "configs" / "smollm2-parity.toml",
        [
            f"--model.hf_path={ckpt}",
            f"--trainer.max_steps={STEPS}",
            "--trainer.batch_groups=1",
            "--trainer.checkpoint_every=0",
            "--envs.0.eval_every=100",  # version 0 only: the pretrained baseline
            "--envs.0.eval_tasks=4",
            "--envs.0.eval_samples=1",
            "--envs.0.group_size=4",
        ],
    )
    run_id = "smol1"
    run_dir = tmp_path / run_id
    sup = Supervisor(cfg, run_id, run_dir, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0
    log = await read_log(nats_server.url, run_id)

    steps = bodies(log, ev.StepCompleted)
    assert [s.step for s in steps] == list(range(STEPS))
    trained = Counter(rid for s in steps for rid in s.rollout_ids)
    assert len(trained) == STEPS * 4 and all(n == 1 for n in trained.values())
    assert not bodies(log, ev.DeadLettered)
    assert bodies(log, ev.RunFinished)[-1].status == "completed"
    evals = bodies(log, ev.EvaluationReported)
    assert [e.policy_version for e in evals] == [0] and evals[0].n_tasks == 4

    # The model's own ChatML template and tokenizer, token for token.
    tasks = [t for t in bodies(log, ev.TaskSubmitted) if not ids.is_eval_task(t.task_id)]
    assert tasks and all(t.prompt_text.startswith("<|im_start|>") for t in tasks)
    assert all(t.prompt_text.endswith("<|im_start|>assistant\n") for t in tasks)
    assert all(t.prompt_tokens == tok.encode(t.prompt_text, bos=False) for t in tasks)
    bus = await Bus.connect(nats_server.url)
    try:
        payloads = await Payloads.for_run(bus.js, run_id, weights_dir=run_dir / "payloads")
        gens = bodies(log, ev.GenerationCompleted)
        texts = [tok.decode((await payloads.get_array(g.completion_tokens)).tolist()) for g in gens[:4]]
        assert any(any(c.isalpha() for c in t) for t in texts), texts  # words, from a pretrained model

        out = tmp_path / "export"
        assert await export(nats_server.url, run_id, run_dir, None, out, None) == 0
        last = max(bodies(log, ev.WeightsReady), key=lambda w: w.version)
        assert last.version == STEPS
        tensors, _ = weights_from_bytes(
            await payloads.get_bytes(last.location), expected_checksum=last.weights_checksum
        )
    finally:
        await bus.close()
    ours = initial_model(ModelSettings(hf_path=str(ckpt)))
    load_into(ours, tensors)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    x = torch.tensor([tasks[0].prompt_tokens])
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() <= 2e-4  # as tests/policy/test_smollm2.py
    template = (out / "tokenizer_config.json").read_text()
    assert (out / "chat_template.jinja").is_file() or "chat_template" in template
