"""Generation with Hugging Face ``generate``: the reference engine (slow, simple, exact).

Log-probs: a last logits processor (``_LogProbRecorder``) sees, per step, the scores after every
other processor, i.e. ``logits / temperature`` with top-k and then top-p filtered tokens at -inf. Their
``log_softmax`` at the sampled token is the log-probability under the distribution the token was
actually drawn from ("processed" log-probs, the same quantity vLLM reports with
``logprobs_mode="processed_logprobs"``). Greedy decoding applies no warper, so its log-probs are
those of the raw ``softmax(logits)``. Only one step's (B, vocab) scores are held at a time.

Stopping: one stopping criterion handles eos / ``stop_token_ids`` / ``stop`` strings and records the
step at which each row stopped, so the response lengths come from generation itself, not from
guessing where padding starts (the model may legitimately sample the pad token).

Shared prompts (``rollout.share_prompt``, on by default): rows that repeat a prompt (a group's n
samples) prefill it once, and ``generate`` starts from their copied cache (``rlcore.engines.shared_prompt``);
it samples what the unshared path samples, from the same scores in the same order.

Randomness: a call with ``settings.seed`` samples under a torch RNG state seeded from (that seed,
rank, repeat count) (``rlcore.engines.seeding.CallSeeds``): the same call gives the same samples
whatever was generated before it, which is what makes a resumed run repeat an uninterrupted one.
A call without a seed draws from a private RNG stream seeded with ``rollout.seed + rank``. Either
way a colocated actor's RNG state is neither consumed nor reset by rollouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlcore.algos.consistency import Fingerprint, tensor_fingerprint
from rlcore.engines.base import Engine, Generation, RolloutConfig, SamplingSettings, check_weight_names
from rlcore.engines.probe import hf_probe_log_probs
from rlcore.engines.routing import assemble_hf_routing
from rlcore.engines.seeding import CallSeeds
from rlcore.engines.shared_prompt import shared_prefill
from rlcore.models.config import ModelConfig, torch_dtype
from rlcore.models.moe import RoutingRecorder, is_moe


class _StopRecorder(StoppingCriteria):
    """Marks rows done at a stop token or at the token completing a stop string; remembers when."""

    def __init__(self, prompt_len: int, batch_size: int, stop_ids: list[int], stop_strings: tuple[str, ...],
                 tokenizer, device: torch.device) -> None:
        self.prompt_len = prompt_len
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self.stop_strings = stop_strings
        self.tokenizer = tokenizer
        self.lengths = torch.full((batch_size,), -1, dtype=torch.long)  # -1: still running

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_len  # tokens generated so far
        done = torch.isin(input_ids[:, -1], self.stop_ids).cpu()
        running = self.lengths < 0
        if self.stop_strings:
            for row in torch.nonzero(running & ~done).flatten().tolist():
                # Same text vLLM checks: the generated part only, special tokens skipped.
                text = self.tokenizer.decode(input_ids[row, self.prompt_len:], skip_special_tokens=True)
                done[row] = any(s in text for s in self.stop_strings)
        self.lengths[running & done] = step
        return (~(self.lengths < 0)).to(input_ids.device)


class _LogProbRecorder(LogitsProcessor):
    """The sampled tokens' log-probs (and top log-probs), step by step, holding one step's scores.

    Passed to ``generate`` as the last logits processor, it sees each step's scores after the
    temperature / top-k / top-p warpers: the distribution the next token is drawn from. That token
    is known at the next call (the last column of ``input_ids``), or for the last step from the
    finished sequences (``finish``). ``output_scores=True`` would keep every step's (B, vocab)
    scores until ``generate`` returns: at a real vocabulary (49k) and 128 steps of 128 rows, 3.2 GB.
    """

    def __init__(self, top_logprobs: int) -> None:
        self.top_logprobs = top_logprobs
        self.log_probs: list[torch.Tensor] = []  # per finished step, (B,)
        self.top: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step, ((B, k) ids, (B, k) log-probs)
        self._last: torch.Tensor | None = None  # the latest step's (B, vocab) log-probs

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self._take(input_ids[:, -1])
        self._last = torch.log_softmax(scores.float(), dim=-1)
        if self.top_logprobs:
            values, ids = self._last.topk(self.top_logprobs, dim=-1)
            self.top.append((ids, values))
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.log_probs.append(self._last.gather(-1, tokens[:, None]).squeeze(-1))
        self._last = None

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probs, given the generated tokens (B, steps)."""
        if self._last is not None:
            self._take(tokens[:, len(self.log_probs)])
        return torch.stack(self.log_probs, dim=1) if self.log_probs else tokens.new_zeros(tokens.shape, dtype=torch.float32)


class _RngStream:
    """A torch RNG state of our own, swapped in around each ``generate`` call."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        with torch.random.fork_rng(devices=self._cuda_devices()):
            torch.manual_seed(seed)
            self.state = self._get()

    def _cuda_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _get(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def run(self, fn, *args, seed: int | None = None, **kwargs):
        """``fn`` under the stream's state, advancing it; with ``seed``, under a state fresh from that
        seed instead, leaving the stream as it was. The caller's global state is restored either way."""
        with torch.random.fork_rng(devices=self._cuda_devices()):
            if seed is None:
                cpu, cuda = self.state
                torch.set_rng_state(cpu)
                if cuda is not None:
                    torch.cuda.set_rng_state(cuda, self.device)
            else:
                torch.default_generator.manual_seed(seed)
                if self.device.type == "cuda":
                    with torch.cuda.device(self.device):
                        torch.cuda.manual_seed(seed)
            out = fn(*args, **kwargs)
            if seed is None:
                self.state = self._get()
        return out


class HFEngine(Engine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0) -> None:
        self.device = torch.device(device)
        dtype = torch_dtype(rollout_cfg.dtype or model_cfg.dtype, "rollout.dtype")
        path = model_cfg.require_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"the tokenizer of {path} has no eos_token_id; rollouts could never stop")
        self.model_eos_ids = _as_list(self.model.generation_config.eos_token_id)
        # A clean generation config: the checkpoint's own sampling defaults (temperature, top_k,
        # repetition_penalty, ...) must not silently differ from what the vLLM backend applies. Stop
        # ids are passed on every call (none at all under ignore_eos).
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id, bos_token_id=self.tokenizer.bos_token_id)
        self.rng = _RngStream(rollout_cfg.seed + rank, self.device)
        self.call_seeds = CallSeeds(rank)
        self.record_routing = rollout_cfg.record_routing and is_moe(self.model)  # dense models: nothing to record
        self.share_prompt = rollout_cfg.share_prompt

    def stop_token_ids(self, settings: SamplingSettings) -> list[int]:
        eos = set() if settings.ignore_eos else {self.eos_token_id, *self.model_eos_ids}
        return sorted(eos | set(settings.stop_token_ids))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 settings: SamplingSettings) -> Generation:
        bsz, prompt_len = input_ids.shape
        stop_ids = self.stop_token_ids(settings)
        recorder = _StopRecorder(prompt_len, bsz, stop_ids, settings.stop, self.tokenizer, self.device)
        scores = _LogProbRecorder(settings.top_logprobs)
        processors = LogitsProcessorList([] if settings.greedy else sampling_warpers(settings))
        processors.append(scores)
        config = generation_config(settings, stop_ids, self.pad_token_id)
        seeded = settings.seed is not None and not settings.greedy
        input_ids, attention_mask, position_ids = (t.to(self.device) for t in (input_ids, attention_mask, position_ids))
        # The rows of one prompt share its prefill (rlcore.engines.shared_prompt); routing records every
        # row's own forward, so it keeps the unshared path.
        shared = None
        if self.share_prompt and not self.record_routing:
            shared = shared_prefill(self.model, input_ids, attention_mask, position_ids)
        routing = RoutingRecorder(self.model) if self.record_routing else None
        try:
            out = self.rng.run(
                self.model.generate,
                seed=self.call_seeds.next(settings.seed) if seeded else None,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([recorder]),
                logits_processor=processors,
                **({} if shared is None else {"past_key_values": shared}),
            )
        finally:
            if routing is not None:
                routing.remove()
        tokens = out.sequences[:, prompt_len:]
        steps = tokens.shape[1]
        log_probs = scores.finish(tokens)
        lengths = torch.where(recorder.lengths < 0, steps, recorder.lengths)
        width = settings.max_new_tokens
        top_ids = top_log_probs = None
        if settings.top_logprobs:
            pad = (0, 0, 0, width - steps)
            top_ids = torch.nn.functional.pad(torch.stack([i for i, _ in scores.top], 1).cpu(), pad, value=self.pad_token_id)
            top_log_probs = torch.nn.functional.pad(torch.stack([v for _, v in scores.top], 1).cpu(), pad, value=0.0)
        return Generation(
            responses=torch.nn.functional.pad(tokens.cpu(), (0, width - steps), value=self.pad_token_id),
            lengths=lengths,
            log_probs=torch.nn.functional.pad(log_probs.cpu(), (0, width - steps), value=0.0),
            top_ids=top_ids,
            top_log_probs=top_log_probs,
            routed_experts=None if routing is None else assemble_hf_routing(routing.calls, bsz, prompt_len, width),
        )

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        check_weight_names(set(self.model.state_dict()), state_dict)
        self.load_partial(state_dict.items())

    def weight_checksums(self) -> dict[str, Fingerprint]:
        return {name: tensor_fingerprint(t) for name, t in self.model.state_dict().items()}

    def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any]:
        return hf_probe_log_probs(self.model, ids, self.device)

    @torch.no_grad()
    def load_partial(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy some of the weights in place (one bucket of a streamed update); unknown names are an error."""
        params = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of the rollout model")
            params[name].copy_(tensor)


def generation_config(settings: SamplingSettings, stop_ids: list[int], pad_token_id: int) -> GenerationConfig:
    """HF's config for one ``generate`` call. The warpers are ours (``sampling_warpers``, in HF's order:
    temperature, top-k, top-p), so that the log-prob recorder can run after them: HF puts a caller's
    processors before its own warpers. When sampling, the config therefore asks for none (temperature 1,
    top_k 0: left unset, HF would fill in its default of 50); when greedy it names no sampling flag at
    all, since HF warns of each one a greedy config sets ("generation flags are not valid ... ['top_k']")."""
    sampling = {} if settings.greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    return GenerationConfig(do_sample=not settings.greedy, **sampling, max_new_tokens=settings.max_new_tokens,
                            eos_token_id=stop_ids or None, pad_token_id=pad_token_id, return_dict_in_generate=True)


def sampling_warpers(settings: SamplingSettings) -> list[LogitsProcessor]:
    """HF's sampling warpers for ``settings``, as ``generate`` itself would build them."""
    warpers: list[LogitsProcessor] = []
    if settings.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k and settings.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=settings.top_k, min_tokens_to_keep=1))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=settings.top_p, min_tokens_to_keep=1))
    return warpers


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
