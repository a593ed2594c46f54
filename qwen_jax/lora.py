"""PEFT LoRA adapters on the host: adapter_config.json + adapter_model.safetensors ->
`LoRAAdapter` (per-module factors, scaling folded in), packed by qwen_jax/lora_packing.py.

Layouts follow x @ W (W [in, out]): a module's delta is A @ B, A [..., in, r], B [..., r, out].
Expert LoRA comes in two layouts: transformers-4 adapters hold one LoRA per expert and
projection (`mlp.experts.<e>.gate_proj`); peft on transformers 5 wraps the fused parameters
`mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `mlp.experts.down_proj` [E, D, F]
in nested ParamWrappers, and rewrites expert targets in the config to match (its
`_convert_peft_config_moe`, which `_parse_spec` follows; 0.22+ keeps MLP targets on dense layers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from qwen_jax.config import MOE_ARCH, ModelConfig
from qwen_jax.safetensors_io import SafetensorsFile
from qwen_jax.validation import require

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
# Qwen3MoeExperts' parameter order, which is the order peft wraps them in (first = innermost).
FUSED_PARAMS = ("gate_up_proj", "down_proj")
GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_MODULES = tuple(f"mlp.experts.{p}" for p in FUSED_PARAMS)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# peft's transformers-5 rename of transformers-4 MoE targets (Qwen2/Qwen3-MoE).
_V4_TO_V5 = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
             "down_proj": "down_proj"}
_FUSED_PATTERN = r".*\.gate_up_proj"
_OFF_FIELDS = ("use_dora", "use_qalora", "use_bdlora", "lora_bias", "modules_to_save",
               "alora_invocation_tokens", "trainable_token_indices", "layer_replication",
               "arrow_config", "kasa_config", "monteclora_config")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.(lora_A|lora_B)\.weight")
_ATTN = re.compile(r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj)")
_DENSE = re.compile(r"mlp\.(?:gate_proj|up_proj|down_proj)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")
_FUSED = re.compile(r"mlp\.experts((?:\.base_layer)*)")
_SUPPORTED_KEYS = ("base_model.model.model.layers.<i>.<self_attn.<q|k|v|o>_proj | "
                   "mlp.<gate|up|down>_proj | mlp.experts.<e>.<gate|up|down>_proj | "
                   "mlp.experts[.base_layer] | mlp.gate>.lora_<A|B>.weight")
_SUPPORTED_TARGETS = ("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, gate "
                      "(the MoE router)")

Factors = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One loaded adapter: (HF layer index, module) -> (A [..., in, r], B [..., r, out]).

    float32 with the scaling folded into B. Modules: `self_attn.<q|k|v|o>_proj` and
    `mlp.<gate|up|down>_proj` (dense layers; A [in, r]), `mlp.experts.<gate|up|down>_proj`
    (A [E, in, r]), `mlp.experts.gate_up_proj` (fused: A [E, D, r], B [E, r, 2F], gate
    columns first) and `mlp.gate` (the MoE router: A [D, r], B [r, E]). `rank` is the
    largest module rank, a fused gate_up_proj counting half.
    """

    name: str
    path: str
    rank: int
    modules: dict[tuple[int, str], Factors]

    @property
    def nbytes(self) -> int:
        """Host bytes of all factor arrays."""
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_dims(cfg: ModelConfig, layer: int, module: str) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, in, out) of a `LoRAAdapter.modules` name in `layer`: () or (E,)."""
    require(0 <= layer < cfg.num_hidden_layers, f"layer index of {module}", layer,
            f"in [0, num_hidden_layers={cfg.num_hidden_layers})")
    d, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attn = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    group, _, proj = module.rpartition(".")
    if group == "self_attn" and proj in attn:
        return (), *attn[proj]
    moe = cfg.is_moe_layer(layer)
    if module == "mlp.gate" and moe:
        return (), d, cfg.num_experts
    f = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    mlp = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d), "gate_up_proj": (d, 2 * f)}
    want = "mlp.experts" if moe else "mlp"
    require(group == want and proj in mlp and (moe or proj != "gate_up_proj"),
            f"module of layer {layer} (a {cfg.layer_kinds[layer]} layer)", module,
            f"self_attn.<q|k|v|o>_proj or {want}.<gate|up|down"
            + ("|gate_up>_proj" if moe else ">_proj"))
    return ((cfg.num_experts,) if moe else ()), *mlp[proj]


# ---- adapter_config.json ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the config decides: per-module rank and scaling, and which fused expert
    parameters peft wraps in each MoE layer (innermost first)."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    wrapped: dict[int, tuple[str, ...]]

    def rank_and_scale(self, full_name: str) -> tuple[int, float, str]:
        """(rank, scaling, the config field the rank came from) of a module, as peft picks
        them: the first rank_pattern / alpha_pattern key matching the name's tail."""
        r_key = _pattern_key(self.rank_pattern, full_name)
        a_key = _pattern_key(self.alpha_pattern, full_name)
        r = self.r if r_key is None else self.rank_pattern[r_key]
        field = "r" if r_key is None else f"rank_pattern[{r_key!r}]"
        require(isinstance(r, int) and r >= 1, field, r, "an integer >= 1")
        alpha = self.alpha if a_key is None else self.alpha_pattern[a_key]
        return r, alpha / (math.sqrt(r) if self.use_rslora else r), field


def _pattern_key(patterns: dict, name: str) -> str | None:
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", name)), None)


def _check_regex(pattern: str, field: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field} must be a valid regular expression, got {pattern!r} "
                         f"({e})") from None


def _matches(target: str, name: str) -> bool:
    """peft's rule for a list entry: the whole name or a dotted tail of it."""
    return name == target or name.endswith(f".{target}")


def _module_names(cfg: ModelConfig) -> tuple[list[str], dict[str, str]]:
    """Module names a target can name: supported ones (experts by their transformers-4
    names, with and without the expert index) and known unsupported ones -> what they are."""
    supported: list[str] = []
    unsupported = {"lm_head": "the LM head", "model.embed_tokens": "the token embedding"}
    for i, kind in enumerate(cfg.layer_kinds):
        prefix = f"model.layers.{i}."
        supported += [f"{prefix}self_attn.{p}" for p in ATTN_PROJS]
        if kind == "dense":
            supported += [f"{prefix}mlp.{p}" for p in MLP_PROJS]
            continue
        supported += [f"{prefix}mlp.experts.{p}" for p in MLP_PROJS]
        supported += [f"{prefix}mlp.experts.{e}.{p}" for e in range(cfg.num_experts)
                      for p in MLP_PROJS]
        supported.append(f"{prefix}mlp.gate")
    return supported, unsupported


def _str_list(value: object, field: str, other: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{field} must be a list of names or {other}, got {value!r}")
    return value


def _check_target_modules(targets: object, cfg: ModelConfig) -> None:
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return
    supported, unsupported = _module_names(cfg)
    if isinstance(targets, str):
        _check_regex(targets, "target_modules")
        require(any(re.fullmatch(targets, n) for n in supported), "target_modules", targets,
                f"a regex matching a supported module ({_SUPPORTED_TARGETS}) of this model")
        return
    for target in _str_list(targets, "target_modules", "a regex or 'all-linear'"):
        if any(_matches(target, n) for n in supported):
            continue
        what = next((why for n, why in unsupported.items() if _matches(target, n)), None)
        raise ValueError(
            f"target_modules entry {target!r} " + (f"is {what}, which LoRA serving does not "
                                                   "support" if what else
                                                   "names no module of this model")
            + f"; supported: {_SUPPORTED_TARGETS}")


def _check_target_parameters(targets: object, cfg: ModelConfig) -> None:
    moe_layers = [i for i, kind in enumerate(cfg.layer_kinds) if kind == "moe"]
    names = [f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in FUSED_PARAMS]
    routers = [f"model.layers.{i}.mlp.gate.weight" for i in moe_layers]
    for target in _str_list(targets or [], "target_parameters", "null"):
        if any(_matches(target, n) for n in [*names, *routers]):
            continue
        raise ValueError(f"target_parameters entry {target!r} names no parameter of this "
                         "model; supported: gate_up_proj and down_proj of mlp.experts and the "
                         "router's gate.weight (MoE layers)")


def _check_fields(raw: dict, cfg: ModelConfig) -> None:
    require(raw.get("peft_type", "LORA") == "LORA", "peft_type", raw.get("peft_type"), "'LORA'")
    for field in _OFF_FIELDS:
        require(not raw.get(field), field, raw.get(field), "false / empty (not supported)")
    require(raw.get("bias", "none") == "none", "bias", raw.get("bias"), "'none' (not supported)")
    require(isinstance(raw.get("r"), int) and raw["r"] >= 1, "r", raw.get("r"), "an integer >= 1")
    alpha = raw.get("lora_alpha")
    require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool), "lora_alpha", alpha,
            "a number")
    for field in ("rank_pattern", "alpha_pattern"):
        require(isinstance(raw.get(field) or {}, dict), field, raw.get(field), "a JSON object")
        for pattern in raw.get(field) or {}:
            _check_regex(pattern, f"{field} key")
    layers = raw.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers or []
    for layer in layers:
        require(isinstance(layer, int) and 0 <= layer < cfg.num_hidden_layers,
                "layers_to_transform", raw["layers_to_transform"],
                f"layer indices in [0, num_hidden_layers={cfg.num_hidden_layers})")
    _check_target_modules(raw.get("target_modules"), cfg)
    _check_target_parameters(raw.get("target_parameters"), cfg)


def _string_target_leaves(target: str, cfg: ModelConfig) -> set[str]:
    """The leaf names peft resolves a string target_modules to on a transformers-5 MoE model."""
    if target.lower() == "all-linear":
        return {*ATTN_PROJS, *_V4_TO_V5}
    supported, unsupported = _module_names(cfg)
    return {n.rpartition(".")[2] for n in [*supported, *unsupported]
            if re.fullmatch(target, n)}


def _parse_spec(raw: dict, cfg: ModelConfig) -> _Spec:
    """Validate the config and apply peft's transformers-5 MoE conversion: expert targets
    move to target_parameters; targeting gate and up fuses them into gate_up_proj with 2r and
    2 * lora_alpha."""
    _check_fields(raw, cfg)
    r, alpha = raw["r"], raw["lora_alpha"]
    params = list(raw.get("target_parameters") or [])
    rank_pattern = dict(raw.get("rank_pattern") or {})
    alpha_pattern = dict(raw.get("alpha_pattern") or {})
    if cfg.architecture == MOE_ARCH:
        targets = raw.get("target_modules") or []
        leaves = _string_target_leaves(targets, cfg) if isinstance(targets, str) else targets
        moved = {old for t in leaves for old in _V4_TO_V5 if _matches(old, t)}
        params += [_V4_TO_V5[old] for old in moved]
        if {"gate_proj", "up_proj"} <= moved:
            rank_pattern[_FUSED_PATTERN] = 2 * r
            alpha_pattern[_FUSED_PATTERN] = 2 * alpha
    wrapped = {i: tuple(p for p in FUSED_PARAMS
                        if any(_matches(t, f"model.layers.{i}.mlp.experts.{p}") for t in params))
               for i, kind in enumerate(cfg.layer_kinds) if kind == "moe"}
    return _Spec(r=r, alpha=alpha, use_rslora=bool(raw.get("use_rslora")),
                 rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, wrapped=wrapped)


# ---- adapter_model.safetensors ---------------------------------------------------------
def _open_adapter(directory: Path) -> tuple[dict, SafetensorsFile]:
    require(directory.is_dir(), "adapter path", str(directory), "an existing directory")
    require((directory / CONFIG_FILE).is_file(), "adapter path", str(directory),
            f"a directory with {CONFIG_FILE}")
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        note = (" (adapter_model.bin is not supported: save with safe_serialization=True)"
                if (directory / "adapter_model.bin").exists() else "")
        raise ValueError(f"adapter path must be a directory with {WEIGHTS_FILE}, got "
                         f"{str(directory)!r}{note}")
    with open(directory / CONFIG_FILE) as f:
        raw = json.load(f)
    require(isinstance(raw, dict), CONFIG_FILE, type(raw).__name__, "a JSON object")
    return raw, SafetensorsFile(weights)


def _module_of(cfg: ModelConfig, spec: _Spec, key: str, layer: int, path: str) -> str:
    """The module a tensor belongs to: our name, or `mlp.experts.<e>.<proj>` per expert."""
    moe = cfg.is_moe_layer(layer)
    if _ATTN.fullmatch(path) or (_DENSE.fullmatch(path) and not moe):
        return path
    if (m := _EXPERT.fullmatch(path)) and moe:
        require(int(m[1]) < cfg.num_experts, f"expert index of tensor {key!r}", int(m[1]),
                f"< num_experts={cfg.num_experts}")
        return path
    if (m := _FUSED.fullmatch(path)) and moe:
        wrapped = spec.wrapped[layer]
        depth = m[1].count(".base_layer")
        require(depth < len(wrapped), f"tensor {key!r}", key,
                f"a parameter target_parameters wraps (in layer {layer}: {list(wrapped)}, so "
                f"'mlp.experts' + at most {len(wrapped) - 1} '.base_layer')" if wrapped else
                f"in a layer target_parameters wraps (none wraps mlp.experts of layer {layer})")
        return f"mlp.experts.{wrapped[len(wrapped) - 1 - depth]}"
    if path == "mlp.gate" and moe:
        return path
    raise ValueError(f"tensor key {key!r} maps to no supported module of layer {layer} (a "
                     f"{cfg.layer_kinds[layer]} layer); expected {_SUPPORTED_KEYS}")


def _pair_keys(st: SafetensorsFile, cfg: ModelConfig, spec: _Spec):
    """(layer, module) -> {"lora_A": key, "lora_B": key}, every tensor of the file placed."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in st.entries:
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"tensor key {key!r} in {WEIGHTS_FILE} maps to no supported "
                             f"module; expected {_SUPPORTED_KEYS}")
        layer = int(m[1])
        require(layer < cfg.num_hidden_layers, f"layer index of tensor {key!r}", layer,
                f"< num_hidden_layers={cfg.num_hidden_layers}")
        pairs.setdefault((layer, _module_of(cfg, spec, key, layer, m[2])), {})[m[3]] = key
    require(bool(pairs), WEIGHTS_FILE, "no tensors", "at least one lora_A / lora_B pair")
    for found in pairs.values():
        for part, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if part not in found:
                raise ValueError(f"tensor {found[other]!r} needs its {part}: "
                                 f"{found[other].replace(other, part)!r} is missing")
    return pairs


def _read(st: SafetensorsFile, keys: dict[str, str], shape_a: tuple[int, ...],
          shape_b: tuple[int, ...]) -> Factors:
    """The file's lora_A / lora_B weights as float32, checked against the expected shapes."""
    out = []
    for part, shape in (("lora_A", shape_a), ("lora_B", shape_b)):
        array = st.get(keys[part])
        require(tuple(array.shape) == shape, f"shape of tensor {keys[part]!r}", list(array.shape),
                f"{list(shape)} (this model's dims and the config's rank)")
        out.append(np.asarray(array, dtype=np.float32))
    return out[0], out[1]


def _load_module(st: SafetensorsFile, cfg: ModelConfig, spec: _Spec, layer: int, module: str,
                 keys: dict[str, str], max_rank: int) -> Factors:
    """One module's factors in our layout, scaled. A per-module LoRA holds A [r, in] and
    B [out, r]; a fused ParamWrapper A [E*r, in] (row e*r + j), B [out, E*r] (col j*E + e)."""
    full = f"model.layers.{layer}.{module}"
    r, scale, field = spec.rank_and_scale(full)
    limit = 2 * max_rank if module == GATE_UP else max_rank
    require(r <= limit, f"{field} (the rank of {full})", r,
            f"<= 2 * max_rank = {limit} (peft doubles a fused gate_up_proj's rank)"
            if module == GATE_UP else f"<= max_rank={max_rank}")
    if module not in _FUSED_MODULES:
        _, d_in, d_out = module_dims(cfg, layer, re.sub(r"experts\.\d+\.", "experts.", module))
        a, b = _read(st, keys, (r, d_in), (d_out, r))
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * np.float32(scale))
    (e,), d_in, d_out = module_dims(cfg, layer, module)
    a, b = _read(st, keys, (e * r, d_in), (d_out, e * r))
    a = a.reshape(e, r, d_in).transpose(0, 2, 1)  # [E, in, r]
    b = b.reshape(d_out, r, e).transpose(2, 1, 0) * np.float32(scale)  # [E, r, out]
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def _stack_experts(cfg: ModelConfig, layer: int, proj: str, per_expert: dict[int, Factors]):
    """{e: (A [in, r_e], B [r_e, out])} -> (A [E, in, r], B [E, r, out]), r = max r_e."""
    missing = sorted(set(range(cfg.num_experts)) - set(per_expert))
    require(not missing, f"experts of model.layers.{layer}.mlp.experts.<e>.{proj}",
            f"{len(per_expert)} with LoRA, missing {missing[:8]}",
            f"all num_experts={cfg.num_experts}")
    r = max(a.shape[1] for a, _ in per_expert.values())
    (num,), d_in, d_out = module_dims(cfg, layer, f"mlp.experts.{proj}")
    a_out, b_out = np.zeros((num, d_in, r), np.float32), np.zeros((num, r, d_out), np.float32)
    for e, (a, b) in per_expert.items():
        a_out[e, :, :a.shape[1]] = a
        b_out[e, :b.shape[0], :] = b
    return a_out, b_out


def _assemble(cfg: ModelConfig, loaded: dict[tuple[int, str], Factors],
              experts: dict[tuple[int, str], dict[int, Factors]]):
    """Join per-module and stacked per-expert factors; a layer must not mix the two layouts."""
    modules = dict(loaded)
    for (layer, proj), per_expert in sorted(experts.items()):
        module = f"mlp.experts.{proj}"
        clash = (layer, module) in modules or (proj != "down_proj" and (layer, GATE_UP) in modules)
        require(not clash, f"expert LoRA layout of layer {layer}", module,
                "either per expert (mlp.experts.<e>.*) or fused (target_parameters), not both")
        modules[(layer, module)] = _stack_experts(cfg, layer, proj, per_expert)
    return modules


def _rank_units(module: str, a: np.ndarray) -> int:
    """A module's rank in buffer units: a fused gate_up_proj spans both halves of 2R."""
    return -(-a.shape[-1] // 2) if module == GATE_UP else a.shape[-1]


def load_adapter(path: str | Path, cfg: ModelConfig, *, max_rank: int,
                 name: str | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory for the model `cfg`; every tensor is used or it
    raises ValueError naming the field, value and limit. `name` defaults to the dir name."""
    require(isinstance(max_rank, int) and max_rank >= 1, "max_rank", max_rank, "an integer >= 1")
    directory = Path(path)
    raw, st = _open_adapter(directory)
    spec = _parse_spec(raw, cfg)
    loaded: dict[tuple[int, str], Factors] = {}
    experts: dict[tuple[int, str], dict[int, Factors]] = {}
    for (layer, module), keys in sorted(_pair_keys(st, cfg, spec).items()):
        factors = _load_module(st, cfg, spec, layer, module, keys, max_rank)
        if m := _EXPERT.fullmatch(module):
            experts.setdefault((layer, m[2]), {})[int(m[1])] = factors
        else:
            loaded[(layer, module)] = factors
    modules = _assemble(cfg, loaded, experts)
    rank = max(_rank_units(module, a) for (_, module), (a, _) in modules.items())
    return LoRAAdapter(name=name or directory.name, path=str(directory), rank=rank,
                       modules=modules)
