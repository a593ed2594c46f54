"""What an LLMEngine is built from: its mesh, tokenizer, paged KV cache, scheduler and runner."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from qwen_jax.config import ModelConfig
from qwen_jax.eagle3 import Eagle3Head, load_eagle3
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.params import resolve_kv_cache_dtype
from qwen_jax.planner import kv_bytes_per_page
from qwen_jax.sharding import make_mesh, pp_size, tp_size
from qwen_jax.tokenizer import Tokenizer
from qwen_jax.validation import require
from qwen_jax.weights import (
    DEFAULT_DRAFT_DIR,
    DEFAULT_EAGLE3_DIR,
    DEFAULT_MODEL_DIR,
    resolve_model_path,
)
from serving.core.buckets import bucket_pairs
from serving.core.config import SchedulerConfig
from serving.core.kv_cache_manager import KVCacheManager
from serving.core.scheduler import Scheduler
from serving.core.swap import SwapManager
from serving.engine.config import EngineConfig
from serving.engine.draft_proposer import DraftModelProposer
from serving.engine.lora import EngineLoRA, lora_setup
from serving.engine.pipeline import PipelineLoop
from serving.executor import distributed, kv_cache
from serving.executor.draft_runner import DraftRunner
from serving.executor.eagle_runner import EagleRunner
from serving.executor.model_inputs import PageTable
from serving.executor.model_runner import ModelRunner
from serving.executor.pipeline_runner import PipelineRunner
from serving.executor.swap_store import SwapStore

DEFAULT_MAX_MODEL_LEN = 4096


def model_dtype(config: EngineConfig) -> str:
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def model_impl(config: EngineConfig) -> str | None:
    return None if config.impl == "auto" else config.impl


def replica_mesh(config: EngineConfig, model_path: Path, devices):
    """The PP x TP x EP mesh of one replica; None for one device (plain jit, no
    shard_map)."""
    parallel = config.parallel
    if parallel.replica_size == 1 and devices is None:
        return None
    devices = list(devices if devices is not None else jax.devices())
    parallel.validate(ModelConfig.from_hf(model_path), len(jax.devices()))
    if parallel.pipeline_parallel_size > 1:
        check_pipeline_options(config)
    return make_mesh(parallel.tensor_parallel_size, parallel.expert_parallel_size, devices,
                     parallel.pipeline_parallel_size)


def check_pipeline_options(config: EngineConfig) -> None:
    """What pipeline stages do not run with yet: ValueError naming the option."""
    pp = config.parallel.pipeline_parallel_size
    refused = [
        ("speculative_config", config.speculative_config is not None,
         "None (the pipeline's ticks verify no drafts)"),
        ("enable_lora", config.enable_lora, "False (adapter slots are not split by stage)"),
        ("swap_space", config.cache.swap_space > 0, "0 (recompute preempted requests)")]
    for field, bad, needed in refused:
        if bad:
            raise ValueError(f"pipeline_parallel_size={pp} needs {field}: {needed}")


def load_tokenizer(config: EngineConfig, model_path: Path) -> Tokenizer | None:
    path = Path(config.tokenizer or model_path)
    tokenizer = Tokenizer.from_dir(path) if path.is_dir() else None
    if tokenizer is not None:
        tokenizer.token_bytes()  # the detokenizer's table, built now (not at a first request)
    return tokenizer


@dataclasses.dataclass(frozen=True)
class CacheSetup:
    """The paged KV cache and everything sized from it."""

    scheduler_config: SchedulerConfig  # max_model_len resolved
    page_size: int
    pages_per_seq: int
    kv_cache_dtype: object  # a jnp dtype
    bytes_per_page: int
    num_pages: int
    kv_manager: KVCacheManager
    page_table: PageTable
    swap_store: SwapStore | None
    scheduler: Scheduler
    runner: ModelRunner
    bucket_pairs: list
    draft: DraftModelProposer | None = None  # speculative method draft_model
    lora: EngineLoRA | None = None  # enable_lora: the adapter slots


def _draft_dir(config: EngineConfig, default: Path) -> Path:
    """speculative_config.model, or (for the embedded model only) its shipped `default`."""
    spec = config.speculative_config
    assert spec is not None
    if spec.model is None:
        require(resolve_model_path(config.model or DEFAULT_MODEL_DIR).resolve()
                == DEFAULT_MODEL_DIR.resolve(),
                "speculative_config.model", None,
                f"{'the EAGLE-3 head' if spec.method == 'eagle3' else 'the draft model'}'s "
                "directory (only the embedded model has a default draft)")
    return resolve_model_path(spec.model or default)


def load_draft_model(config: EngineConfig, target: Qwen3ForCausalLM, mesh
                     ) -> Qwen3ForCausalLM | Eagle3Head | None:
    """The draft of `speculative_config` (None for ngram or none): method draft_model's
    model in the target's dtype, kernels and mesh (its vocabulary must be the target's),
    or method eagle3's head (the target then keeps the hidden states the head reads)."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    require(not distributed.is_multiprocess(), "speculative_config.method", spec.method,
            "ngram with several processes (the followers run the target's steps only)")
    if spec.method == "eagle3":
        head = load_eagle3(_draft_dir(config, DEFAULT_EAGLE3_DIR), target.config, target.dtype,
                           mesh=mesh)
        target.aux_layers = head.config.aux_layer_ids
        return head
    draft = Qwen3ForCausalLM.from_pretrained(
        _draft_dir(config, DEFAULT_DRAFT_DIR), model_dtype(config), impl=model_impl(config),
        load_format=config.load_format, seed=config.seed, mesh=mesh)
    vocab = target.config.vocab_size
    require(draft.config.vocab_size == vocab, "speculative_config.model", spec.model,
            f"a model with the target's vocabulary of {vocab} tokens (it has "
            f"{draft.config.vocab_size})")
    return draft


def draft_bytes_per_page(draft, target: Qwen3ForCausalLM, page_size: int, dtype, mesh) -> int:
    """What a page costs the draft besides the target's K/V: the draft model's K/V, or
    an EAGLE-3 head's one layer of K/V plus the target's kept hidden states."""
    if draft is None:
        return 0
    if isinstance(draft, Qwen3ForCausalLM):
        return kv_bytes_per_page(draft.config, page_size, dtype, tp_size(mesh))
    kv = 2 * page_size * draft.num_cache_kv_heads * draft.config.head_dim
    aux = page_size * len(target.aux_layers) * target.config.hidden_size
    return (kv * jax.numpy.dtype(dtype).itemsize // tp_size(mesh)
            + aux * jax.numpy.dtype(target.dtype).itemsize)


def draft_proposer(draft, target: Qwen3ForCausalLM, runner: ModelRunner, page_table, spec,
                   sched: SchedulerConfig, *, num_pages: int, page_size: int,
                   pages_per_seq: int, dtype):
    """The proposer of a draft model or an EAGLE-3 head (None without one)."""
    if draft is None or spec is None:
        return None
    common = dict(num_drafts=spec.num_speculative_tokens, page_size=page_size,
                  pages_per_seq=pages_per_seq, width=runner.prev_width)
    if isinstance(draft, Eagle3Head):
        embed = target.embed_tokens[...]
        draft_runner: DraftRunner = EagleRunner(
            draft, draft.init_kv_cache(num_pages, page_size, dtype), embed_tokens=embed,
            aux_cache=lambda: runner.kv_caches[-1][0], runtime=target.runtime, **common)
    else:
        draft_runner = DraftRunner(draft, kv_cache.allocate(draft, num_pages, page_size, dtype),
                                   mesh=draft.mesh, **common)
    return DraftModelProposer(
        draft_runner, page_table, page_size=page_size, pages_per_seq=pages_per_seq,
        token_buckets=sched.token_bucket_sizes, seq_buckets=sched.seq_bucket_sizes,
        lag=int(isinstance(draft, Eagle3Head)))


def build_cache(config: EngineConfig, model: Qwen3ForCausalLM, mesh) -> CacheSetup:
    """Size and allocate the KV cache, then the scheduler and runner that use it; with a
    draft model (load_draft_model), its own cache of the same pages (sized together)."""
    draft = load_draft_model(config, model, mesh)
    lora = lora_setup(config, model)  # its buffers allocated before the cache is sized
    sched, cache, model_config = config.scheduler, config.cache, model.config
    if sched.max_model_len is None:  # vLLM takes the model's; capped to keep the page
        # table (and the CPU reference attention, which reads all of it) small
        sched = dataclasses.replace(sched, max_model_len=min(
            DEFAULT_MAX_MODEL_LEN, model_config.max_position_embeddings))
    max_model_len = sched.resolved_max_model_len
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}")
    page_size = cache.block_size  # vLLM's option name for the page size
    pages_per_seq = sched.pages_per_seq(page_size)
    dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, model.dtype)
    max_pages = 1 + sched.max_num_seqs * pages_per_seq
    bytes_per_page = kv_bytes_per_page(model_config, page_size, dtype, tp_size(mesh),
                                       model_config.num_hidden_layers // pp_size(mesh))
    draft_bytes = draft_bytes_per_page(draft, model, page_size, dtype, mesh)
    num_pages = kv_cache.num_pages_to_allocate(cache, bytes_per_page + draft_bytes, max_pages)
    caches = kv_cache.allocate(model, num_pages, page_size, dtype)
    kv_manager = KVCacheManager(num_pages, page_size, cache.enable_prefix_caching)
    page_table = PageTable(pages_per_seq, sched.max_num_seqs)
    kv_manager.listener = page_table
    # host pages for `swap_space` GiB (per device, as vLLM counts it)
    num_host_pages = int(cache.swap_space * 2**30) // bytes_per_page
    if num_host_pages and distributed.is_multiprocess():
        raise ValueError(f"swap_space={cache.swap_space} is not supported with multiple "
                         "processes; use 0 (recompute)")
    swap_store = SwapStore(num_pages, pages_per_seq) if num_host_pages else None
    scheduler = Scheduler(sched, kv_manager,
                          swap=SwapManager(num_host_pages, cache.swap_min_tokens))
    scheduler.lora = None if lora is None else lora.slots
    runner = make_runner(model, caches, mesh, sched, max_model_len=max_model_len,
                         pages_per_seq=pages_per_seq)
    proposer = draft_proposer(draft, model, runner, page_table, config.speculative_config,
                              sched, num_pages=num_pages, page_size=page_size,
                              pages_per_seq=pages_per_seq, dtype=dtype)
    return CacheSetup(sched, page_size, pages_per_seq, dtype, bytes_per_page, num_pages,
                      kv_manager, page_table, swap_store, scheduler, runner,
                      bucket_pairs(sched.token_bucket_sizes, sched.seq_bucket_sizes), proposer,
                      lora)


def make_runner(model: Qwen3ForCausalLM, caches, mesh, sched: SchedulerConfig,
                **kwargs) -> ModelRunner:
    """The step's runner; over pipeline stages, the pipeline's ticks."""
    common = dict(mesh=mesh, max_num_seqs=max(sched.seq_bucket_sizes), **kwargs)
    if pp_size(mesh) > 1:
        return PipelineRunner(model, caches, max_num_tokens=max(sched.token_bucket_sizes),
                              **common)
    return ModelRunner(model, caches, **common)


def pipeline_loop(runner: ModelRunner, scheduler: Scheduler, mesh, pairs) -> PipelineLoop | None:
    """The engine's loop of pipeline ticks when its runner runs them (None otherwise),
    overlapped as the plain loop is (`async_scheduling`, one process); the scheduler then
    keeps each batch's sequences out until their tokens are read."""
    if not isinstance(runner, PipelineRunner):
        return None
    overlap = scheduler.config.async_scheduling and not distributed.is_multiprocess()
    loop = PipelineLoop(runner.depth, pp_size(mesh), pairs, overlap)
    scheduler.pipeline_depth = loop.groups
    return loop


def precompile(setup: CacheSetup, progress: bool) -> float:
    """Compile every bucket's step up front (and the swap copies, the draft's steps);
    returns the seconds it took."""
    seconds = setup.runner.precompile(setup.bucket_pairs, progress=progress)
    if setup.swap_store is not None:
        setup.swap_store.compile(setup.runner.kv_caches)
    if setup.draft is not None:  # the draft model's proposals, per bucket too
        seconds += setup.draft.runner.precompile(setup.bucket_pairs)
    return seconds
