"""Online DPO over three worker groups, written the way verl's tutorial "Extend to other RL(HF)
algorithms" (verl docs, advance/dpo_extension.rst) writes it, and run on rlcore.

The tutorial's shape is kept: workers are ``@ray.remote`` classes deriving ``Worker``; a
``@ray.remote(num_cpus=1)`` main task puts a sample generator, a reference policy and a DPO actor
into one ``RayResourcePool`` with ``RayClassWithInitArgs`` / ``RayWorkerGroup``; the reference policy's
``infer`` uses a dict dispatch mode written to verl's signatures; the first step also calls the
generator rank by rank through ``worker_group._workers[i].generate_sequences.remote(d)``, as the
tutorial's "underlying calling process" does. Only the import lines differ from a verl script:

    from verl.single_controller.base import Worker                   -> from rlcore.single_controller import Worker
    from verl.single_controller.ray import RayWorkerGroup, ...       -> from rlcore.single_controller import RayWorkerGroup, ...
    from verl.single_controller.base.decorator import register, ...  -> from rlcore.single_controller import register, ...
    from verl import DataProto                                       -> from rlcore import DataProto

The model is rlcore's tiny character-level Llama (built locally, nothing downloaded); the verifier
is a rule (a response scores the sum of its characters' code points), so the preference is learnable.

    python examples/verl_online_dpo.py --steps 4
"""

from __future__ import annotations

import argparse
import math
import tempfile

import numpy as np
import ray
import torch
import torch.distributed
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import DataProto  # verl: from verl import DataProto
from rlcore.algos import compute_dpo_loss
from rlcore.models import build_tiny_model
from rlcore.single_controller import Dispatch, register  # verl: verl.single_controller.base.decorator
from rlcore.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # verl.single_controller.ray
from rlcore.single_controller import Worker  # verl: from verl.single_controller.base import Worker


def sequence_log_probs(model, data: DataProto) -> torch.Tensor:
    """Summed log-probability of each row's response tokens, (B,)."""
    responses, mask = data.batch["responses"], data.batch["response_mask"]
    logits = model(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"]).logits
    logits = logits[:, -responses.shape[1] - 1 : -1].float()
    token_logps = torch.gather(F.log_softmax(logits, dim=-1), -1, responses.unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1)


# ----------------------------------------------------------------------------- Step 1: the workers
@ray.remote
class SampleGenerator(Worker):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(config["model_path"]).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(config["model_path"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """n samples per prompt (adjacent), each ``max_new_tokens`` long, seeded by step and rank."""
        n, length = self.config["n"], self.config["max_new_tokens"]
        torch.manual_seed(self.config["seed"] + 1000 * data.meta_info["step"] + self.rank)
        prompts = data.batch["input_ids"].repeat_interleave(n, 0)
        prompt_mask = data.batch["attention_mask"].repeat_interleave(n, 0)
        with torch.no_grad():
            out = self.model.generate(input_ids=prompts, attention_mask=prompt_mask, do_sample=True, max_new_tokens=length,
                                      min_new_tokens=length, pad_token_id=self.tokenizer.pad_token_id)
        responses = out[:, prompts.shape[1]:]  # min_new_tokens: every response has the full length, no eos
        response_mask = torch.ones_like(responses)
        return DataProto.from_dict(
            {"prompts": prompts, "responses": responses, "response_mask": response_mask,
             "input_ids": torch.cat([prompts, responses], -1), "attention_mask": torch.cat([prompt_mask, response_mask], -1)},
            {"uid": np.repeat(data.non_tensor_batch["uid"], n),
             "response_text": self.tokenizer.batch_decode(responses, skip_special_tokens=True)},
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, state_dict):
        self.model.load_state_dict(state_dict)


def dispatch_data(worker_group, data):
    return (data.chunk(worker_group.world_size),), {}


def collect_data(worker_group, outputs):
    return torch.cat(outputs)


@ray.remote
class ReferencePolicy(Worker):
    def __init__(self, config):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(config["model_path"]).eval()

    @register(dispatch_mode={"dispatch_fn": dispatch_data, "collect_fn": collect_data})
    def infer(self, data):
        with torch.no_grad():
            return sequence_log_probs(self.model, data)


def join_process_group():
    """gloo over env://: the group set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A function of its
    own because cloudpickle, shipping a class defined in a script by value, would take
    ``torch.distributed`` + ``config`` in one function's names for the unpicklable module
    ``torch.distributed.config``."""
    torch.distributed.init_process_group("gloo")


@ray.remote
class DPOActor(Worker):
    def __init__(self, config):
        super().__init__()
        self.config = config
        join_process_group()
        self.model = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(config["model_path"]))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config["lr"])

    def _loss(self, data):
        """Rows come as (chosen, rejected) pairs, adjacent."""
        logps, ref = sequence_log_probs(self.model, data), data.batch["ref_log_prob"]
        return compute_dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=self.config["beta"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update(self, data: DataProto) -> DataProto:
        self.optimizer.zero_grad()
        loss, metrics = self._loss(data)
        loss.backward()  # DDP averages the gradients of the ranks
        self.optimizer.step()
        return DataProto(meta_info={"metrics": {"dpo/loss": loss.item(), **metrics}})  # merged across ranks on concat

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def compute_loss(self, data: DataProto) -> float:
        with torch.no_grad():
            return self._loss(data)[0].item()

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def get_weights(self):
        return {k: v.detach().clone() for k, v in self.model.module.state_dict().items()}


# ----------------------------------------------------------------------------- Step 3: the driver
def make_prompts(tokenizer, batch_size: int, step: int, seed: int) -> DataProto:
    rng = np.random.default_rng((seed, step))
    texts = [f"{a}+{b}=" for a, b in rng.integers(0, 50, size=(batch_size, 2))]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                               {"uid": [f"{step}-{i}" for i in range(batch_size)]}, {"step": step})


def generate_scores(data: DataProto) -> DataProto:
    """The verifier, a rule: a response scores the sum of its characters' code points. A stand-in every
    step agrees on (later letters beat digits and signs), so the preference carries across batches,
    and ties are rare."""
    data.non_tensor_batch["score"] = np.array([sum(map(ord, t)) for t in data.non_tensor_batch["response_text"]])
    return data


def generate_pairwise_data(data: DataProto, n: int) -> DataProto:
    """Of each prompt's n samples, the best and the worst as an adjacent (chosen, rejected) pair (on a
    tie the earlier sample is chosen)."""
    ranked = np.argsort(-data.non_tensor_batch["score"].reshape(-1, n), axis=1, kind="stable")
    pairs = ranked[:, [0, -1]] + n * np.arange(len(ranked))[:, None]
    data.reorder(torch.from_numpy(pairs.reshape(-1)))  # in place, as in verl
    return data


@ray.remote(num_cpus=1)
def main_task(config):
    resource_pool = RayResourcePool(process_on_nodes=[config["nprocs"]], use_gpu=False, max_colocate_count=3,
                                    name_prefix="online_dpo")
    ray_cls = RayClassWithInitArgs(SampleGenerator, config=config)
    sample_gen = RayWorkerGroup(resource_pool, ray_cls, device_name="cpu")

    ray_cls = RayClassWithInitArgs(ReferencePolicy, config=config)
    ref_policy = RayWorkerGroup(resource_pool, ray_cls, device_name="cpu")

    ray_cls = RayClassWithInitArgs(DPOActor, config=config)
    dpo_policy = RayWorkerGroup(resource_pool, ray_cls, device_name="cpu")

    tokenizer = AutoTokenizer.from_pretrained(config["model_path"])
    history, first_batch = [], None
    for step in range(1, config["steps"] + 1):
        prompts = make_prompts(tokenizer, config["batch_size"], step, config["seed"])
        data = sample_gen.generate_sequences(prompts)
        if step == 1:  # the same call by hand, rank by rank, through the actor handles
            chunks = prompts.chunk(sample_gen.world_size)
            by_hand = DataProto.concat(ray.get([sample_gen._workers[i].generate_sequences.remote(d)
                                                for i, d in enumerate(chunks)], timeout=300))
            assert torch.equal(by_hand.batch["input_ids"], data.batch["input_ids"])
        data = generate_scores(data)
        data = generate_pairwise_data(data, config["n"])
        data.batch["ref_log_prob"] = ref_policy.infer(data)
        output = dpo_policy.update(data)
        metrics = {k: float(np.mean(v)) for k, v in output.meta_info["metrics"].items()}
        metrics["dpo/loss_after_update"] = float(np.mean(dpo_policy.compute_loss(data)))
        metrics["ranks_reporting"] = len(output.meta_info["metrics"]["dpo/loss"])
        history.append(metrics)
        sample_gen.load_weights(dpo_policy.get_weights())
        if first_batch is None:
            first_batch = data
        print(f"step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
    first_batch_loss_end = float(np.mean(dpo_policy.compute_loss(first_batch)))
    for wg in (sample_gen, ref_policy, dpo_policy):
        wg.shutdown()
    resource_pool.shutdown()
    return {"history": history, "first_batch": first_batch, "first_batch_loss_end": first_batch_loss_end}


def default_config(model_path: str, steps: int = 4) -> dict:
    return {"model_path": model_path, "nprocs": 2, "n": 2, "max_new_tokens": 6, "batch_size": 8, "lr": 3e-3,
            "beta": 0.5, "seed": 0, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    config = default_config(build_tiny_model(tempfile.mkdtemp(), seed=0), args.steps)
    result = ray.get(main_task.remote(config), timeout=1200)
    first, last = result["history"][0], result["history"][-1]
    print(f"DPO loss on the first step's pairs: {first['dpo/loss']:.4f} (log 2 = {math.log(2):.4f}) -> "
          f"{result['first_batch_loss_end']:.4f} after {args.steps} steps; last step's reward margin "
          f"{last['dpo/reward_margin']:.4f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
