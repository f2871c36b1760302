"""LoRA adapters -> a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the transformers model of the family (transformers 5.24, peft 0.21).

Input: the adapters as :func:`megamoe.lora.lora_state_dict` gives them, ``<logical name>.lora_A`` [r, in] and
``.lora_B`` [out, r] for each adapted logical weight (the names :mod:`megamoe.hf.adapter` maps to HF keys; routed
experts per expert id). The delta of a weight is ``alpha / r * B @ A``, as PEFT's (no rsLoRA).

The PEFT layout, per kind of HF weight (what transformers 5 builds in memory; checked in tests against peft)
-------------------------------------------------------------------------------------------------------------
- **Attention projections** (``nn.Linear``: q/k/v/o, MLA's q_a/q_b/kv_a_proj_with_mqa/kv_b): ``target_modules``;
  tensors ``base_model.model.<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], copied unchanged.
- **Every MLP weight** (dense MLP, shared experts, router): ``target_parameters`` (PEFT's ``ParamWrapper`` on the
  2-D parameter; same tensors, same keys). Not ``target_modules``: on transformers 5, peft rewrites any target module
  named like a transformers-4 expert projection (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's ``w1``/``w3``/
  ``w2``, ``gate``) into the fused experts' parameters (``peft.utils.transformers_weight_conversion``), so a dense
  MLP's or a shared expert's adapter named that way would land on the routed experts instead. The router is no
  ``nn.Linear`` in any family (a ``*TopKRouter`` module holding ``weight``).
- **Routed experts**: the fused 3-D parameters ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` in
  ``target_parameters``. For E experts of rank r, ``lora_A.weight`` is [E * r, in] (expert-major: rows
  ``e * r .. e * r + r - 1`` are expert e's A) and ``lora_B.weight`` is [out, r * E] (rank-major: column
  ``j * E + e`` is column j of expert e's B) -- ``ParamWrapper.get_delta_weight``. Both parameters live on one
  module, so peft nests two wrappers, the first registered parameter (``gate_up_proj``) innermost: its tensors are
  keyed ``mlp.experts.base_layer.lora_*``, ``down_proj``'s ``mlp.experts.lora_*``. megamoe's gate and up adapters
  of an expert are one adapter of the fused ``w_gate_up`` (one A): the HF gate_up adapter takes that A and the two
  B's stacked by rows (gate rows first; gpt-oss interleaves them, gate feature j at row 2j, up at 2j + 1, as its
  weight). A gate and an up adapter with different A's cannot be one rank-r adapter: refused.

Every family of :mod:`megamoe.hf.adapters` stores its experts this way in transformers 5.24 (gpt-oss transposed,
which peft reads from its ``is_transposed``), so every family's expert adapters load in peft. peft's ``ParamWrapper``
refuses dropout, so the config always says ``lora_dropout: 0`` (dropout only acts in training). Adapters of the
multi-token-prediction layers (DeepSeek-V3, GLM-4.5) are left out with a warning: transformers builds no such layers
(they are in the merged export). A block-FP8 base exports its adapters for the dequantized model (the same keys).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Mapping

import torch
from safetensors.torch import save_file

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.manifest import read_manifest
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe.checkpoint.output_dir import OutputDirectory
from megamoe.hf.adapter import LOGICAL_EXPERT_KEYS
from megamoe.hf.adapters import ADAPTERS, AdapterError, adapter_for
from megamoe.hf.lora_checkpoint import LORA_FILE, lora_checkpoint, read_adapters
from megamoe.lora import LoRAConfig
from megamoe.models import GPTMoEConfig

__all__ = ["PEFT_CONFIG_FILE", "PEFT_WEIGHTS_FILE", "lora_factors", "peft_adapter", "export_peft",
           "export_peft_checkpoint"]

logger = logging.getLogger(__name__)

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."               # PeftModel's prefix of the transformers model's keys
_INTERLEAVED_GATE_UP = frozenset({"gpt_oss"})   # HF gate_up rows: gate j at 2j, up j at 2j + 1


def lora_factors(lora_state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{logical name: (A [r, in], B [out, r])}`` from ``lora_state`` (``<name>.lora_A`` / ``.lora_B``).
    AdapterError for a key of another form, a factor without its pair or factors whose shapes do not chain."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in lora_state.items():
        name, dot, which = key.rpartition(".")
        if not dot or which not in ("lora_A", "lora_B"):
            raise AdapterError(f"LoRA state key {key!r} does not end with .lora_A or .lora_B")
        factors.setdefault(name, {})[which] = tensor
    pairs = {}
    for name, pair in factors.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"LoRA state: {name} has {', '.join(pair)} but not its pair")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"LoRA state: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                               "expected [r, in] and [out, r]")
        pairs[name] = (a, b)
    return pairs


@dataclasses.dataclass
class _Targets:
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    modules: set[str] = dataclasses.field(default_factory=set)        # HF module names (nn.Linear)
    parameters: set[str] = dataclasses.field(default_factory=set)     # HF parameter keys

    def add(self, wrapper: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self.tensors[f"{_PREFIX}{wrapper}.lora_A.weight"] = a.contiguous()
        self.tensors[f"{_PREFIX}{wrapper}.lora_B.weight"] = b.contiguous()


def _expert_factors(pairs, names: list[str], layer: int, what: str):
    missing = [n for n in names if n not in pairs]
    if len(missing) == len(names):
        return None
    if missing:
        raise AdapterError(f"layer {layer}: {len(missing)} of {len(names)} experts have no {what} adapter (e.g. "
                           f"{missing[0]}); PEFT's fused expert adapter covers every expert of a layer")
    return [pairs.pop(n) for n in names]


def _add_experts(targets: _Targets, pairs, config: GPTMoEConfig, layer: int, fused_keys: tuple[str, str],
                 interleaved: bool) -> None:
    E, F, H = config.moe.num_experts, config.moe.ffn_hidden_size, config.hidden_size
    gate_n, up_n, down_n = ([t.format(i=layer, e=e) for e in range(E)] for t in LOGICAL_EXPERT_KEYS)
    gates, ups = _expert_factors(pairs, gate_n, layer, "gate"), _expert_factors(pairs, up_n, layer, "up")
    downs = _expert_factors(pairs, down_n, layer, "down")
    wrapped: list[tuple[str, torch.Tensor, torch.Tensor]] = []     # in the HF module's parameter order
    if (gates is None) != (ups is None):
        raise AdapterError(f"layer {layer}: the experts have {'gate' if ups is None else 'up'} adapters but no "
                           f"{'up' if ups is None else 'gate'} ones; HF fuses them into gate_up_proj")
    if gates is not None:
        a_list, b_list = [], []
        for e, ((a_g, b_g), (a_u, b_u)) in enumerate(zip(gates, ups)):
            _check(gate_n[e], a_g, b_g, (F, H))
            _check(up_n[e], a_u, b_u, (F, H))
            if not torch.equal(a_g, a_u):
                raise AdapterError(f"{gate_n[e]} and {up_n[e]} have different lora_A: HF fuses them into one "
                                   "gate_up_proj, whose rank-r adapter has one A; export merged weights instead")
            a_list.append(a_g)
            b_list.append(torch.stack((b_g, b_u), dim=1).flatten(0, 1) if interleaved else torch.cat((b_g, b_u)))
        wrapped.append((fused_keys[0].format(i=layer), torch.stack(a_list), torch.stack(b_list)))
    if downs is not None:
        for e, (a, b) in enumerate(downs):
            _check(down_n[e], a, b, (H, F))
        wrapped.append((fused_keys[1].format(i=layer), torch.stack([a for a, _ in downs]),
                        torch.stack([b for _, b in downs])))
    for depth, (key, a, b) in enumerate(wrapped):       # the first parameter is the innermost wrapper
        module = key.rpartition(".")[0] + ".base_layer" * (len(wrapped) - 1 - depth)
        rank = a.shape[1]
        # A [E, r, in] -> [E * r, in] (expert-major); B [E, out, r] -> [out, r * E] (rank-major)
        targets.add(module, a.reshape(E * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * E))
        targets.parameters.add(key)


def _check(name: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or (b.shape[0], a.shape[1]) != tuple(shape):
        raise AdapterError(f"LoRA state: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, which do "
                           f"not fit its weight {tuple(shape)}")


def _shortest_suffixes(chosen: set[str], universe: set[str], least: int) -> list[str]:
    """For each name of ``chosen``, its shortest dotted suffix of at least ``least`` parts that no name of
    ``universe`` outside ``chosen`` ends with (peft matches a target ``t`` to a name equal to it or ending with
    ``.t``)."""
    others = universe - chosen
    found = set()
    for name in chosen:
        parts = name.split(".")
        for k in range(min(least, len(parts)), len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if not any(o == suffix or o.endswith("." + suffix) for o in others):
                found.add(suffix)
                break
    return sorted(found)


def peft_adapter(lora_state: Mapping[str, torch.Tensor], lora: LoRAConfig, config: GPTMoEConfig, *,
                 base_model: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json dict, adapter_model.safetensors tensors) of ``lora_state`` (full, unsharded; trained
    as ``lora`` says) for a model of ``config``; AdapterError naming the adapter that does not fit.
    ``base_model``: recorded as the config's ``base_model_name_or_path``."""
    if config.family not in ADAPTERS:
        raise AdapterError(f"a model of family {config.family!r} has no HuggingFace equivalent: no PEFT adapter can "
                           f"be written for it (families with one: {', '.join(ADAPTERS)})")
    pairs = lora_factors(lora_state)
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if ranks != [lora.rank]:
        raise AdapterError(f"LoRA state: the adapters have ranks {ranks}, the LoRA config rank {lora.rank}")
    if lora.dropout:
        logger.warning("PEFT export: lora_dropout %g is written as 0 (peft's target_parameters refuse dropout; it "
                       "only acts in training)", lora.dropout)
    mtp_prefixes = tuple(f"layers.{i}." for i in config.mtp_layer_ids)
    mtp = [n for n in pairs if n.startswith(mtp_prefixes)] if mtp_prefixes else []
    if mtp:
        logger.warning("PEFT export: leaving out the %d adapters of the multi-token-prediction layers (transformers "
                       "builds no such layers; the merged export holds them)", len(mtp))
        for n in mtp:
            pairs.pop(n)
    adapter = adapter_for(config.family)
    plain = dataclasses.replace(config, weight_quantization=None)    # the keys of the (dequantized) HF model
    targets = _Targets()
    hf_keys = set()
    for step in adapter.transforms(plain, fused=True):
        hf_keys.update(step.hf_keys)
        if not step.is_rename or step.logical_keys[0] not in pairs:
            continue
        name, key, shape = step.logical_keys[0], step.hf_keys[0], step.logical_shapes[0]
        a, b = pairs.pop(name)
        _check(name, a, b, shape)
        if ".self_attn." in key:
            module = key.removesuffix(".weight")
            targets.modules.add(module)
        else:
            module = key.rpartition(".")[0]
            targets.parameters.add(key)
        targets.add(module, a, b)
    for layer in (i for i in config.moe_layer_ids if i < config.num_layers):
        _add_experts(targets, pairs, config, layer, adapter.experts.fused, config.family in _INTERLEAVED_GATE_UP)
    if pairs:
        raise AdapterError(f"LoRA state: {len(pairs)} adapters match no HF weight of a {config.family} model, e.g. "
                           f"{next(iter(pairs))}")
    if not targets.tensors:
        raise AdapterError("LoRA state: no adapter to export")
    modules_universe = {key.rsplit(".", k)[0] for key in hf_keys for k in range(1, key.count(".") + 1)}
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "target_modules": _shortest_suffixes(targets.modules, modules_universe, 1) or None,
        "target_parameters": _shortest_suffixes(targets.parameters, hf_keys, 2) or None,
    }
    return adapter_config, targets.tensors


def export_peft(out_dir: str | os.PathLike, lora_state: Mapping[str, torch.Tensor], lora: LoRAConfig,
                config: GPTMoEConfig, *, base_model: str | None = None, overwrite: bool = False,
                inputs: tuple[str, ...] = ()) -> dict:
    """Write the PEFT adapter directory ``out_dir`` (atomically: nothing is left there on error). ``inputs``:
    directories ``out_dir`` must not overlap. ConversionError for a bad output path or adapters that do not fit
    the family's HF layout. Returns a summary."""
    output = OutputDirectory(out_dir, overwrite=overwrite, what="a PEFT adapter directory", inputs=inputs,
                             replaceable=lambda p: os.path.isfile(os.path.join(p, PEFT_CONFIG_FILE)))
    try:
        adapter_config, tensors = peft_adapter(lora_state, lora, config, base_model=base_model)
    except AdapterError as e:
        raise ConversionError(f"cannot write a PEFT adapter: {e}") from None
    with output as tmp:
        save_file({k: t.detach().cpu() for k, t in tensors.items()}, os.path.join(tmp, PEFT_WEIGHTS_FILE),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, PEFT_CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    logger.info("wrote the PEFT adapter %s: %d tensors, rank %d", output.path, len(tensors), lora.rank)
    return {"out_dir": output.path, "family": config.family, "tensors": len(tensors), "rank": lora.rank,
            "target_modules": adapter_config["target_modules"],
            "target_parameters": adapter_config["target_parameters"]}


def export_peft_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                           verify_checksums: bool = True) -> dict:
    """``export-peft``: the adapters of the LoRA run's checkpoint ``checkpoint`` as a PEFT adapter directory
    (every file read checked against the manifest, checksums unless ``verify_checksums=False``). Its
    ``base_model_name_or_path`` is the HF directory the run started from, when it did. ConversionError or
    CheckpointError (nothing is left at ``out_dir``)."""
    checkpoint = os.fspath(checkpoint)
    manifest = read_manifest(checkpoint)
    config = check_model_manifest(manifest, checkpoint)
    lora = lora_checkpoint(checkpoint, manifest)
    if lora is None:
        raise ConversionError(f"{checkpoint} holds no LoRA adapters (no {LORA_FILE}): export-peft writes a LoRA run's "
                              "adapters; export the whole model with export-hf")
    with LogicalTensorReader(checkpoint, manifest, verify_checksums=verify_checksums) as reader:
        adapters = read_adapters(reader, lora)
    return export_peft(out_dir, adapters, lora.config, config, base_model=lora.base_hf_model, overwrite=overwrite,
                       inputs=(checkpoint,))
