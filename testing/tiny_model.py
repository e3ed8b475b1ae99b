#!/usr/bin/env python3
"""Write a small Llama-architecture model that vLLM loads from a local directory.

Models cannot be downloaded here (or in CI), so tests and the demo make one: safetensors weights
from a fixed seed, a ``config.json``, and a byte-level tokenizer built with ``tokenizers`` (every
byte is one token, so a 1,000-character prompt is ~1,000 tokens). The output is checked not to be
degenerate: greedy continuations of different prompts must differ, or equality tests between a
connector run and a plain run would prove nothing.

    python scripts/make_tiny_model.py models/tiny-llama --layers 2 --kv-heads 2 --head-size 64

``--sliding-window N`` makes every second layer (1, 3, ...) attend to its last N tokens only
(Llama's ``layer_types``, as Gemma 3 and gpt-oss mix them), so vLLM gives the full-attention and
the sliding-window layers KV-cache groups of their own.

``--family deepseek_v2`` writes a DeepSeek-V2 instead (MLA attention: one latent KV of
``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 per token, the dims vLLM's CPU kernel takes),
through transformers' own model class, randomly initialised from the seed (not checked by the
Llama reference forward below).

``--family qwen3_next`` writes a Qwen3-Next (a gated delta-net hybrid: three linear-attention
layers, whose KV cache is a recurrent state, then one full-attention layer; a few experts),
also through transformers' class. vLLM's CPU build runs it in bf16 only, with linear-attention
head dims of 128 (smaller ones are refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: 256 byte tokens after the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_weights(cfg: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    # Large-ish init (not the usual 0.02) so logits are peaked and depend on the whole context.
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab, h, scale=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(vocab, h, scale=h**-0.5 * 4),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = rand(nq * hd, h, scale=h**-0.5 * 2)
        w[p + "self_attn.k_proj.weight"] = rand(nkv * hd, h, scale=h**-0.5 * 2)
        w[p + "self_attn.v_proj.weight"] = rand(nkv * hd, h, scale=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = rand(h, nq * hd, scale=(nq * hd) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h, scale=h**-0.5)
        w[p + "mlp.up_proj.weight"] = rand(inter, h, scale=h**-0.5)
        w[p + "mlp.down_proj.weight"] = rand(h, inter, scale=inter**-0.5)
    return w


def greedy_continuation(w: dict[str, torch.Tensor], cfg: dict, ids: list[int], n: int) -> list[int]:
    """A tiny fp32 reference forward (no KV cache) used only to reject degenerate weights."""
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    f = {k: v.float() for k, v in w.items()}
    ids = list(ids)
    for _ in range(n):
        x = f["model.embed_tokens.weight"][torch.tensor(ids)]
        t = x.shape[0]
        pos = torch.arange(t, dtype=torch.float32)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(pos, inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rope(q: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            q1, q2 = q[..., : hd // 2], q[..., hd // 2 :]
            return q * cos + torch.cat([-q2, q1], -1) * sin

        def norm(v: torch.Tensor) -> torch.Tensor:
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            hn = norm(x)
            q = (hn @ f[p + "self_attn.q_proj.weight"].T).view(t, nq, hd).transpose(0, 1)
            k = (hn @ f[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
            v = (hn @ f[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
            q, k = rope(q), rope(k)
            k = k.repeat_interleave(nq // nkv, 0)
            v = v.repeat_interleave(nq // nkv, 0)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(0, 1).reshape(t, -1) @ f[p + "self_attn.o_proj.weight"].T
            hn = norm(x)
            g = torch.nn.functional.silu(hn @ f[p + "mlp.gate_proj.weight"].T)
            x = x + (g * (hn @ f[p + "mlp.up_proj.weight"].T)) @ f[p + "mlp.down_proj.weight"].T
        logits = norm(x[-1]) @ f["lm_head.weight"].T
        ids.append(int(logits.argmax()))
    return ids[-n:]


def write_deepseek_v2(out_dir: Path, *, layers: int, hidden: int, seed: int, dtype: str) -> None:
    """A DeepSeek-V2 with MLA attention and dense MLPs (no experts), saved by transformers."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=384,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=layers,  # every layer dense: no experts to route
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        # large-ish init (not 0.02) so logits are peaked and depend on the whole context
        initializer_range=0.2,
    )
    save_random(DeepseekV2ForCausalLM, cfg, out_dir, seed=seed, dtype=dtype)


def save_random(model_class: Any, cfg: Any, out_dir: Path, *, seed: int, dtype: str) -> None:
    """A transformers model of ``cfg``, initialised from ``seed``, saved in ``dtype``."""
    torch.manual_seed(seed)
    model = model_class(cfg)
    # (transformers wraps .to in a decorator mypy cannot follow)
    torch.nn.Module.to(model, _DTYPES[dtype])
    model.save_pretrained(out_dir, safe_serialization=True)


def write_qwen3_next(out_dir: Path, *, layers: int, seed: int, dtype: str) -> None:
    """A Qwen3-Next: every fourth layer full attention, the others gated delta-net."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,  # vLLM's CPU kernel refuses smaller ones
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        # large-ish init (not 0.02) so logits are peaked and depend on the whole context
        initializer_range=0.2,
    )
    save_random(Qwen3NextForCausalLM, cfg, out_dir, seed=seed, dtype=dtype)


def make_model(
    out_dir: Path,
    *,
    layers: int = 2,
    kv_heads: int = 2,
    q_heads: int = 4,
    head_size: int = 64,
    dtype: str = "float32",
    seed: int = 0,
    max_len: int = 4096,
    sliding_window: int | None = None,
    family: str = "llama",
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = 384  # 259 used tokens, padded
    hidden = q_heads * head_size
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": q_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if sliding_window:
        cfg["sliding_window"] = sliding_window
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 else "full_attention" for i in range(layers)
        ]
    if family == "deepseek_v2":
        write_deepseek_v2(out_dir, layers=layers, hidden=hidden, seed=seed, dtype=dtype)
    elif family == "qwen3_next":
        write_qwen3_next(out_dir, layers=layers, seed=seed, dtype=dtype)
    else:
        weights = make_weights(cfg, seed, _DTYPES[dtype])
        prompts = ["The quick brown fox", "Redis keeps the cache", "0123456789"]
        outs = [greedy_continuation(weights, cfg, tok.encode(p).ids, 8) for p in prompts]
        if len({tuple(o) for o in outs}) < len(outs) or any(len(set(o)) < 2 for o in outs):
            raise SystemExit(
                f"degenerate model (seed {seed}): continuations {outs}; try another seed"
            )
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": max_len,
                "add_bos_token": False,
                "chat_template": (
                    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}"
                ),
            },
            indent=2,
        )
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2)
    )
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64, help="CPU attention needs 32/64/80/...")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sliding-window", type=int, default=None, help="odd layers see only this many tokens"
    )
    ap.add_argument("--family", choices=["llama", "deepseek_v2", "qwen3_next"], default="llama")
    args = ap.parse_args(argv)
    path = make_model(
        args.out_dir,
        layers=args.layers,
        kv_heads=args.kv_heads,
        q_heads=args.q_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        seed=args.seed,
        sliding_window=args.sliding_window,
        family=args.family,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
