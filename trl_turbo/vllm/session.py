"""What trl_turbo does for one colocated engine: set it up once it exists (`start_engine`), and order the work around
each generation (`generating`).

Design decision: the order is the memory plan of a generation, so it lives in one place, as feature code: torch's
cached blocks go back to the driver first; then the adapter reaches the sampler's weights (merged into the shared
copy, or quantized into the fp8 copy while the 16-bit weights leave the device), and full fine-tuning's released
16-bit copies are rewritten, before the KV cache is mapped; after sampling the KV cache (and what was released with
it) goes first, and only then are the base weights restored or brought back, on every way out (a return, an
exception, a KeyboardInterrupt). vLLM is reached only through `trl_turbo.vllm.engine`; the TRL seam
(`patches.trl_vllm`) calls these functions and carries the LoRA request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..config import SamplingMode
from . import engine as vllm_engine
from . import trained_weights
from .adapter import active_adapter
from .engine_plan import EnginePlan, EngineState, engine_facts, fp8_parking, warn_fp8_parking
from .fp8 import Fp8Sampling
from .merge import MergedSampling
from .sharded import ShardedShare, await_sharding
from .sharing import SHARED
from .standby import KVStandby

_GIB = 2**30


def start_engine(generation: Any, plan: EnginePlan, parked: Any) -> tuple[EngineState, EnginePlan]:
    """After vLLM is built: share (or copy) the base weights, set up the sampling mode, and release the KV cache when
    it stands by. `parked`: the training model's frozen weights waiting on the host while vLLM started. Returns the
    engine's state and its plan with the fp8 parking decided (from the host memory left once the engine exists)."""
    state = EngineState()
    state.full_finetuning = plan.full_finetuning
    llm, model = generation.llm, generation.model
    sharing, sampling = plan.sharing, plan.sampling
    fp8_rows = []  # released with the KV cache: rewritten before each generation
    if sampling is SamplingMode.FP8:
        fp8 = vllm_engine.fp8_tensors(llm)
        fp8_rows = [tensor.rows for tensor in fp8.values()]
        # one process's full fine-tuning: the 16-bit tensors are the trained ones, the linear weights fill the copy
        if plan.full_finetuning and not plan.sharded:
            state.weight_copies = vllm_engine.share_trained_parameters(llm, model, generation.accelerator.device,
                                                                       fp8=fp8)
            state.shared_bytes = state.weight_copies.shared_bytes
            views = vllm_engine.plan_views(llm, model, fp8, weights=vllm_engine.trained_parameters(model))[2]
        elif not plan.sharded:  # sharded: FSDP2's shards fill them once it has made them (`ShardedShare.complete`)
            state.shared_bytes = vllm_engine.share_base_weights(llm, model, parked, generation.accelerator.device,
                                                                fp8=fp8)
            views = vllm_engine.plan_views(llm, model.get_base_model(), fp8)[2]
    elif sharing is not None and plan.full_finetuning and not plan.sharded:
        state.weight_copies = vllm_engine.share_trained_parameters(llm, model, generation.accelerator.device)
        state.shared_bytes = state.weight_copies.shared_bytes
    elif sharing is not None:
        if plan.sharded:  # FSDP2 has not sharded the model yet: the share waits on it (`sharded.ShardedShare`)
            await_sharding(model, ShardedShare.of_engine(llm, plan.tp_size, state,
                                                         merged=sampling is SamplingMode.MERGED))
        elif sharing.mode == SHARED:
            state.shared_bytes = vllm_engine.share_base_weights(llm, model, parked, generation.accelerator.device)
        else:
            state.copy_bytes = vllm_engine.copy_base_weights(llm, model)
        if sampling is SamplingMode.MERGED:
            if not plan.sharded:  # sharded: set up on FSDP2's shards once they are vLLM's (`ShardedShare.complete`)
                state.merged = MergedSampling(model, model.active_adapter)
        elif sampling is SamplingMode.LORA:
            state.adapters = vllm_engine.TensorAdapters(llm)
    if plan.standby:
        state.standby = KVStandby(llm, also_release=fp8_rows)
        trained_weights.release_with_kv(state.weight_copies, state.standby)  # sharded: once FSDP2 has sharded
        state.standby.release()
    if sampling is SamplingMode.FP8:
        # The matrices the fp8 copy is written from come back to the device only now, after the KV cache and the
        # fp8 copy went: the engine started while they waited on the host
        if parked is not None:
            parked.unpark()
        # the host memory left once the engine holds its own: parking the 16-bit weights needs a pinned copy there
        parks, problem = fp8_parking(engine_facts(model), shards=plan.tp_size if plan.sharded else 1)
        warn_fp8_parking(problem)
        plan = dataclasses.replace(plan, fp8_parks_base=parks, fp8_park_problem=problem)
        if plan.sharded:
            await_sharding(model, ShardedShare.of_engine(llm, plan.tp_size, state, fp8=fp8, park_fp8_base=parks))
        else:
            state.fp8 = Fp8Sampling(model, active_adapter(model), fp8, views, vllm_engine.engine_dtype(llm),
                                    park_base=parks)
    return state, plan


def sync_trained_weights(state: EngineState, casts_only: bool = False) -> None:
    """Full fine-tuning's weight sync: the trained parameters that are not vLLM's memory are written into vLLM's
    copies (mapped back first where they were released with the KV cache). `casts_only`: without the collective
    reloads (see `trained_weights.refresh`)."""
    if state.weight_copies is not None:
        state.metrics["vllm/weight_copy_s"] = trained_weights.refresh(state.weight_copies, state.standby, casts_only)
        state.metrics.update(state.weight_copies.split)


@contextlib.contextmanager
def generating(llm: Any, state: EngineState, device: torch.device) -> Iterator[None]:
    """vLLM samples inside the block from the live policy; the engine's memory and the base weights are put back
    however the block ends. Timings and memory go to `state.metrics`."""
    start = time.perf_counter()
    merged, fp8, standby = state.merged, state.fp8, state.standby
    try:
        if state.before_sampling is not None:
            # the merge writes into FSDP2's shards and fp8 parks them: a layer left gathered by a forward (the
            # root's, or any under `reshard_after_forward=False`) would hand over its gathered copy instead
            state.before_sampling()
        if standby is not None or merged is not None or fp8 is not None:
            # The KV cache maps fresh device memory and the merge needs scratch: blocks torch's allocator still
            # caches from training go back to the driver first (stock TRL's sync does the same).
            torch.cuda.empty_cache()
        if merged is not None:
            merged.merge()  # before the KV cache is mapped: its fp32 scratch is freed by then
            torch.cuda.empty_cache()
        copies = state.weight_copies
        if copies is not None and trained_weights.stale(copies, standby):  # released since the last sync wrote them
            # whether a copy was released depends on this rank's allocator: no collective may hang on the decision
            sync_trained_weights(state, casts_only=True)
        if fp8 is not None:
            # each fp8 tensor's memory (empty) is mapped just before it is written, before the KV cache, while the
            # training model's 16-bit linear weights it is written from go to the host
            fp8.write(None if standby is None else lambda rows: standby.restore_weights([rows]))
            torch.cuda.empty_cache()
        if standby is not None:
            state.metrics["vllm/kv_restored_gib"] = standby.restore() / _GIB  # also resets the prefix cache
        elif merged is not None or fp8 is not None:
            llm.reset_prefix_cache()  # cached blocks were computed with the previous weights
        try:
            yield
        finally:
            free, total = torch.cuda.mem_get_info(device)
            state.metrics["vllm/generation_used_gib"] = (total - free) / _GIB
            if standby is not None:
                state.metrics["vllm/kv_released_gib"] = standby.release() / _GIB
    finally:
        if standby is not None and standby.released:
            standby.release()  # fp8 tensors mapped back for a write that stopped before the KV cache: unmapped again
        if merged is not None:
            merged.restore()  # first thing after vLLM is done with the weights, on every way out
        if fp8 is not None:
            fp8.unpark()  # after the KV cache and the fp8 copy are released
        state.metrics["vllm/generation_s"] = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats(device)
