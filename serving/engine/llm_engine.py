"""LLMEngine: add requests, step (schedule -> batch -> jitted step -> outputs), abort, stats."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from pallas_kernels.choices import KernelTable
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.weights import DEFAULT_MODEL_DIR, resolve_model_path
from serving.core.lora_request import LoRARequest
from serving.core.request import (
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    prompt_token_ids,
)
from serving.core.scheduler_output import SchedulerOutput
from serving.core.structured_params import StructuredOutputsParams
from serving.engine import setup as engine_setup
from serving.engine import stats as engine_stats
from serving.engine.config import EngineConfig
from serving.engine.generation_config import sampling_defaults
from serving.engine.lora import LoRAMethods
from serving.engine.output_processor import OutputProcessor, ParentState, SeqState, stream_due
from serving.engine.prompt_scoring import PromptScoring, initial_entries, record
from serving.engine.speculation import Speculator
from serving.engine.step_records import (
    Flight,
    TokenCounts,
    constrained_rows,
    decode_only,
    sampling_entries,
    step_shape,
)
from serving.executor import compilation_cache, distributed
from serving.executor.model_inputs import build_model_inputs, step_bucket
from serving.executor.swap_store import copy_planned_swaps
from serving.metrics.step_cost import CostModel
from serving.sample.sampling_arrays import build_sampling_arrays
from serving.structured_output.grammar import GrammarCompiler, Guide
from serving.structured_output.token_mask import MaskBuilder

logger = logging.getLogger(__name__)


class LLMEngine(LoRAMethods):
    """One engine replica. `devices`: the TP x EP devices of its mesh (default: the first
    ones); data parallelism runs several replicas (see serving/entrypoints/llm.py)."""

    def __init__(self, config: EngineConfig, devices=None):
        self.config = config
        compilation_cache.enable_compilation_cache(config.compilation_cache_dir)
        started = time.perf_counter()
        self.model_path = resolve_model_path(config.model or DEFAULT_MODEL_DIR)
        self.mesh = engine_setup.replica_mesh(config, self.model_path, devices)
        self.model = Qwen3ForCausalLM.from_pretrained(
            self.model_path, engine_setup.model_dtype(config),
            impl=engine_setup.model_impl(config), load_format=config.load_format,
            seed=config.seed, mesh=self.mesh, quantization=config.quantization)
        if config.kernel_table:
            self.model.use_kernel_table(KernelTable.load(config.kernel_table))
        self.load_seconds = time.perf_counter() - started
        self.model_config = self.model.config
        self.tokenizer = engine_setup.load_tokenizer(config, self.model_path)
        eos = {*self.model_config.eos_token_ids, *getattr(self.tokenizer, "eos_token_ids", ())}
        self.output_processor = OutputProcessor(self.tokenizer, tuple(sorted(eos)))
        self.default_sampling = sampling_defaults(self.model_path, config.generation_config)
        self.grammars = (None if self.tokenizer is None else
                         GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(eos)))
        self._masks = MaskBuilder(self.model_config.vocab_size)
        setup = engine_setup.build_cache(config, self.model, self.mesh)
        self.scheduler_config, self.page_size = setup.scheduler_config, setup.page_size
        self.pages_per_seq, self.kv_cache_dtype = setup.pages_per_seq, setup.kv_cache_dtype
        self.bytes_per_page, self.num_pages = setup.bytes_per_page, setup.num_pages
        self.kv_manager, self.page_table = setup.kv_manager, setup.page_table
        self.swap_store, self.scheduler = setup.swap_store, setup.scheduler
        self.runner, self.bucket_pairs, self.lora = setup.runner, setup.bucket_pairs, setup.lora
        self._rng = np.random.default_rng(config.seed)
        self._seqs: dict[str, SeqState] = {}
        # live sequences with a grammar (its next mask needs its last token on the host,
        # so steps run serially while there is one): counted, not scanned for
        self._num_guided = 0
        self._parents: dict[str, ParentState] = {}
        self._scoring = PromptScoring()  # requests whose prompt logprobs are not all in
        self.compile_seconds = 0.0
        self.last_step: dict = {}
        self._in_flight: Flight | None = None  # dispatched, tokens not read yet
        self.num_overlapped_steps = 0  # dispatched while the step before was in flight
        self._last_retired = 0.0
        spec = config.speculative_config
        self.speculator = (None if spec is None else Speculator(
            spec, self.scheduler_config.token_bucket_sizes, setup.draft))
        self.pipeline = engine_setup.pipeline_loop(self.runner, self.scheduler, self.mesh,
                                                   self.bucket_pairs)
        if config.precompile:
            self.compile_seconds = engine_setup.precompile(setup, config.show_progress)

    # ---- construction ------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.resolved_max_model_len

    @property
    def devices(self) -> list:
        """The devices this replica runs on."""
        return [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)

    @property
    def cost_model(self) -> CostModel:
        """FLOPs and bytes per step of this engine's weights and KV cache (the metrics')."""
        return CostModel.for_engine(self)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_manager.num_total_pages * self.page_size

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None,
                    stream: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Queue a request. `step` returns its outputs as its `output_kind` says;
        `stream=False` makes that FINAL_ONLY (no per-token output objects: what offline
        generation needs)."""
        params = sampling_params or SamplingParams()
        kind = params.output_kind if stream else RequestOutputKind.FINAL_ONLY
        # By request id: its first sample may leave the scheduler while the others run.
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size,
                                     self.model_path)
        blocked = self.output_processor.blocked_ids(params)
        self._check_lora(lora_request)
        children = []
        try:
            for i in range(params.n):
                child_id = request_id if params.n == 1 else f"{i}_{request_id}"
                # Request checks the prompt is non-empty; the scheduler checks its length
                # and that the cache can ever hold it (before prompt logprobs are computed).
                request = Request(request_id=child_id, prompt_token_ids=ids, sampling_params=params,
                                  priority=priority, lora_request=lora_request,
                                  arrival_time=arrival_time or time.monotonic())
                self.scheduler.add_request(request)
                children.append(self._seq_state(request, request_id, i, blocked))
                children[-1].guide = self._guide(params, ids)
            prompt_lps = initial_entries(params.prompt_logprobs)
        except Exception:
            for child in children:
                self.scheduler.abort(child.request.request_id)
            raise
        for child in children:
            self._seqs[child.request.request_id] = child
            self._num_guided += child.guide is not None
        self._parents[request_id] = ParentState(
            request_id, text, ids, children, kind != RequestOutputKind.FINAL_ONLY, prompt_lps,
            delta=kind == RequestOutputKind.DELTA, num_prompt_logprobs=params.prompt_logprobs or 0)
        self._scoring.watch(self._parents[request_id])

    def _guide(self, params: SamplingParams, prompt_ids: list[int]) -> Guide | None:
        """The grammar guide of a request with structured outputs, else None."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs need a tokenizer; the model has none")
        if distributed.is_multiprocess():
            raise ValueError("structured_outputs are not supported with multiple processes")
        if isinstance(constraint, dict):  # SamplingParams converts these on construction
            constraint = StructuredOutputsParams.from_dict(constraint)
        return self.grammars.guide(constraint, prompt_ids)

    def _seq_state(self, request, parent_id, index, blocked) -> SeqState:
        # Children of one request get distinct streams; an explicit seed stays reproducible.
        seed = request.sampling_params.seed
        base = int(self._rng.integers(0, 2**32)) if seed is None else seed
        return self.output_processor.new_seq(request, parent_id, index,
                                             (base + index * 0x9E3779B9) % 2**32, blocked)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples); its pages are free on return."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.abort(child.request.request_id)
            self._forget(child)
        return self.output_processor.request_output(parent)

    def _forget(self, seq: SeqState) -> None:
        if self._seqs.pop(seq.request.request_id, None) is not None:
            self._num_guided -= seq.guide is not None
        if self.speculator is not None:
            self.speculator.forget(seq.request.request_id)

    def request_ids(self) -> list[str]:
        return list(self._parents)

    def request_prompt(self, request_id: str) -> tuple[str | None, list[int]]:
        """A live request's prompt text (None when given as ids) and token ids."""
        parent = self._parents[request_id]
        return parent.prompt, parent.prompt_token_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that produced a token.

        Overlapped (`async_scheduling`, the default): step N+1 is scheduled, built and
        dispatched before step N's tokens are read; the rows that decode take their input
        token from step N's output on the device, and step N's outputs are processed
        while N+1 computes. A request that finished at step N may be in N+1: that token
        is dropped. Steps run serially while a live request needs its tokens on the host
        first (grammar masks), with several processes, and while speculating."""
        if self.pipeline is not None:
            return self.pipeline.step(self)
        if self.speculator is None:
            return self._step()
        began = self.speculator.begin_step(self.scheduler.running)
        outputs = self._step()
        self.speculator.end_step(began, self.last_step)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self.last_step = {}  # set when this call reads a step's tokens
        overlap = self._can_overlap()
        if self._in_flight is not None and not overlap:
            last, self._in_flight = self._in_flight, None  # finish it, then go serial
            return self._retire(last)
        if self.speculator is not None and self.speculator.active:
            self.speculator.propose(self.scheduler.running, self._seqs)
        out = self.scheduler.schedule()
        copy_planned_swaps(self.swap_store, self.runner, out)
        if self.lora is not None:
            self.lora.write_slots(self.runner)
        flight = None if out.is_empty else self._launch(out)
        if not overlap:
            if flight is None:
                return []
            if self.speculator is None:
                self.scheduler.update_after_step(out)
                return self._retire(flight)
            outputs = self._retire(flight)  # kept drafts appended, then rejected rolled back
            self.scheduler.update_after_step(out, self.speculator.rejected)
            return outputs
        previous, self._in_flight = self._in_flight, flight
        if previous is not None and flight is not None:
            self.num_overlapped_steps += 1
        outputs = [] if previous is None else self._retire(previous)
        if flight is not None:  # after the step before's tokens are appended: the pages
            self.scheduler.update_after_step(out)  # it fills can then be hashed
            if self.last_step:  # the retired step's record: both steps ran in this call
                self.last_step["decode_only"] = self.last_step["decode_only"] and decode_only(out)
        return outputs

    def _can_overlap(self) -> bool:
        if (not self.scheduler_config.async_scheduling or distributed.is_multiprocess()
                or self.speculator is not None and self.speculator.active):
            return False
        return self._num_guided == 0

    def _launch(self, out: SchedulerOutput) -> Flight:
        """Build the step's inputs and dispatch it; returns at once."""
        buckets = self.scheduler_config.token_bucket_sizes, self.scheduler_config.seq_bucket_sizes
        bucket = step_bucket(out, *buckets)
        masks = self._masks.submit(constrained_rows(out, self._seqs, self._num_guided),
                                  bucket[1])  # filled meanwhile
        previous = self._in_flight
        drafts = None if self.speculator is None else self.speculator.on_device
        batch = build_model_inputs(out, *buckets, self.page_size, self.pages_per_seq,
                                   None if previous is None else previous.rows, self.page_table,
                                   bucket, None if drafts is None else drafts.offsets)
        sampling = build_sampling_arrays(
            sampling_entries(out, self._seqs), batch.padded_num_seqs,
            self.max_model_len, self.model_config.vocab_size,
            None if masks is None else masks.result())
        if distributed.is_multiprocess():
            distributed.publish_step(batch, sampling)
        score, claims = self._scoring.rows(out, batch, buckets[0])
        started = time.perf_counter()
        prev = (drafts.tokens if drafts is not None  # (a speculating step runs serially)
                else None if previous is None else previous.pending)
        pending = self.runner.dispatch(batch, sampling, prev, score)
        rows = {}
        for row, scheduled in enumerate(out.scheduled):
            if scheduled.samples:
                rows[scheduled.request.request_id] = row
                scheduled.request.num_pending_tokens += 1
        return Flight(out, pending, rows, started, batch, claims)

    def _retire(self, flight: Flight) -> list[RequestOutput]:
        """Read a dispatched step's tokens and process them."""
        result = flight.pending.result()
        now = time.perf_counter()
        out = flight.out
        # The device time of the step, about: from its dispatch or the step before's end.
        seconds = now - max(flight.started, self._last_retired)
        self._last_retired = now
        batch = flight.batch
        self.last_step = {"num_tokens": batch.num_tokens, "num_seqs": out.num_seqs,
                          "bucket": batch.bucket, "seconds": seconds,
                          "num_preempted": len(out.preempted),
                          "num_admitted": out.num_admitted, "shape": step_shape(batch),
                          "decode_only": decode_only(out)}
        record(flight.claims, result.prompt_logprobs, self.output_processor)
        return self._process_tokens(out, result)

    def _process_tokens(self, out, result) -> list[RequestOutput]:
        """Take each sampled token off the pending count, append it, check stops and
        grammars, emit outputs."""
        tokens = result.token_ids.tolist()  # one conversion, not a numpy scalar per row
        emitted = {} if self.speculator is None else self.speculator.verify(out, tokens)
        now = time.monotonic()  # every token of the step reached the host now
        counts = TokenCounts()
        outputs: list[RequestOutput] = []
        touched: dict[str, ParentState] = {}  # requests with n > 1
        for row, scheduled in enumerate(out.scheduled):
            if not scheduled.samples:
                continue
            request = scheduled.request
            request.num_pending_tokens -= 1  # its token is on the host now
            seq = self._seqs.get(request.request_id)
            if seq is None or request.is_finished:
                continue
            for token, source in emitted.get(row) or ((tokens[row], row),):
                if not request.is_finished:  # (a kept draft may have been its last)
                    self._append_token(seq, token, result.logprobs, source, now, counts)
            parent = self._parents[seq.parent_id]
            if len(parent.children) > 1:
                touched[seq.parent_id] = parent  # one output for its samples, after the loop
            elif request.is_finished:
                outputs.append(self._emit(parent, True))
            elif parent.stream and self._stream_due(seq):
                outputs.append(self.output_processor.streamed_delta(parent, seq) if parent.delta
                               else self.output_processor.streamed_output(parent, seq))
        for parent in touched.values():
            finished = parent.finished
            if finished or parent.stream and any(map(self._stream_due, parent.children)):
                outputs.append(self._emit(parent, finished))
        self.last_step.update(num_generated=counts.num_generated,
                              num_prompt_tokens=counts.num_prompt_tokens, token_time=now,
                              previous_token_times=counts.previous_times)
        return outputs

    def _append_token(self, seq: SeqState, token: int, logprobs, row: int, now: float,
                      counts: TokenCounts) -> None:
        """Append one sampled token to its sequence and finish the sequence if that was
        its last (a stop, or a token its grammar rejects); a failure fails its request."""
        request, vocab = seq.request, self.model_config.vocab_size
        try:
            if not 0 <= token < vocab:
                raise ValueError(f"sampled token id {token} for {request.request_id!r} "
                                 f"is outside the vocabulary [0, {vocab})")
            counts.add(request.metrics.last_token_time,
                       len(request.prompt_token_ids) if seq.index == 0 else 0)
            status = self.output_processor.append(seq, token, logprobs, row, now)
            if seq.guide is not None and not seq.guide.accept(token):
                logger.error("request %s: token %d broke its grammar: %s", seq.parent_id,
                             token, seq.guide.matcher.get_error())
                status = RequestStatus.FINISHED_ERROR
        except Exception as exc:  # one sequence's data: the cache and the rest are intact
            status = None
            self._fail(self._parents[seq.parent_id], exc)
        if status is not None:
            self.scheduler.finish(request.request_id, status)

    def _stream_due(self, seq: SeqState) -> bool:
        interval = self.scheduler_config.stream_interval
        return interval == 1 or stream_due(seq, interval)

    def _fail(self, parent: ParentState, exc: Exception) -> None:
        """End a request whose own output could not be processed: its final output carries
        the error (finish_reason "error"); the other requests of the step go on."""
        logger.error("request %s failed: %r", parent.request_id, exc)
        parent.error = f"{type(exc).__name__}: {exc}"
        for child in parent.children:
            if not child.request.is_finished:
                self.scheduler.finish(child.request.request_id, RequestStatus.FINISHED_ERROR)

    def _emit(self, parent: ParentState, finished: bool) -> RequestOutput:
        """The request's output after a step that touched it (the caller emits one each
        step while it streams, else only the final one: finished by its status, or failed
        by _fail); a finished request is forgotten."""
        output = self.output_processor.request_output(parent, finished)
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._forget(child)
        return output

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        return {**engine_stats.kv_stats(self), **engine_stats.scheduling_stats(self.scheduler),
                **({} if self.lora is None else self.lora.stats(self.scheduler))}
