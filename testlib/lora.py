"""A random LoRA adapter for a model, in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, the two files vLLM's ``--lora-modules`` loads): on the attention's query and
value projections of every layer, large enough that a greedy answer with it differs from the base model's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")


def make_adapter(model_dir: str | Path, out: Path, rank: int = 8, seed: int = 0, scale: float = 0.5) -> Path:
    """Write a random rank-``rank`` adapter for the model in ``model_dir`` to ``out`` (created); return ``out``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * scale
            tensors[f"{name}.lora_B.weight"] = torch.randn(outputs[target], rank, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "modules_to_save": None,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out
