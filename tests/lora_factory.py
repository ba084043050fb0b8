"""Random LoRA adapters in PEFT's format for the tests' tiny transformers models (tests/hf_factory.py): PEFT starts
lora_B at zero, so every lora_B is drawn from a seeded generator, at a scale that moves the logits."""
from __future__ import annotations

from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(base, rank: int = 8, alpha: int = 16, seed: int = 0, rslora: bool = False,
               targets: tuple[str, ...] = TARGETS):
    """`base` (a transformers model) wrapped by PEFT with a random adapter."""
    import peft
    import torch

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5))
    return model.eval()


def write_peft_adapter(base, out: Path, **kwargs) -> Path:
    """A random adapter of `base` saved as PEFT saves one (adapter_config.json, adapter_model.safetensors)."""
    model = peft_model(base, **kwargs)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)
