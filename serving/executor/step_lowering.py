"""The serving step lowered without a GPU: abstract params at real shapes, lowered for a
platform (CUDA from a CPU machine), its StableHLO op counts and how the weights reach
the ops that read them.

Op counts walk the module with every `func.call` inlined and every nested region
counted once: "per layer" is the body of a layer scan (one iteration), "outside" is the
rest of the step (embedding, step-wide plans, lm head, sampler).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cuda_lowering import cuda_lowering_context

# Ops that cost a kernel launch (or a loop of them) on a GPU; elementwise ops, reshapes
# and constants fuse into their neighbours.
HEAVY_OPS = frozenset({
    "stablehlo.custom_call", "stablehlo.dot_general", "stablehlo.gather",
    "stablehlo.scatter", "stablehlo.sort", "stablehlo.while", "stablehlo.reduce",
    "stablehlo.dynamic_slice", "chlo.top_k", "stablehlo.reduce_window",
    "stablehlo.dynamic_update_slice", "stablehlo.case", "stablehlo.if"})
# Ops through which a value is still "the same array" (same elements, other view).
_VIEW_OPS = frozenset({"stablehlo.reshape", "stablehlo.bitcast_convert"})
# Ops whose result is still (part of, or a copy of) a weight; past any other op the value
# is an activation and no longer followed.
_SLICE_OPS = frozenset({"stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.gather"})
_WEIGHT_OPS = _VIEW_OPS | _SLICE_OPS | {"stablehlo.convert", "stablehlo.transpose",
                                        "stablehlo.broadcast_in_dim",
                                        "stablehlo.concatenate", "stablehlo.copy"}
_READERS = frozenset({"stablehlo.custom_call", "stablehlo.dot_general"})


def _ir():
    """jax's MLIR bindings: a private module, imported only by the StableHLO walk (the
    probe's compiled-HLO counts do not need it)."""
    from jax._src.lib.mlir import ir
    return ir


def abstract_runner(model: str = "qwen3-30b-a3b", *, dtype: str = "bfloat16",
                    impl: str = "pallas", kv_cache_dtype: str = "auto",
                    max_model_len: int = 1280, page_size: int = 16, num_pages: int = 5200,
                    quantization: str | None = None, kernel_table=None, max_loras: int = 0,
                    max_lora_rank: int = 16):
    """A ModelRunner over ShapeDtypeStruct params and caches: no weights allocated.
    quantization: fp8 | int8 | awq weights (as a checkpoint of that format holds them);
    kernel_table: a KernelTable of per-shape kernels (pallas_kernels/choices.py);
    max_loras: LoRA adapter slots (at max_lora_rank) in every layer."""
    from qwen_jax.config import ModelConfig
    from qwen_jax.model import Qwen3ForCausalLM
    from qwen_jax.params import abstract_model, resolve_kv_cache_dtype
    from qwen_jax.quantization import resolve
    from serving.executor.model_runner import ModelRunner

    cfg = ModelConfig.from_hf(model)
    cfg = dataclasses.replace(cfg, quantization=resolve(cfg.quantization, quantization,
                                                        dummy=True))
    abstract = abstract_model(cfg, dtype, impl=impl, model_cls=Qwen3ForCausalLM)
    abstract.use_kernel_table(kernel_table)
    if max_loras:
        from qwen_jax import lora_layers
        lora_layers.enable_lora(abstract, max_loras, max_lora_rank, abstract=True)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, abstract.dtype)
    caches = jax.eval_shape(lambda: abstract.init_kv_caches(num_pages, page_size, kv_dtype))
    return ModelRunner(abstract, caches, max_model_len=max_model_len, dispatch_thread=False,
                       pages_per_seq=-(-max_model_len // page_size))


def _lowering(platforms):
    """Where the lowering targets CUDA, an H200 as the abstract device (the Triton
    kernels read its compute capability from it on jax 0.11+; a GPU need not be here)."""
    return cuda_lowering_context() if "cuda" in platforms else contextlib.nullcontext()


def lower_step(runner, bucket: tuple[int, int], platforms=("cuda",)):
    """jax.stages.Lowered of the runner's jitted step for one (T, S) bucket."""
    args = runner._abstract_args(bucket)
    with _lowering(platforms):
        return runner._step.trace(runner.state, runner.kv_caches, *args).lower(
            lowering_platforms=tuple(platforms))


def stacked_weight_types(runner) -> set[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every stacked (per-segment, leading X dim) parameter."""
    counts = set(segment_counts(runner))
    types = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.state)[0]:
        if "segments" in jax.tree_util.keystr(path) and leaf.ndim >= 1 \
                and leaf.shape[0] in counts:
            types.add((tuple(leaf.shape), str(jnp.dtype(leaf.dtype))))
    return types


def segment_counts(runner) -> list[int]:
    """Layers in each scanned segment."""
    from flax import nnx
    model = nnx.merge(runner.graphdef, runner.state)
    return [count for _, _, count in model.config.segments]


class StepModule:
    """A lowered step's StableHLO module, walked with calls inlined."""

    def __init__(self, lowered, weight_types=frozenset()):
        ir = _ir()
        self.module = lowered.compiler_ir("stablehlo")
        self.funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op
                      for op in self.module.body.operations}
        self.main = self.funcs["main"]
        args = self.main.regions[0].blocks[0].arguments
        self.weight_args = [a for a in args if _type_key(a.type) in weight_types]

    # ---- walking -----------------------------------------------------------------------
    def _callee(self, op):
        return self.funcs[_ir().FlatSymbolRefAttr(op.attributes["callee"]).value]

    def walk(self, ops, visit):
        """visit(op) for every op under `ops`, entering calls and nested regions."""
        for op in ops:
            if op.operation.name == "func.call":
                self.walk(self._callee(op).regions[0].blocks[0].operations, visit)
                continue
            visit(op)
            for region in op.regions:
                for block in region.blocks:
                    self.walk(block.operations, visit)

    def _top_level(self):
        """Ops of main in order, calls at the top level inlined (not nested regions)."""
        out = []

        def add(ops):
            for op in ops:
                if op.operation.name == "func.call":
                    add(self._callee(op).regions[0].blocks[0].operations)
                else:
                    out.append(op)
        add(self.main.regions[0].blocks[0].operations)
        return out

    def layer_loops(self):
        """Top-level while loops that carry stacked weights: the layer scans."""
        weights = set(self.weight_args)
        return [op for op in self._top_level() if op.operation.name == "stablehlo.while"
                and any(v in weights for v in op.operands)]

    # ---- how the weights reach their readers --------------------------------------------
    def weight_uses(self) -> list[WeightUse]:
        """Every op that takes a stacked weight, or a value made from one by views,
        slices, casts or concatenation, with the ops on the way."""
        env = {arg: WeightUse(op="", weight=_type_key(arg.type), path=())
               for arg in self.weight_args}
        uses: list[WeightUse] = []
        self._flow(self.main.regions[0].blocks[0].operations, env, uses)
        return uses

    def _flow(self, ops, env, uses):
        """Propagates weight provenance through `ops`; returns that of the terminator."""
        for op in ops:
            name = op.operation.name
            sources = [env.get(v) for v in op.operands]
            if name in ("func.return", "stablehlo.return"):
                return sources
            if name == "func.call":
                block = self._callee(op).regions[0].blocks[0]
                inner = {a: s for a, s in zip(block.arguments, sources) if s}
                returned = self._flow(block.operations, inner, uses) or []
                env.update({r: s for r, s in zip(op.results, returned) if s})
                continue
            uses.extend(WeightUse(op=name, weight=s.weight, path=s.path) for s in sources if s)
            for region in op.regions:  # while bodies see the operands as block arguments
                block = region.blocks[0]
                inner = dict(env)
                if name == "stablehlo.while":
                    inner.update({a: s for a, s in zip(block.arguments, sources) if s})
                self._flow(block.operations, inner, uses)
            source = next((s for s in sources if s), None)
            if name == "stablehlo.while":
                env.update({r: s for r, s in zip(op.results, sources) if s})
            elif source is not None and name in _WEIGHT_OPS:
                path = source.path if name in _VIEW_OPS else source.path + (name,)
                env.update({r: WeightUse(op="", weight=source.weight, path=path)
                            for r in op.results})
        return None

    # ---- counts ------------------------------------------------------------------------
    def op_counts(self) -> dict:
        """{"per_layer": [Counter per layer loop], "outside": Counter}."""
        loops = self.layer_loops()
        per_layer = []
        for loop in loops:
            counter: collections.Counter[str] = collections.Counter()
            self.walk(loop.regions[1].blocks[0].operations,
                      lambda op, counter=counter: counter.update([op.operation.name]))
            per_layer.append(counter)
        outside: collections.Counter[str] = collections.Counter()
        for op in self._top_level():
            if op in loops:
                outside.update(["stablehlo.while"])
                continue
            self.walk([op], lambda op: outside.update([op.operation.name]))
        return {"per_layer": per_layer, "outside": outside}


def runtime_conditionals(module: StepModule, ops) -> int:
    """Conditionals under `ops` that choose a branch at run time (on a GPU each one run
    reads its predicate back to the host): `case`/`if` ops of two or more branches whose
    index is not a constant, nor `platform_dependent`'s platform index (a `case` of
    constants over a constant)."""
    def constant(value) -> bool:
        owner = value.owner
        name = getattr(owner, "name", None)
        if name == "stablehlo.constant":
            return True
        return name == "stablehlo.case" and constant(owner.operands[0])

    found = [0]

    def visit(op):
        if (op.operation.name in ("stablehlo.case", "stablehlo.if")
                and len(op.regions) >= 2 and not constant(op.operands[0])):
            found[0] += 1
    module.walk(ops, visit)
    return found[0]


def heavy(counter: collections.Counter) -> dict[str, int]:
    """The heavy-op part of a counter, short names, sorted."""
    return {name.split(".")[1]: n for name, n in sorted(counter.items()) if name in HEAVY_OPS}


def summary(runner, bucket, *, platforms=("cuda",)) -> dict:
    """Op counts of one bucket's lowered step: per layer, outside the layers, per step."""
    lowered = lower_step(runner, bucket, platforms)
    module = StepModule(lowered, stacked_weight_types(runner))
    counts = module.op_counts()
    loops = module.layer_loops()
    layers = segment_counts(runner)
    per_layer = counts["per_layer"]
    outside = counts["outside"]
    heavy_per_layer = [sum(heavy(c).values()) for c in per_layer]
    return {
        "bucket": list(bucket),
        "layers_per_segment": layers,
        "per_layer_ops": [sum(c.values()) for c in per_layer],
        "per_layer_heavy": heavy_per_layer,
        "per_layer_heavy_by_op": [heavy(c) for c in per_layer],
        "outside_ops": sum(outside.values()),
        "outside_heavy": sum(heavy(outside).values()),
        "outside_heavy_by_op": heavy(outside),
        "per_step_heavy": sum(heavy(outside).values()) + int(np.dot(layers, heavy_per_layer)),
        "per_layer_conditionals": [runtime_conditionals(module, loop.regions[1].blocks[0]
                                                        .operations) for loop in loops],
        "outside_conditionals": runtime_conditionals(
            module, [op for op in module._top_level() if op not in loops]),
    }


def sampler_summary(num_seqs: int, vocab: int, max_model_len: int, *,
                    platforms=("cuda",)) -> dict:
    """Heavy ops of the sampler alone (it is part of "outside" in `summary`)."""
    from serving.executor.model_runner import padding_sampling
    from serving.sample.sampler import sample

    sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                            padding_sampling(num_seqs, max_model_len, vocab))
    with _lowering(platforms):
        lowered = jax.jit(sample).trace(jax.ShapeDtypeStruct((num_seqs, vocab), jnp.float32),
                                        sampling).lower(lowering_platforms=tuple(platforms))
    module = StepModule(lowered)
    counter: collections.Counter[str] = collections.Counter()
    ops = module.main.regions[0].blocks[0].operations
    module.walk(ops, lambda op: counter.update([op.operation.name]))
    by_op = heavy(counter)
    return {"num_seqs": num_seqs, "vocab": vocab, "ops": sum(counter.values()),
            "heavy": sum(by_op.values()), "heavy_by_op": by_op,
            "conditionals": runtime_conditionals(module, ops)}


def weight_reads(runner, bucket, *, platforms=("cuda",)) -> dict:
    """How the stacked weights reach the matmuls of one bucket's lowered step.

    whole: weights some custom call reads whole (through reshapes only);
    sliced_reads: (op, weight, path) where a custom call or a dot reads a slice of a
    weight (a per-layer copy on a GPU); consumers: per weight, the ops that take it as it
    is (through reshapes)."""
    module = StepModule(lower_step(runner, bucket, platforms), stacked_weight_types(runner))
    uses = module.weight_uses()
    consumers: dict = collections.defaultdict(collections.Counter)
    for use in uses:
        if not use.path:
            consumers[use.weight][use.op.split(".")[1]] += 1
    return {
        "weights": sorted({_type_key(a.type) for a in module.weight_args}),
        "whole": sorted({u.weight for u in uses
                         if u.op == "stablehlo.custom_call" and not u.path}),
        "sliced_reads": sorted({(u.op, u.weight, u.path) for u in uses if u.op in _READERS
                                and any(p in _SLICE_OPS for p in u.path)}),
        "consumers": {w: dict(c) for w, c in consumers.items()},
    }


_COMPILED_KINDS = {
    "fusions": r"\bfusion\(", "custom_calls": r"\bcustom-call\(",
    "triton_calls": r'custom_call_target="__gpu\$xla\.gpu\.triton"',
    "cublas_calls": r'custom_call_target="__cublas', "while": r"\bwhile\(",
    "conditional": r"\bconditional\(", "sort": r"\bsort\(", "copy": r"\bcopy\(",
    "dynamic_slice": r"\bdynamic-slice\(",
}


def per_layer_weight_shapes(runner) -> set[tuple[int, ...]]:
    """One layer's shape of every stacked matrix, and its views with the last two dims
    merged (gate_up [E, D, 2, F] is read as [E, D, 2F])."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.state)[0]:
        if "segments" in jax.tree_util.keystr(path) and leaf.ndim >= 3:
            shape = tuple(leaf.shape[1:])
            shapes |= {shape, (*shape[:-2], shape[-2] * shape[-1])}
    return shapes


def compiled_counts(hlo_text: str, weight_shapes=()) -> dict:
    """Instruction counts of a compiled (optimised) HLO module, and how many instructions
    produce an array of a per-layer weight's shape: a weight slice copied, not read in
    place (an activation of that exact shape would count too: read it as an upper bound)."""
    counts = {k: len(re.findall(p, hlo_text)) for k, p in _COMPILED_KINDS.items()}
    dims = "|".join(",".join(map(str, s)) for s in sorted(weight_shapes))
    if dims:
        copies = re.findall(rf"= \w+\[(?:{dims})\]\{{[^}}]*\}} (?:dynamic-slice|fusion|copy)\(",
                            hlo_text)
        counts["weight_slice_copies"] = len(copies)
    return counts


def _type_key(t) -> tuple[tuple[int, ...], str]:
    ranked = _ir().RankedTensorType(t)
    return tuple(ranked.shape), _DTYPE_NAMES.get(str(ranked.element_type),
                                                 str(ranked.element_type))


_DTYPE_NAMES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "i32": "int32",
                "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2", "i8": "int8",
                "ui8": "uint8"}




@dataclasses.dataclass(frozen=True)
class WeightUse:
    """A stacked weight (its (shape, dtype)) reaching an op through `path` (op names)."""
    op: str
    weight: tuple
    path: tuple[str, ...]
