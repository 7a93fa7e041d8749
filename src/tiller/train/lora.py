"""LoRA through peft (`model.lora`): the policy trains low-rank adapters on a frozen base.

On each targeted linear layer (weight W, [out, in]) peft adds A [r, in] and B [out, r], B
starting at 0, and the layer computes

    y = x W^T + (alpha / r) (x A^T) B^T = x (W + (alpha / r) B A)^T,

so only A and B get gradients and optimizer state. Three models share one set of base
weights, never a second copy of them:
- the policy the trainer steps: peft's model around the loaded one (`Lora.policy`);
- the KL reference: the same model with its adapters off (`peft`'s `disable_adapter`, used by
  `PolicyTrainer`'s reference pass): log pi_ref = log pi_base exactly;
- what the engine, weight sync, evaluation and the saved checkpoint read (`Lora.merged`): a
  plain model of the loaded class whose tensors are the base's own, except each targeted
  weight, which holds W + (alpha / r) B A and is recomputed after every optimizer step
  (`Lora.merge`). The engine therefore gets merged weights: a weight sync moves the whole
  model, not the adapter (peft's merge is not used: merging into W and unmerging after would
  round W a little at every step).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tiller.config import LoRAConfig
from tiller.engine.updates import WeightUpdate
from tiller.errors import ConfigError, require_package
from tiller.train.trainer import PolicyTrainer

ADAPTER = "default"  # peft's name for a model's one adapter


def require_peft() -> ModuleType:
    """The peft package, or one line naming the extra that installs it."""
    return require_package("peft", "lora", "config field model.lora",
                           instead="set model.lora=null")


class Lora:
    """The policy under LoRA: `policy` (peft's model around `model`, which it changes in
    place; only the `lora_` tensors train) and `merged` (a plain model of `model`'s class
    sharing its base tensors, each targeted weight merged), see the module docstring."""

    def __init__(self, model: nn.Module, cfg: LoRAConfig):
        peft = require_peft()
        from peft.tuners.lora import LoraLayer
        from peft.utils.error import NoMatchingPeftModuleError

        plain = model.state_dict()  # the base tensors under their plain names
        buffers = {k: b for k, b in model.named_buffers() if k not in plain}  # rotary inv_freq
        config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                 target_modules=cfg.target_modules, task_type="CAUSAL_LM")
        try:
            self.policy = peft.get_peft_model(model, config)  # freezes every base tensor
        except NoMatchingPeftModuleError as e:
            raise ConfigError(f"config field model.lora.target_modules: got "
                              f"{cfg.target_modules!r}; no layer of the model matches") from e
        # each targeted layer (peft's LoRA linear) by the plain name of its weight
        self.layers = {f"{name}.weight": module for name, module in model.named_modules()
                       if isinstance(module, LoraLayer)}
        with torch.device("meta"):
            self.merged = type(model)(model.config)
        tensors = {k: t.clone() if k in self.layers else t for k, t in plain.items()}
        self.merged.load_state_dict(tensors, assign=True, strict=True)
        for name, buffer in buffers.items():
            owner, _, leaf = name.rpartition(".")
            self.merged.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
        self.merged.generation_config = model.generation_config
        self.merged.eval().requires_grad_(False)
        self.merge()

    @torch.no_grad()
    def merge(self) -> None:
        """Each targeted weight of `merged` := W + (alpha / r) B A (peft's `get_delta_weight`)
        at the adapters' current values."""
        own = self.merged.state_dict()
        for name, layer in self.layers.items():
            own[name].copy_(layer.base_layer.weight + layer.get_delta_weight(ADAPTER))

    def save(self, folder: Path) -> None:
        """The adapter as peft saves it (adapter_config.json, adapter_model.safetensors)."""
        self.policy.save_pretrained(folder, safe_serialization=True)

    def load(self, folder: Path) -> None:
        """The adapter `save` wrote into the policy, then `merged` recomputed; every adapter
        tensor must be in the file."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        saved = json.loads((folder / "adapter_config.json").read_text())
        ours = self.policy.peft_config[ADAPTER]
        if (saved["r"], saved["lora_alpha"]) != (ours.r, ours.lora_alpha):
            raise ConfigError(f"adapter {folder}: r={saved['r']}, alpha={saved['lora_alpha']}; "
                              f"model.lora has r={ours.r}, alpha={ours.lora_alpha}")
        result = set_peft_model_state_dict(self.policy,
                                           load_file(folder / "adapter_model.safetensors"))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ConfigError(f"adapter {folder} does not fit the model: missing "
                              f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")
        self.merge()

    def trainable(self) -> int:
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)


class MergedView:
    """What weight sync reads under LoRA (a `weight_sync.Publisher`): the merged model at the
    trainer's version; the parity probe is scored by the policy itself (adapters on)."""

    def __init__(self, trainer: LoraTrainer):
        self.trainer, self.model = trainer, trainer.lora.merged

    @property
    def version(self) -> int:
        return self.trainer.version

    def score(self, token_ids: list[int]) -> list[float]:
        return self.trainer.score(token_ids)


class LoraTrainer(PolicyTrainer):
    """The policy trainer over `lora.policy`: the optimizer holds the adapters only; after
    every optimizer step `lora.merged` is recomputed, so the engine, the saved checkpoint and
    evaluation see the policy just trained."""

    def __init__(self, lora: Lora, **options: Any):
        super().__init__(lora.policy, **options)
        self.lora = lora
        self.view = MergedView(self)

    @property
    def publisher(self) -> MergedView:
        return self.view

    def weight_update(self) -> WeightUpdate:
        return WeightUpdate.full(self.lora.merged, self.version)

    def _step(self, max_grad_norm: float) -> float:
        norm = super()._step(max_grad_norm)
        self.lora.merge()
        return norm
