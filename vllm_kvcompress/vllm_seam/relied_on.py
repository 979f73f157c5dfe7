"""The vLLM symbols the plugin relies on without patching them: plain data.

patches.py lists what the plugin replaces; this lists what it subclasses,
overrides, imports, calls and reads. `scripts/seam_check.py` resolves both
lists in a vLLM source tree (installed, or a wheel's files, by `ast` alone)
and compares signatures with the installed vLLM 0.32's; docs/vllm-versions.md
has its output. Symbols already in patches.PATCHES are not repeated here.

One line per symbol (a line starting "    |" continues it): kind | target | vLLM versions | why.
  kind: class, function (module level), method (signature compared, found in
      the class or a base class), attribute (a class attribute, dataclass
      field, property, method, or `self.x = ...` in a method), module;
  target: `module:Qualified.name`; alternatives joined by " or " (the first
      found wins, and the report names it) where vLLM legitimately moved a
      symbol and the seam looks in every place. A target the seam names in one
      place only lists that place, so that a move shows up as missing;
  versions: the vLLM minor versions the seam relies on it ("0.32-0.34"), as
      in patches.PATCHES (rows for the V1 runner end at 0.33: 0.34 has none).

Importing this module imports nothing of vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import covers


@dataclass(frozen=True)
class Relied:
    kind: str  # class | function | method | attribute | module
    target: str  # "module:Qual.name", alternatives joined by " or "
    versions: str  # "0.32-0.34"
    why: str

    @property
    def alternatives(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target.split(" or "))

    @property
    def symbol(self) -> str:
        return self.alternatives[0].replace(":", ".")

    def applies_to(self, minor: str) -> bool:
        return covers(self.versions, minor)


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_MGR = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_V1_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
_V1_TABLE = "vllm.v1.worker.block_table:BlockTable"
_MRV2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_MRV2_BATCH = "vllm.v1.worker.gpu.input_batch:InputBatch"
_CM = "vllm.v1.attention.backend:CommonAttentionMetadata"
_SO = "vllm.v1.core.sched.output"
_CPU = "vllm.v1.attention.backends.cpu_attn"
_FA = "vllm.v1.attention.backends.flash_attn"
_COORD = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"
_ATTN = "vllm.model_executor.layers.attention.attention:Attention"
_ROPE = "vllm.model_executor.layers.rotary_embedding.base:"

_TABLE = f"""
class | {_SCHED} | 0.32-0.34 | scheduler.KVCompressScheduler subclasses it
method | {_SCHED}.schedule | 0.32-0.34 | overridden: plan compressions, then vLLM's schedule
method | {_SCHED}.update_from_output | 0.32-0.34 | overridden: take the workers' layer budgets and failures
method | {_SCHED}._get_local_prefix_cache_hit | 0.32-0.34 | overridden: cap a prefix-cache hit
method | {_SCHED}._reserve_prefill_lookahead | 0.32-0.34 | overridden: end a chunk at a compression; note who may be due
method | {_SCHED}._free_request_blocks | 0.32-0.34 | overridden: finish, abort and preemption drop the state
method | {_SCHED}.finish_requests | 0.32-0.34 | called: failed requests finish with FINISHED_ERROR
attribute | {_SCHED}.vllm_config | 0.32-0.34 | read in __init__ (additional_config)
attribute | {_SCHED}.kv_cache_config | 0.32-0.34 | read in __init__ (kv_cache_groups)
attribute | vllm.v1.kv_cache_interface:KVCacheConfig.num_blocks | 0.32-0.34 | bytes per block (stats)
attribute | vllm.v1.kv_cache_interface:KVCacheConfig.kv_cache_tensors | 0.32-0.34 | bytes per block (stats)
attribute | vllm.v1.kv_cache_interface:KVCacheConfig.needs_kv_cache_zeroing | 0.32-0.34
    | a compaction's fresh blocks zeroed as vLLM zeroes its own (hybrids: stale state bytes)
attribute | vllm.v1.kv_cache_interface:KVCacheTensor.size | 0.32-0.34 | bytes per block (stats)
attribute | {_SCHED}.kv_cache_manager | 0.32-0.34 | block pool, coordinator, managers
attribute | {_SCHED}.requests | 0.32-0.34 | request by id
method | {_SCHED}._preempt_request | 0.32-0.34 | called: growth-aware admission preempts as vLLM does
attribute | {_SCHED}.max_model_len | 0.32-0.34 | a request's growth bound (admission)
attribute | {_SCHED}.max_num_scheduled_tokens | 0.32-0.34 | a step's token budget (admission)
attribute | vllm.v1.core.kv_cache_manager:KVCacheManager.watermark_blocks | 0.32-0.34 | admission keeps vLLM's watermark
attribute | vllm.v1.request:Request.max_tokens | 0.32-0.34 | a request's growth bound (admission)
attribute | vllm.v1.request:Request.num_tokens | 0.32-0.34 | prompt and output tokens so far
attribute | vllm.v1.request:Request.status | 0.32-0.34 | preempted or waiting
attribute | {_SO}:SchedulerOutput.total_num_scheduled_tokens | 0.32-0.34 | the step's size (worker)
attribute | vllm.v1.kv_cache_interface:KVCacheConfig.kv_cache_groups | 0.32-0.34 | the worker's groups
attribute | vllm.v1.engine.core:EngineCore.scheduler | 0.32-0.34 | kv_compress_stats reads its scheduler
attribute | vllm.entrypoints.llm:LLM.llm_engine | 0.32-0.34 | vllm_kvcompress.stats(llm)
attribute | vllm.v1.engine.llm_engine:LLMEngine.engine_core | 0.32-0.34 | stats(): the core client
method | vllm.v1.engine.core_client:SyncMPClient.call_utility | 0.32-0.34 | stats(): a spawned core's utility call
attribute | vllm.v1.engine.core_client:InprocClient.engine_core | 0.32-0.34 | stats(): an in-process core
attribute | {_SCHED}.running | 0.32-0.34 | idle check for the stats snapshot
attribute | {_SCHED}.waiting | 0.32-0.34 | idle check for the stats snapshot
attribute | vllm.v1.core.kv_cache_manager:KVCacheManager.coordinator | 0.32-0.34 | its single_type_managers
attribute | vllm.v1.core.kv_cache_manager:KVCacheManager.block_pool | 0.32-0.34 | free block count
method | vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks | 0.32-0.34 | a capped prefix hit (0.32)
attribute | {_COORD}.single_type_managers | 0.32-0.34 | per-group managers
method | {_COORD}.find_longest_cache_hit | 0.32-0.34 | a capped prefix hit (0.32)
attribute | vllm.v1.request:Request.request_id | 0.32-0.34 | read by the scheduler
attribute | vllm.v1.request:Request.sampling_params | 0.32-0.34 | per-request overrides (extra_args)
attribute | vllm.v1.request:Request.num_prompt_tokens | 0.32-0.34 | the plan's prompt length
attribute | vllm.v1.request:Request.num_computed_tokens | 0.32-0.34 | next compression point
attribute | vllm.v1.request:Request.block_hashes | 0.32-0.34 | a capped prefix hit (0.32); reuse: states found by them
attribute | vllm.v1.request:Request.all_token_ids | 0.32-0.34 | reuse: a state's history, a prompt's beginning
attribute | vllm.v1.request:Request.client_index | 0.32-0.34 | a failed request's error output
method | vllm.v1.request:Request.is_finished | 0.32-0.34 | preempted or finished
class | vllm.v1.request:RequestStatus | 0.32-0.34 | imported by scheduler.py
attribute | vllm.v1.request:RequestStatus.FINISHED_ERROR | 0.32-0.34 | failed requests
attribute | vllm.v1.request:RequestStatus.FINISHED_STOPPED | 0.32-0.34 | reuse: a completed request's state is kept
attribute | vllm.v1.request:RequestStatus.FINISHED_LENGTH_CAPPED | 0.32-0.34 | reuse: as FINISHED_STOPPED
attribute | {_SCHED}.cache_config | 0.32-0.34 | reuse: prefix caching on
attribute | vllm.config.cache:CacheConfig.enable_prefix_caching | 0.32-0.34 | reuse needs it
class | vllm.v1.engine:EngineCoreOutput | 0.32-0.34 | imported by scheduler.py: a failed request's output
attribute | vllm.v1.engine:EngineCoreOutput.request_id | 0.32-0.34 | constructed by keyword
attribute | vllm.v1.engine:EngineCoreOutput.new_token_ids | 0.32-0.34 | constructed by keyword
attribute | vllm.v1.engine:EngineCoreOutput.finish_reason | 0.32-0.34 | constructed by keyword
class | vllm.v1.engine:EngineCoreOutputs | 0.32-0.34 | imported by scheduler.py
attribute | vllm.v1.engine:EngineCoreOutputs.outputs | 0.32-0.34 | a failed request's output is appended
attribute | vllm.v1.engine:EngineCoreOutputs.finished_requests | 0.32-0.34 | kvzip: repeat passes left out
method | vllm.v1.request:Request.__init__ | 0.32-0.34 | kvzip: a repeat pass's request, constructed by keyword
attribute | vllm.v1.request:Request._block_hasher | 0.32-0.34 | kvzip: a repeat pass hashes blocks as its request
attribute | vllm.v1.request:Request.prompt_token_ids | 0.32-0.34 | kvzip: the prompt a repeat pass repeats
attribute | vllm.v1.request:Request.mm_features | 0.32-0.34 | kvzip: multimodal prompts are not repeated
attribute | vllm.v1.request:Request.lora_request | 0.32-0.34 | kvzip: a repeat pass runs as its request
attribute | vllm.v1.request:Request.cache_salt | 0.32-0.34 | kvzip: a repeat pass hits its request's blocks
attribute | vllm.v1.request:Request.priority | 0.32-0.34 | kvzip: a repeat pass runs as its request
attribute | vllm.v1.request:Request.arrival_time | 0.32-0.34 | kvzip: a repeat pass runs as its request
method | {_SCHED}.add_request | 0.32-0.34 | kvzip: a repeat pass enqueued
method | vllm.v1.core.sched.request_queue:RequestQueue.remove_requests | 0.32-0.34
    | kvzip: repeat passes moved to the front of the waiting queue
method | vllm.v1.core.sched.request_queue:RequestQueue.prepend_requests | 0.32-0.34
    | kvzip: repeat passes moved to the front of the waiting queue
attribute | vllm.sampling_params:SamplingParams.max_tokens | 0.32-0.34 | kvzip: a repeat pass samples one token
attribute | vllm.sampling_params:SamplingParams.temperature | 0.32-0.34 | kvzip: a repeat pass samples greedily
attribute | vllm.config.model:ModelConfig.tokenizer | 0.32-0.34 | kvzip: the repeat instructions' tokens
attribute | vllm.config.model:ModelConfig.tokenizer_revision | 0.32-0.34 | kvzip: the repeat instructions' tokens
attribute | vllm.config.model:ModelConfig.trust_remote_code | 0.32-0.34 | kvzip: the repeat instructions' tokens
class | vllm.v1.engine:FinishReason | 0.32-0.34 | imported by scheduler.py
attribute | vllm.v1.engine:FinishReason.ERROR | 0.32-0.34 | finish_reason of a failed request
attribute | vllm.v1.outputs:ModelRunnerOutput.sampled_token_ids | 0.32-0.34 | a failed request's token is dropped
attribute | vllm.v1.outputs:ModelRunnerOutput.req_ids | 0.32-0.34 | the rows of sampled_token_ids
attribute | vllm.v1.engine:EngineCoreRequest.prompt_token_ids | 0.32-0.34 | wrap_process_inputs: the prompt's length
attribute | vllm.v1.engine:EngineCoreRequest.prompt_embeds | 0.32-0.34 | wrap_process_inputs: the prompt's length
attribute | {_SO}:SchedulerOutput.num_scheduled_tokens | 0.32-0.34 | the step's requests (scheduler)
attribute | {_SO}:SchedulerOutput.finished_req_ids | 0.32-0.34 | worker: drop ended requests
attribute | {_SO}:SchedulerOutput.preempted_req_ids | 0.32-0.34 | worker: drop preempted requests (getattr)
attribute | {_SO}:SchedulerOutput.scheduled_new_reqs | 0.32-0.34 | MRV2 view: host block ids
attribute | {_SO}:SchedulerOutput.scheduled_cached_reqs | 0.32-0.34 | MRV2 view: host block ids
attribute | {_SO}:SchedulerOutput.scheduled_spec_decode_tokens | 0.32-0.34 | requests verifying drafts (getattr)
attribute | vllm.config.vllm:VllmConfig.speculative_config | 0.32-0.34 | check_speculation: n-gram, draft model
attribute | vllm.engine.arg_utils:EngineArgs.speculative_config | 0.32-0.34 | its method checked first
attribute | vllm.config.speculative:SpeculativeConfig.method | 0.32-0.34 | check_speculation: the proposer
attribute | vllm.config.speculative:SpeculativeConfig.parallel_drafting | 0.32-0.34 | refused (getattr)
attribute | vllm.config.speculative:SpeculativeConfig.model | 0.32-0.34 | no method: resolved from the draft
method | vllm.v1.spec_decode.draft_model:DraftModelProposer._get_model | 0.32-0.33
    | its prefix "draft_model" names the draft's layers (groups.DRAFT_PREFIX)
attribute | vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.positions | 0.32-0.33
    | the draft's logical positions, read for its physical slots
attribute | vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._slot_mapping_buffer | 0.32-0.33
    | a further draft token's slots, rewritten physical
attribute | vllm.v1.worker.gpu_model_runner:GPUModelRunner.drafter | 0.32-0.33 | the worker attaches to it
attribute | vllm.config.vllm:VllmConfig.use_v2_model_runner | 0.32-0.33
    | a draft model on Model Runner V2 checked against the seam's rows (getattr: 0.34 has no V1 runner)
attribute | {_SO}:NewRequestData.req_id | 0.32-0.34 | MRV2 view: host block ids
attribute | {_SO}:NewRequestData.block_ids | 0.32-0.34 | MRV2 view: host block ids
attribute | {_SO}:CachedRequestData.req_ids | 0.32-0.34 | MRV2 view: host block ids
attribute | {_SO}:CachedRequestData.new_block_ids | 0.32-0.34 | MRV2 view: host block ids
class | vllm.v1.core.block_pool:BlockPool | 0.32-0.34 | imported by block_manager.py
method | vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block | 0.32-0.34 | drop_cached_hash
method | vllm.v1.core.block_pool:BlockPool.is_block_writable | 0.32-0.34 | copies_needed
method | vllm.v1.core.block_pool:BlockPool.get_num_free_blocks | 0.32-0.34 | copies_needed, stats
method | vllm.v1.core.block_pool:BlockPool.get_new_blocks | 0.32-0.34 | copy-on-write blocks
method | vllm.v1.core.block_pool:BlockPool.free_blocks | 0.32-0.34 | evicted tails
attribute | vllm.v1.core.block_pool:BlockPool.num_gpu_blocks | 0.32-0.34 | stats total
method | vllm.v1.core.block_pool:BlockPool._insert_block_hash | 0.32-0.34
    | reuse: a saved state's blocks get keys of their own (vLLM's own hash kept; an offload manager calls it too)
method | vllm.v1.core.block_pool:BlockPool.touch | 0.32-0.34 | reuse: a request holds its saved state's blocks
attribute | vllm.v1.core.block_pool:BlockPool.cached_block_hash_to_block | 0.32-0.34 | reuse: blocks still named
method | vllm.v1.core.block_pool:BlockHashToBlockMap.contain | 0.32-0.34 | reuse: a block still carries its key
function | vllm.v1.core.kv_cache_utils:make_block_hash_with_group_id | 0.32-0.34 | reuse: a block's key in its group
class | vllm.v1.core.kv_cache_utils:KVCacheBlock | 0.32-0.34 | imported by block_manager.py
attribute | vllm.v1.core.kv_cache_utils:KVCacheBlock.block_id | 0.32-0.34 | BlockCopy ids
attribute | vllm.v1.core.kv_cache_utils:KVCacheBlock.ref_cnt | 0.32-0.34 | shared block check
attribute | vllm.v1.core.kv_cache_utils:KVCacheBlock.is_null | 0.32-0.34 | held block count
class | {_MGR} | 0.32-0.34 | block_manager.CompressedAttentionManager subclasses it
method | {_MGR}.get_num_blocks_to_allocate | 0.32-0.34 | overridden with explicit parameters
method | {_MGR}.allocate_new_blocks | 0.32-0.34 | overridden with explicit parameters
method | {_MGR}.cache_blocks | 0.32-0.34 | overridden: (request, num_tokens, *args)
method | vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager.get_num_skipped_tokens | 0.32-0.34
    | reuse: the window of a sliding-window group a saved state keeps
attribute | vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager.req_to_blocks | 0.32-0.34
    | reuse: a sliding-window group's blocks of a finishing request
attribute | vllm.v1.core.block_pool:BlockPool.null_block | 0.32-0.34
    | reuse: a sliding-window state's blocks before its window
method | vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.cache_blocks | 0.32-0.34
    | wrapped per instance on groups that do not compress: (request, num_tokens, *args)
method | {_MGR}.pop_blocks_for_free | 0.32-0.34 | overridden
method | {_MGR}.add_local_computed_blocks | 0.32-0.34 | overridden: a hit on a saved state counts physical tokens
attribute | {_MGR}.req_to_blocks | 0.32-0.34 | a request's blocks, cut in place
attribute | {_MGR}.block_size | 0.32-0.34 | blocks of a length
attribute | {_MGR}.block_pool | 0.32-0.34 | frees, new blocks
class | vllm.v1.kv_cache_interface:FullAttentionSpec | 0.32-0.34 | block_manager.CompressedAttentionSpec subclasses it
attribute | vllm.v1.kv_cache_interface:FullAttentionSpec.block_size | 0.32-0.34 | read by the scheduler
attribute | vllm.v1.kv_cache_interface:FullAttentionSpec.sliding_window | 0.32-0.34 | refuse merged sliding layers
attribute | vllm.v1.kv_cache_interface:FullAttentionSpec.attention_chunk_size | 0.32-0.34 | refuse chunked attention
class | vllm.v1.kv_cache_interface:SlidingWindowSpec | 0.32-0.34 | imported by groups.py
class | vllm.v1.kv_cache_interface:MambaSpec | 0.32-0.34 | Gated DeltaNet state groups, left to vLLM (groups.py)
class | vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs | 0.32-0.34 | imported by groups.py
attribute | vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs.kv_cache_specs | 0.32-0.34 | per-layer specs
attribute | vllm.v1.kv_cache_interface:KVCacheGroupSpec.kv_cache_spec | 0.32-0.34 | replaced per group
attribute | vllm.v1.kv_cache_interface:KVCacheGroupSpec.layer_names | 0.32-0.34 | layer indices per group
class | vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry | 0.32-0.34 | imported by block_manager.py
method | vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered | 0.32-0.34 | built-ins first
method | vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register | 0.32-0.34 | CompressedAttentionSpec's manager
function | vllm.v1.core.kv_cache_utils:create_kv_cache_group_specs | 0.32 | groups.py, beside get_kv_cache_groups
function | vllm.v1.core.kv_cache_planning:create_kv_cache_group_specs | 0.33-0.34 | groups.py: where 0.33 moved it
class | {_CPU}:CPUAttentionBackend | 0.32-0.34 | attention.KVCompressCPUBackend subclasses it
method | {_CPU}:CPUAttentionBackend.get_impl_cls | 0.32-0.34 | overridden (staticmethod)
class | {_CPU}:CPUAttentionBackendImpl | 0.32-0.34 | attention.KVCompressCPUImpl subclasses it
method | {_CPU}:CPUAttentionBackendImpl.forward | 0.32-0.34 | overridden (ObserveQueries)
class | {_FA}:FlashAttentionBackend | 0.32-0.34 | attention.KVCompressFlashBackend subclasses it
method | {_FA}:FlashAttentionBackend.get_impl_cls | 0.32-0.34 | overridden (staticmethod)
method | {_FA}:FlashAttentionBackend.get_builder_cls | 0.32-0.34 | overridden (staticmethod)
class | {_FA}:FlashAttentionImpl | 0.32-0.34 | attention.KVCompressFlashImpl subclasses it
method | {_FA}:FlashAttentionImpl.forward | 0.32-0.34 | overridden (ObserveQueries)
class | {_FA}:FlashAttentionMetadataBuilder | 0.32-0.34 | attention.KVCompressFlashMetadataBuilder
method | {_FA}:FlashAttentionMetadataBuilder.__init__ | 0.32-0.34 | overridden, called positionally
attribute | {_FA}:FlashAttentionMetadataBuilder.supports_update_block_table | 0.32-0.34 | off
class | vllm.v1.attention.backends.registry:AttentionBackendEnum | 0.32-0.34 | imported by attention.py
attribute | vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN | 0.32-0.34 | our CPU backend
attribute | vllm.v1.attention.backends.registry:AttentionBackendEnum.FLASH_ATTN | 0.32-0.34 | our CUDA backend
function | vllm.v1.attention.backends.registry:register_backend | 0.32-0.34 | imported by attention.py
attribute | {_CM}.query_start_loc | 0.32-0.34 | the step's rows (draft slots, metadata edits)
attribute | {_CM}.block_table_tensor | 0.32-0.34 | the draft's physical slots
attribute | {_CM}.slot_mapping | 0.32-0.34 | the draft's first pass, made physical
attribute | {_CM}.seq_lens | 0.32-0.34 | metadata edits
attribute | {_CM}.seq_lens_cpu_upper_bound | 0.32-0.34 | metadata edits
attribute | {_CM}.max_seq_len | 0.32-0.34 | metadata edits
attribute | {_CM}.num_reqs | 0.32-0.34 | metadata edits
attribute | {_CM}._num_computed_tokens_cache | 0.32-0.34 | reset by the metadata edits
method | {_CM}.replace | 0.32-0.34 | metadata edits (a copy)
attribute | vllm.v1.worker.utils:AttentionGroup.kv_cache_group_id | 0.32-0.34 | build_metadata wrapper
attribute | {_ATTN}.kv_cache | 0.32-0.34 | the layer's cache tensor (worker state, self-test)
attribute | {_ATTN}.impl | 0.32-0.34 | scale, kv_cache_dtype, soft cap / ALiBi / sinks checks
attribute | {_ATTN}.layer_name | 0.32-0.34 | the layer's index and step passes
attribute | {_ATTN}.num_heads | 0.32-0.34 | this rank's query heads
attribute | {_ATTN}.num_kv_heads | 0.32-0.34 | this rank's KV heads
attribute | {_ATTN}.attn_backend | 0.32-0.34 | the backend's name picks the cache layout
attribute | {_ATTN}._k_scale | 0.32-0.34 | FLASH_ATTN layout self-test
attribute | {_ATTN}._v_scale | 0.32-0.34 | FLASH_ATTN layout self-test
attribute | {_ATTN}._k_scale_float | 0.32-0.34 | fp8 served at scale 1 only; CPU layout self-test
attribute | {_ATTN}._v_scale_float | 0.32-0.34 | fp8 served at scale 1 only; CPU layout self-test
attribute | {_CPU}:CPUAttentionMetadataBuilder.isa or {_ATTN}.isa | 0.32-0.34
    | CPU layout self-test reads layer.isa: the builder sets its own on each layer (no static member of Attention)
method | {_CPU}:CPUAttentionBackend.get_name | 0.32-0.34 | the cache layout by backend name
method | {_FA}:FlashAttentionBackend.get_name | 0.32-0.34 | the cache layout by backend name
attribute | {_CPU}:CPUAttentionBackendImpl.scale | 0.32-0.34 | the scorers' softmax scale
attribute | {_CPU}:CPUAttentionBackendImpl.logits_soft_cap | 0.32-0.34 | refused unless none (scores)
attribute | {_CPU}:CPUAttentionBackendImpl.alibi_slopes | 0.32-0.34 | refused unless none (scores)
attribute | {_CPU}:CPUAttentionBackendImpl.sinks | 0.32-0.34 | refused unless none (scores)
attribute | {_CPU}:CPUAttentionBackendImpl.kv_cache_dtype | 0.32-0.34 | auto or fp8 (cache_layout.CacheDType)
attribute | {_FA}:FlashAttentionImpl.scale | 0.32-0.34 | the scorers' softmax scale
attribute | {_FA}:FlashAttentionImpl.kv_cache_dtype | 0.32-0.34 | refused unless auto (fp8 unchecked on CUDA)
module | vllm._custom_ops | 0.32-0.34 | imported by worker/startup.py (as ops)
function | vllm._cpu_ops:cpu_attn_reshape_and_cache or vllm._custom_ops:cpu_attn_reshape_and_cache | 0.32-0.34
    | CPU layout self-test (startup._cpu_ops: vllm._cpu_ops from 0.34 on)
function | vllm._custom_ops:reshape_and_cache_flash | 0.32-0.34 | layout self-test on CUDA
function | vllm.distributed:get_tensor_model_parallel_rank | 0.32-0.34 | imported by worker/startup.py
function | vllm.distributed:get_tensor_model_parallel_world_size | 0.32-0.34 | imported by worker/startup.py
function | vllm.distributed:get_tp_group | 0.32-0.34 | imported by worker/startup.py and worker/state.py
attribute | vllm.distributed.parallel_state:GroupCoordinator.cpu_group | 0.32-0.34 | failed-request gather
method | vllm.distributed.parallel_state:GroupCoordinator.all_gather | 0.32-0.34 | head shard gather
attribute | vllm:__version__ | 0.32-0.34 | versions.installed_vllm_version: the window
attribute | vllm.platforms:current_platform | 0.32-0.34 | imported by patches.py and engine_checks.py
method | vllm.platforms.interface:Platform.is_cpu | 0.32-0.34 | platform choice
method | vllm.platforms.interface:Platform.is_cuda | 0.32-0.34 | platform choice
class | vllm.config:CUDAGraphMode | 0.32-0.34 | imported by engine_checks.py
attribute | vllm.config:CUDAGraphMode.PIECEWISE | 0.32-0.34 | default mode with compression
method | vllm.config:CUDAGraphMode.has_full_cudagraphs | 0.32-0.34 | refused mode
method | vllm.config:CUDAGraphMode.has_piecewise_cudagraphs | 0.32-0.34 | splitting ops check
method | vllm.config.compilation:CompilationConfig.splitting_ops_contain_attention | 0.32-0.34 | splitting ops check
attribute | vllm.config.compilation:CompilationConfig.cudagraph_mode | 0.32-0.34 | set and checked
attribute | vllm.config.compilation:CompilationConfig.static_forward_context | 0.32-0.34 | the attention layers
class | vllm.exceptions:VLLMValidationError | 0.32-0.34 | imported by request_checks.py (parameter=)
class | vllm.sampling_params:SamplingParams | 0.32-0.34 | imported by request_checks.py
attribute | vllm.sampling_params:SamplingParams.extra_args | 0.32-0.34 | per-request kv_compress settings
attribute | vllm.engine.arg_utils:EngineArgs.additional_config | 0.32-0.34 | where the config travels
attribute | vllm.engine.arg_utils:EngineArgs.scheduler_cls | 0.32-0.34 | KVCompressScheduler
attribute | vllm.engine.arg_utils:EngineArgs.async_scheduling | 0.32-0.34 | turned off
attribute | vllm.engine.arg_utils:EngineArgs.kv_transfer_config | 0.32-0.34 | refused
attribute | vllm.engine.arg_utils:EngineArgs.pipeline_parallel_size | 0.32-0.34 | refused above 1
attribute | vllm.engine.arg_utils:EngineArgs.kv_cache_dtype | 0.32-0.34 | cache_layout.CACHE_DTYPES or refused
attribute | vllm.engine.arg_utils:EngineArgs.attention_backend | 0.32-0.34 | FLASH_ATTN on CUDA
attribute | vllm.engine.arg_utils:EngineArgs.compilation_config | 0.32-0.34 | piecewise CUDA graphs
attribute | vllm.engine.arg_utils:EngineArgs.enforce_eager | 0.32-0.34 | piecewise CUDA graphs
attribute | vllm.engine.arg_utils:EngineArgs.disable_sliding_window | 0.32-0.34 | a window no shorter than the context
attribute | vllm.config.vllm:VllmConfig.additional_config | 0.32-0.34 | where the config travels
attribute | vllm.config.vllm:VllmConfig.model_config | 0.32-0.34 | model checks
attribute | vllm.config.vllm:VllmConfig.cache_config | 0.32-0.34 | kv_sharing_fast_prefill
attribute | vllm.config.vllm:VllmConfig.parallel_config | 0.32-0.34 | parallelism checks
attribute | vllm.config.vllm:VllmConfig.device_config | 0.32-0.34 | CUDA graph checks on CUDA
attribute | vllm.config.device:DeviceConfig.device_type | 0.32-0.34 | CUDA graph checks on CUDA
attribute | vllm.config.cache:CacheConfig.kv_sharing_fast_prefill | 0.32-0.34 | refused (getattr)
attribute | vllm.config.parallel:ParallelConfig.decode_context_parallel_size | 0.32-0.34 | refused above 1 (getattr)
attribute | vllm.config.parallel:ParallelConfig.prefill_context_parallel_size | 0.32-0.34 | refused above 1 (getattr)
attribute | vllm.config.parallel:ParallelConfig.enable_dbo | 0.32-0.34 | refused (getattr)
attribute | vllm.config.parallel:ParallelConfig.use_ubatching | 0.32-0.34 | refused (getattr)
attribute | vllm.config.model:ModelConfig.dtype | 0.32-0.34 | the layout self-test's values
attribute | vllm.config.model:ModelConfig.hf_text_config | 0.32-0.34 | layer_types
method | vllm.config.model:ModelConfig.get_sliding_window | 0.32-0.34 | all-sliding models refused
method | vllm.config.model:ModelConfig.get_num_layers | 0.32-0.34 | layer count
method | vllm.config.model:ModelConfig.get_total_num_kv_heads | 0.32-0.34 | tensor-parallel check
method | vllm.config.model:ModelConfig.get_num_attention_heads | 0.32-0.34 | score memory (CUDA)
method | vllm.config.model:ModelConfig.get_num_kv_heads | 0.32-0.34 | score memory (CUDA)
method | vllm.config.model:ModelConfig.get_head_size | 0.32-0.34 | score memory (CUDA)
attribute | vllm.config.model:ModelConfig.use_mla | 0.32-0.34 | refused
attribute | vllm.config.model:ModelConfig.is_hybrid | 0.32-0.34 | refused
attribute | vllm.config.model:ModelConfig.is_attention_free | 0.32-0.34 | refused
attribute | vllm.config.model:ModelConfig.max_model_len | 0.32-0.34 | limits
attribute | vllm.config.cache:CacheConfig.kv_cache_memory_bytes | 0.32-0.34 | score memory (CUDA)
attribute | vllm.config.vllm:VllmConfig.scheduler_config | 0.32-0.34 | query moments memory (CUDA)
attribute | vllm.config.scheduler:SchedulerConfig.max_num_seqs | 0.32-0.34 | query moments memory (CUDA)
attribute | vllm.config.cache:CacheConfig.cache_dtype | 0.32-0.34 | score memory (CUDA)
attribute | vllm.config.parallel:ParallelConfig.tensor_parallel_size | 0.32-0.34 | KV head check
attribute | {_V1}.vllm_config | 0.32-0.33 | V1 runner: the config
attribute | {_V1}.compilation_config | 0.32-0.33 | V1 runner: static_forward_context
attribute | {_V1}.kv_cache_config | 0.32-0.33 | V1 runner: KV cache groups
attribute | {_V1}.attn_groups | 0.32-0.33 | V1 runner: attention groups to attach to
method | {_V1}.get_model | 0.32-0.33 | V1 runner: the model, for its rotary embeddings
attribute | {_V1}.requests | 0.32-0.33 | V1 view: host block ids (CachedRequestState)
attribute | {_V1}.input_batch | 0.32-0.33 | V1 view: the persistent batch
attribute | {_V1}.positions | 0.32-0.33 | V1 view: logical positions
attribute | {_V1}.seq_lens | 0.32-0.33 | V1 view: group 0's physical lengths in place
attribute | {_V1}.optimistic_seq_lens_cpu | 0.32-0.33 | V1 view: the host copy, in place
attribute | vllm.v1.utils:CpuGpuBuffer.gpu | 0.32-0.33 | V1 view: query_start_loc on the device
attribute | {_V1}.query_start_loc | 0.32-0.33 | V1 view: slot mapping
attribute | vllm.v1.worker.gpu_input_batch:CachedRequestState.block_ids | 0.32-0.33 | V1 view: truncated in place
attribute | {_V1_BATCH}.req_id_to_index | 0.32-0.33 | V1 view: a request's table row
attribute | {_V1_BATCH}.block_table | 0.32-0.33 | V1 view: a block table per group
attribute | {_V1_BATCH}.num_reqs | 0.32-0.33 | V1 view: step batch
attribute | {_V1_BATCH}.req_ids | 0.32-0.33 | V1 view: step batch
attribute | {_V1_BATCH}.num_computed_tokens_cpu | 0.32-0.33 | V1 view: step batch
method | vllm.v1.worker.block_table:MultiGroupBlockTable.__getitem__ | 0.32-0.33 | V1 view: block_table[group]
method | {_V1_TABLE}.clear_row | 0.32-0.33 | V1 view: refill a row
method | {_V1_TABLE}.add_row | 0.32-0.33 | V1 view: refill a row
method | {_V1_TABLE}.compute_slot_mapping | 0.32-0.33 | V1 view: physical slots
attribute | {_V1_TABLE}.block_size | 0.32-0.33 | V1 view: kernel block size
attribute | {_MRV2}.vllm_config | 0.32-0.34 | MRV2 runner: the config
attribute | {_MRV2}.compilation_config | 0.32-0.34 | MRV2 runner: static_forward_context
attribute | {_MRV2}.kv_cache_config | 0.32-0.34 | MRV2 runner: KV cache groups
attribute | {_MRV2}.attn_groups | 0.32-0.34 | MRV2 runner: attention groups to attach to
method | {_MRV2}.get_model | 0.32-0.34 | MRV2 runner: the model, for its rotary embeddings
attribute | {_MRV2}.block_tables | 0.32-0.34 | MRV2 view: BlockTables
attribute | {_MRV2}.req_states | 0.32-0.34 | MRV2 view: request state rows
attribute | {_MRV2}.kernel_block_sizes | 0.32-0.34 | MRV2 view: kernel block size per group
attribute | vllm.v1.worker.gpu.states:RequestState.req_id_to_index | 0.32-0.34 | MRV2 view: a request's table row
attribute | vllm.v1.worker.gpu.block_table:BlockTables.num_blocks | 0.32-0.34 | MRV2 view: a row's block count
attribute | vllm.v1.worker.gpu.block_table:BlockTables.block_tables | 0.32-0.34 | MRV2 view: staged rows
attribute | vllm.v1.worker.gpu.block_table:BlockTables.block_sizes | 0.32-0.34 | MRV2 view: physical slots
attribute | vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor.np | 0.32-0.34 | MRV2 view: num_blocks.np
method | vllm.v1.worker.gpu.buffer_utils:StagedWriteTensor.stage_write | 0.32-0.34 | MRV2 view: (index, start, ids)
attribute | {_MRV2_BATCH}.req_ids | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.num_reqs | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.num_tokens | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.num_scheduled_tokens | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.num_computed_tokens_np | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.positions | 0.32-0.34 | MRV2 view: step batch
attribute | {_MRV2_BATCH}.seq_lens | 0.32-0.34 | MRV2 view: seq_lens device
attribute | vllm.v1.worker.gpu.async_utils:AsyncOutput.model_runner_output | 0.32-0.34 | MRV2: the report rides on it
attribute | {_MRV2}.speculator | 0.32-0.33 | MRV2: the draft model's speculator, attached to
attribute | vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator.attn_groups | 0.32-0.33
    | MRV2 draft: its own attention groups, physical lengths
attribute | vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator.block_tables | 0.32-0.33
    | MRV2 draft: seen through runner_view.PhysicalDraftTables while it proposes
method | vllm.v1.worker.gpu.block_table:BlockTables.compute_slot_mappings | 0.32-0.33
    | MRV2 draft: (idx_mapping, query_start_loc, positions, ...) -> [groups, tokens], made physical
attribute | vllm.v1.worker.gpu.block_table:BlockTables.input_block_tables | 0.32-0.33
    | MRV2 draft: the step's gathered rows, for its physical slots
class | {_ROPE}RotaryEmbedding | 0.32-0.34 | expected attention: a table indexed by position (startup.query_geometry)
attribute | {_ROPE}RotaryEmbeddingBase.cos_sin_cache | 0.32-0.34
    | expected attention: [max position, rotary_dim] cos then sin, the queries turned back with it
attribute | {_ROPE}RotaryEmbeddingBase.is_neox_style | 0.32-0.34 | expected attention: NeoX's layout only
attribute | {_ROPE}RotaryEmbeddingBase.rotary_dim | 0.32-0.34 | expected attention: partial RoPE
attribute | vllm.model_executor.layers.rotary_embedding.linear_scaling_rope:LinearScalingRotaryEmbedding.scaling_factors
    | 0.32-0.34 | expected attention: one factor only
attribute | vllm.model_executor.models.llama:LlamaAttention.rotary_emb | 0.32-0.34
    | expected attention: a layer's RoPE beside its `attn` (the same names in every model served)
attribute | vllm.model_executor.models.llama:LlamaAttention.attn | 0.32-0.34 | expected attention: see rotary_emb
"""


def _parse(table: str) -> tuple[Relied, ...]:
    rows = table.strip().replace("\n    |", " |").splitlines()  # "    | ..." continues a row
    return tuple(Relied(*(cell.strip() for cell in row.split("|"))) for row in rows)


RELIED_ON = _parse(_TABLE)

# What a wrapper reads on the object it wraps, beyond the patched method
# itself: patches.PATCHES `make` -> (kind, attribute) on each patched row's
# owner class, checked for every row with that `make` (rows added later included).
WRAPPER_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "request_checks.wrap_openai_handler": (("method", "create_error_response"),),  # (message, param=...)
    "request_checks.wrap_process_inputs": (("attribute", "vllm_config"),),
    "worker.hooks.wrap_determine_available_memory": (("attribute", "vllm_config"), ("attribute", "cache_config"),
                                                     ("attribute", "model_config"), ("attribute", "parallel_config")),
}


@dataclass(frozen=True)
class Reviewed:
    """A signature change the seam was checked to handle: the check reports it as
    `changed (reviewed)` and does not fail on it."""

    symbol: str  # as the check names it (module.Owner.attr)
    versions: str  # where the new signature holds
    signature: str  # exactly as the check prints it
    why: str

    def applies_to(self, minor: str) -> bool:
        return covers(self.versions, minor)


REVIEWED: tuple[Reviewed, ...] = (
    Reviewed("vllm.v1.core.sched.scheduler.Scheduler._get_local_prefix_cache_hit", "0.33-0.34",
             "(self, request, max_cache_hit_length=None)",
             "the override takes (request, *args, **kwargs) and passes min(cap, max_cache_hit_length) on"),
    Reviewed("vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache", "0.34",
             "(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None, extensible=False)",
             "the wrapper passes *args/**kwargs through and reads only is_profiling (first after the config)"),
    Reviewed("vllm.v1.core.block_pool.BlockPool.free_blocks", "0.34", "(self, ordered_blocks, evict_first=False)",
             "the plugin passes the blocks only; the new parameter has a default"),
    Reviewed("vllm.entrypoints.scale_out.render.serving.ServingRender.render_chat_request", "0.33-0.34",
             "async (self, request, raw_request=None, engine_chat_template_kwargs=None)",
             "wrap_openai_handler binds (*args, **kwargs) to the original's signature and passes them through"),
    Reviewed("vllm.v1.request.Request.__init__", "0.34",
             "(self, request_id, prompt_token_ids, sampling_params, pooling_params, client_index=0, arrival_time=None, "
             "prompt_embeds=None, prompt_is_token_ids=None, mm_features=None, lora_request=None, cache_salt=None, "
             "priority=0, trace_headers=None, block_hasher=None, resumable=False, session_id=None, "
             "reasoning_ended=None, reasoning_parser_kwargs=None, abort_immediately=False, kv_hints=None, "
             "block_hashes=None)",
             "a kvzip repeat pass is constructed by keyword; the new parameter has a default (hashed by block_hasher)"),
)
