"""LoRA through peft (`model.lora`): the policy trains low-rank adapters on a frozen base.

On each targeted linear layer (weight W, [out, in]) peft adds A [r, in] and B [out, r], B
starting at 0, and the layer computes

    y = x W^T + (alpha / r) (x A^T) B^T = x (W + (alpha / r) B A)^T,

so only A and B get gradients and optimizer state. Three models share one set of base
weights, never a second copy of them:
- the policy the trainer steps: peft's model around the loaded one (`Lora.policy`), its
  adapter peft's "default";
- the KL reference: the policy as it was when RL started (after SFT, like full fine-tuning's
  copy), as a second, frozen adapter "reference" on the same layers holding a copy of the
  adapter's A and B then (`Lora.freeze_reference`); the reference pass switches to it
  (`Lora.reference`), so log pi_ref = log pi at RL start exactly, for the adapter's memory;
- what the engine, weight sync, evaluation and the saved checkpoint read (`Lora.merged`): a
  plain model of the loaded class whose tensors are the base's own, except each targeted
  weight, which holds W + (alpha / r) B A and is recomputed after every optimizer step
  (`Lora.merge`). The engine therefore gets merged weights: a weight sync moves the whole
  model, not the adapter (peft's merge is not used: merging into W and unmerging after would
  round W a little at every step).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tiller.config import LoRAConfig
from tiller.engine.updates import WeightUpdate
from tiller.errors import ConfigError, require_package
from tiller.train.batch import Batch
from tiller.train.trainer import PolicyTrainer

ADAPTER = "default"  # peft's name for a model's one adapter
REFERENCE = "reference"  # the frozen copy of the adapter at RL start: the KL reference


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

        _refuse_tied_targets(model, cfg.target_modules)
        self.cfg = cfg
        plain = model.state_dict()  # the base tensors under their plain names
        buffers = {k: b for k, b in model.named_buffers() if k not in plain}  # rotary inv_freq
        self._base = plain, buffers
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
        self.merged = self.base({k for k in plain if k in self.layers})
        self.merge()

    def base(self, cloned: set[str] = frozenset()) -> nn.Module:
        """A plain model of the loaded class holding the base's own tensors, frozen (those
        named in `cloned` copied): the other trainer ranks build their own `Lora` from it
        (`train.distributed`); with the targeted weights cloned, `merged`."""
        plain, buffers = self._base
        model = self.policy.get_base_model()
        with torch.device("meta"):
            out = type(model)(model.config)
        tensors = {k: t.clone() if k in cloned else t for k, t in plain.items()}
        out.load_state_dict(tensors, assign=True, strict=True)
        for name, buffer in buffers.items():
            owner, _, leaf = name.rpartition(".")
            out.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
        out.generation_config = model.generation_config
        return out.eval().requires_grad_(False)

    @torch.no_grad()
    def merge(self) -> None:
        """Each targeted weight of `merged` := W + (alpha / r) B A (peft's `get_delta_weight`)
        at the adapters' current values."""
        own = self.merged.state_dict()
        for name, layer in self.layers.items():
            own[name].copy_(layer.base_layer.weight + layer.get_delta_weight(ADAPTER))

    def has_reference(self) -> bool:
        return REFERENCE in self.policy.peft_config

    @torch.no_grad()
    def freeze_reference(self) -> None:
        """The KL reference := the policy now: the adapter "reference" (added on first use)
        holds a copy of the trained adapter's A and B, never trained."""
        if not self.has_reference():
            self.policy.add_adapter(REFERENCE, copy.deepcopy(self.policy.peft_config[ADAPTER]))
        for own, ref in zip(self.adapter_weights(ADAPTER), self.adapter_weights(REFERENCE),
                            strict=True):
            ref.copy_(own)
            ref.requires_grad_(False)

    def adapter_weights(self, name: str) -> list[nn.Parameter]:
        """Adapter `name`'s A and B of every targeted layer, in layer order (a resume hands
        the reference adapter's from rank 0 to the other trainer ranks)."""
        return [part[name].weight for layer in self.layers.values()
                for part in (layer.lora_A, layer.lora_B)]

    def drop_reference(self) -> None:
        """The KL term is off for good (`rl.algorithm.kl.off_after`): the reference goes."""
        if self.has_reference():
            self.policy.delete_adapter(REFERENCE)

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The policy computes with the reference adapter instead of its own inside (for a
        no-grad pass: every adapter is frozen meanwhile); its own adapter, trainable, after."""
        if not self.has_reference():
            raise RuntimeError("under model.lora the KL reference is the adapter frozen at RL "
                               "start: call Lora.freeze_reference() first")
        self.policy.set_adapter(REFERENCE, inference_mode=True)
        try:
            yield
        finally:
            self.policy.set_adapter(ADAPTER)

    def save(self, folder: Path) -> None:
        """The adapter as peft saves it (adapter_config.json, adapter_model.safetensors) and,
        while there is one, the reference adapter in its subfolder `reference/` (peft's
        layout for a second adapter)."""
        names = [ADAPTER, REFERENCE] if self.has_reference() else [ADAPTER]
        self.policy.save_pretrained(folder, safe_serialization=True, selected_adapters=names)

    def load(self, folder: Path) -> None:
        """The adapter `save` wrote into the policy, then `merged` recomputed; every adapter
        tensor must be in the file."""
        self._load(folder, ADAPTER)
        self.merge()

    def load_reference(self, folder: Path) -> None:
        """The reference adapter `save` wrote (`folder`/reference), frozen."""
        self.freeze_reference()  # it exists, frozen; its values are the file's
        self._load(folder / REFERENCE, REFERENCE)

    def _load(self, folder: Path, name: str) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        saved = json.loads((folder / "adapter_config.json").read_text())
        ours = self.policy.peft_config[name]
        if (saved["r"], saved["lora_alpha"]) != (ours.r, ours.lora_alpha):
            raise ConfigError(f"adapter {folder}: r={saved['r']}, alpha={saved['lora_alpha']}; "
                              f"model.lora has r={ours.r}, alpha={ours.lora_alpha}")
        result = set_peft_model_state_dict(self.policy,
                                           load_file(folder / "adapter_model.safetensors"),
                                           adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing or result.unexpected_keys:
            raise ConfigError(f"adapter {folder} does not fit the model: missing "
                              f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")

    def trainable(self) -> int:
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)


def _refuse_tied_targets(model: nn.Module, targets: list[str]) -> None:
    """One line when a target module is the input or output embedding of a model whose two
    are tied (one tensor): an adapter on one would silently change, or not change, the other,
    and `Lora.merged` (one merged weight per targeted layer) could not hold both."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    tied = {name for name, module in model.named_modules()
            if module is model.get_input_embeddings() or module is model.get_output_embeddings()}
    hit = sorted(t for t in targets for name in tied if name == t or name.endswith(f".{t}"))
    if hit:
        raise ConfigError(f"config field model.lora.target_modules: got {targets!r}; {hit[0]} "
                          f"is a tied embedding of {type(model).__name__} (input and output "
                          "share one weight): leave it out")


class MergedView:
    """What weight sync reads under LoRA (a `weight_sync.Publisher`): the merged model at the
    trainer's version; the parity probe is scored by the policy itself (adapters on)."""

    def __init__(self, trainer: LoraTrainer):
        self.trainer, self.model = trainer, trainer.lora.merged

    @property
    def version(self) -> int:
        return self.trainer.version

    @version.setter
    def version(self, value: int) -> None:  # a resume sets the trainer's and its publisher's
        self.trainer.version = value

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

    def reference(self) -> nn.Module:
        """The KL reference: the policy with a frozen copy of its adapter now
        (`Lora.freeze_reference`), no second copy of the base; a resumed run's checkpoint then
        puts its own values back."""
        self.lora.freeze_reference()
        return self.model

    def drop_reference(self) -> None:
        self.lora.drop_reference()

    def _reference_logprobs(self, ref: nn.Module, batch: Batch, micro_batch_size: int
                            ) -> torch.Tensor:
        """The reference pass: the policy with the reference adapter (`Lora.reference`), the
        adapter frozen when RL started; no second copy of the base."""
        if ref is not self.model:
            return super()._reference_logprobs(ref, batch, micro_batch_size)
        with self.lora.reference():
            return self._logprobs(self.model, batch, micro_batch_size)

    def _step(self, max_grad_norm: float) -> float:
        norm = super()._step(max_grad_norm)
        self.lora.merge()
        return norm
