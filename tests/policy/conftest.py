import pytest
import torch

from jetrl.policy.models import build_model, get_config
from jetrl.policy.tokenizer import CharTokenizer


@pytest.fixture(scope="session")
def tok() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def cfg():
    return get_config("tiny-moe")


@pytest.fixture
def model(cfg):
    return build_model(cfg, seed=0)


@pytest.fixture
def trained_model(cfg):
    """A tiny MoE nudged away from init so routers make non-trivial choices."""
    m = build_model(cfg, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, cfg.vocab_size, (8, 12), generator=g)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m
