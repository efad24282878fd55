"""Sampling seeds are derived, not drawn: each prompt batch's seed is a function of (trainer.seed, the
batch's index in the run), so a resumed run hands its engines the seeds an uninterrupted one did;
``trainer.deterministic`` switches torch's deterministic algorithms on."""

import torch

from rlcore.engines.seeding import CallSeeds, derive_seed
from rlcore.trainer.builder import Workers
from rlcore.trainer.config import load_config
from rlcore.trainer.loop import TrainingRun


class NoGroup:
    def shutdown(self):
        pass


class Loader:
    """An endless loader of 3 batches an epoch whose state is the number of batches handed out."""

    def __init__(self, drawn: int = 0) -> None:
        self.drawn = drawn

    def __len__(self):
        return 3

    def __iter__(self):
        while True:
            self.drawn += 1
            ones = torch.ones(2, 3, dtype=torch.long)
            yield {"input_ids": ones, "attention_mask": ones, "position_ids": torch.arange(3).repeat(2, 1)}, {}

    def state_dict(self):
        return {"epoch": self.drawn // 3, "position": self.drawn % 3}

    def load_state_dict(self, state):
        self.drawn = state["epoch"] * 3 + state["position"]


def start(tmp_path, loader, **trainer) -> TrainingRun:
    cfg = load_config({"trainer": {"output_dir": str(tmp_path), "loggers": ["jsonl"], "val_freq": 0, **trainer}},
                      ["trainer"])
    return TrainingRun(cfg, Workers(group=NoGroup()), loader, validate=dict)


def test_each_prompt_batch_carries_a_seed_derived_from_the_run_seed_and_its_index(tmp_path):
    with start(tmp_path / "a", Loader(), seed=5) as run:
        seeds = [run.next_prompts().meta_info["seed"] for _ in range(5)]  # across an epoch boundary
    assert seeds == [derive_seed(5, k) for k in range(5)]
    assert len(set(seeds)) == 5 and all(0 <= s < 2**63 for s in seeds)
    with start(tmp_path / "b", Loader(drawn=2), seed=5) as run:  # a loader restored at batch 2
        assert run.next_prompts().meta_info["seed"] == seeds[2]
    with start(tmp_path / "c", Loader(), seed=6) as run:
        assert run.next_prompts().meta_info["seed"] != seeds[0]


def test_call_seeds_count_repeats_of_one_seed_and_restart_at_another():
    a, b = CallSeeds(rank=0), CallSeeds(rank=0)
    got = [a.next(s) for s in (7, 7, 8, 7)]
    assert got == [derive_seed(7, 0, 0), derive_seed(7, 0, 1), derive_seed(8, 0, 0), derive_seed(7, 0, 0)]
    assert b.next(7) == got[0] and CallSeeds(rank=1).next(7) != got[0]


def test_deterministic_mode_switches_torch_deterministic_algorithms_on(tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        with start(tmp_path, Loader(), deterministic=True):
            assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
