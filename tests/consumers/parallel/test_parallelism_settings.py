"""[trainer.parallelism]: the world size, the engine it picks, and what is refused before any
process starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jetrl.consumers.trainer.settings import ParallelismSettings, TrainerSettings


def test_world_size_and_the_engine_it_picks() -> None:
    par = ParallelismSettings(dp_shard=2, dp_replicate=2, ep=2)
    assert (par.world_size, par.dp) == (4, 4)
    assert TrainerSettings().engine_name == "local"
    assert TrainerSettings(parallelism=ParallelismSettings(dp_shard=2)).engine_name == "parallel"
    assert TrainerSettings(engine="pkg.mod:Engine", parallelism=par).engine_name == "pkg.mod:Engine"
    # What a run records (RunStarted's config) is the engine that runs, not "auto".
    assert TrainerSettings(parallelism=ParallelismSettings(dp_shard=2)).model_dump()["engine"] == "parallel"
    assert TrainerSettings.model_validate(TrainerSettings().model_dump()).engine == "local"


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ({"dp_shard": 2, "ep": 3}, "ep = 3 must divide dp_shard"),
        ({"cp": 2}, "context parallel training is not available"),
        ({"dp_shard": 2, "tp": 2}, "tensor parallel training is not wired"),
        ({"dp_shard": 2, "ep": 2, "all_to_all": "deepep"}, "needs Hopper GPUs"),
        ({"dp_shard": 0}, "greater than or equal to 1"),
    ],
)
def test_layouts_refused_with_why(layout: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        ParallelismSettings.model_validate(layout)


def test_a_streaming_trainer_is_refused_where_the_engine_takes_each_batch_at_once() -> None:
    assert TrainerSettings(stream_groups=True).engine_name == "local"
    with pytest.raises(ValidationError, match="stream_groups needs the local engine"):
        TrainerSettings(stream_groups=True, parallelism=ParallelismSettings(dp_shard=2))
    # "auto" (the default) streams only where the engine can: whole batches here, not an error.
    assert TrainerSettings(parallelism=ParallelismSettings(dp_shard=2)).stream_groups == "auto"
