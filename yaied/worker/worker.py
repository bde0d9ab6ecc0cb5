"""The worker: owns the model and the KV tensors, and runs one step at a time.

Only the worker thread calls into it (the engine hands it batches through a one-thread executor),
so model and KV tensors need no locks. An exception in a step is caught here and returned as a
StepOutput with an error, so the engine fails that step's requests and goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from typing import TYPE_CHECKING

import torch

from yaied.core import host_memory
from yaied.core.config import EngineConfig
from yaied.core.model_info import ModelInfo
from yaied.core.step import Batch, StepOutput
from yaied.kernels.cpu_isa import LEVELS, detected_level, selected_level
from yaied.worker.batch_invariant import check_device as check_batch_invariant
from yaied.worker.batch_invariant import check_kernels as check_batch_invariant_kernels
from yaied.worker.cpu_model import prepare_cpu_model
from yaied.worker.gpu_setup import (
    GRAPH_RESERVE_BYTES,
    kv_cache_bytes,
    resolve_attention_backend,
    warmup_seqs,
)
from yaied.worker.loader import load_model
from yaied.worker.model_runner import LaunchedStep, ModelRunner
from yaied.worker.models.llama import LlamaForCausalLM
from yaied.worker.models.transformers_backend import TransformersModel
from yaied.worker.parallel.leader import LeaderRunner, RankLauncher, TensorParallel
from yaied.worker.quantized import quantized_types
from yaied.worker.runner_setup import (
    KVCaches,
    allocate_kv,
    build_runner,
    capture_graphs,
    resolve_kv_dtype,
)
from yaied.worker.step_failures import describe, is_fatal, rerun_one_by_one

if TYPE_CHECKING:
    from yaied.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    """The torch device for a config's `device.device`; a CUDA device always with its index, since
    torch.cuda.set_device refuses a bare "cuda"."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return torch.device(name)
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    device = torch.device(name)
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r} asked for, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def kv_bytes_per_token(hf_shape, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * hf_shape.num_layers * hf_shape.num_kv_heads * hf_shape.head_dim * element


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        *,
        show_progress: bool = True,
        rank_launcher: RankLauncher | None = None,  # tensor-parallel ranks started elsewhere
    ) -> None:
        self.config = config
        self.device = pick_device(config.device.device)
        check_batch_invariant(config, self.device)
        if self.device.type == "cuda":
            # Triton launches, CUDA graph capture, events and bare synchronize() calls go to the
            # current device: make it ours (cuda:1 etc.). This thread runs every step too.
            torch.cuda.set_device(self.device)
        # The CPU's ISA level, capped by YAIED_CPU_ISA (a bad cap stops the start here); every
        # CPU kernel is built for it, and it picks the default math dtype.
        self.isa = selected_level() if self.device.type == "cpu" else None
        threads = config.device.threads or os.cpu_count() or 1
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
            # torch applies its process-wide default to a thread at that thread's first parallel
            # op; asking for the count now fixes this one's, whatever threads that keep off the
            # cores set later (yaied/engine/threads.py).
            torch.get_num_threads()
        # Tensor parallelism: this thread is rank 0; the other ranks are processes it spawns.
        self.parallel: TensorParallel | None = None
        if config.engine.tensor_parallel_size > 1:
            self.parallel, self.loaded = TensorParallel.start(config, self.device, rank_launcher)
        else:
            self.loaded = load_model(
                config.model, self.device, show_progress=show_progress, level=self.isa
            )
        try:
            self._set_up(config)
        except BaseException:
            self.close()  # no tensor-parallel rank outlives a failed start
            raise
        # Test-only fault injection: a callable run before each step (see tests).
        self.fault_hook = None

    def _set_up(self, config: EngineConfig) -> None:
        """The KV pool sized, allocated, and the runner (and CUDA graphs) built around it."""
        self._kernels: list = []  # the CPU kernels the model uses (for the level they run at)
        self.backend = resolve_attention_backend(
            config.device.attention_backend,
            self.device.type,
            native=not isinstance(self.loaded.model, TransformersModel),
        )
        if self.isa is not None:
            self._kernels = prepare_cpu_model(
                self.loaded, config, self.isa, config.scheduler.max_num_batched_tokens
            )
        elif self.backend == "triton" and self.parallel is None:
            self._prepare_gpu_model()
        shape = self.loaded.model.shape
        page_size = config.cache.page_size
        self.kv_dtype = resolve_kv_dtype(
            config.cache.kv_cache_dtype,
            self.loaded.dtype,
            self.device,
            self.backend,
            self.loaded.weight_dtype,
        )
        num_pages = self._num_pages(kv_bytes_per_token(shape, self.kv_dtype) * page_size)
        max_len = self.loaded.max_model_len
        if num_pages * page_size < max_len:
            raise ValueError(
                f"the KV pool holds {num_pages * page_size} tokens, less than one request's "
                f"context of {max_len}: raise cache.kv_cache_gib or lower model.max_model_len"
            )
        self.kv_caches = self._allocate_kv(num_pages)
        self.runner = self._runner(self.kv_caches)
        if config.engine.batch_invariant:
            check_batch_invariant_kernels(self.runner)
        if self._use_graphs():
            self.runner.graphs = self._capture_graphs(max_len)
        self.info = ModelInfo(
            num_pages=num_pages,
            page_size=page_size,
            max_model_len=max_len,
            vocab_size=shape.vocab_size,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            device=str(self.device),
            weight_dtype=str(self.loaded.weight_dtype or self.loaded.dtype).removeprefix("torch."),
            cpu_isa=self._kernel_level(),
            quantization=quantized_types(self.loaded.model),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
        )
        if self.isa is not None:
            prefill = self.runner.prefill_kernel
            log.info(
                "CPU kernels at ISA level %s (this CPU: %s, selected: %s); math %s, weights %s%s"
                ", KV pools %s; prefill attention %s%s",
                self.info.cpu_isa or "none (torch paths)",
                detected_level(),
                self.isa,
                self.info.dtype,
                self.info.weight_dtype,
                f", projections {self.info.quantization}" if self.info.quantization else "",
                self.info.kv_cache_dtype,
                prefill.path(self.runner.dtype, shape.head_dim) if prefill else "torch",
                "; batch-invariant" if config.engine.batch_invariant else "",
            )

    def _prepare_gpu_model(self) -> None:
        """The fused Triton kernels for a native model's elementwise work (before the KV pool
        is sized: the warm-up pass then measures the activations they allocate). Tensor-
        parallel ranks keep the torch ops, so rank 0 does the same and every rank rounds alike."""
        from yaied.kernels.triton_fused import TritonFusedOps  # imports triton: GPU path only

        model = self.loaded.model
        if isinstance(model, LlamaForCausalLM):
            model.use_fused_ops(TritonFusedOps())

    def _kernel_level(self) -> str:
        """The lowest ISA level among the CPU kernels in use (a kernel that failed to build at
        the selected level fell back to a lower one), "" where none is."""
        runner = self.runner
        used = [*self._kernels, runner.decode_kernel, runner.prefill_kernel]
        levels = [kernel.level for kernel in used if kernel is not None]
        return min(levels, key=LEVELS.index, default="")

    def _allocate_kv(self, num_pages: int) -> KVCaches:
        page_size = self.config.cache.page_size
        return allocate_kv(self.loaded.model, num_pages, page_size, self.kv_dtype, self.device)

    def _runner(self, kv_caches: KVCaches) -> ModelRunner:
        model, config, device, backend = self.loaded.model, self.config, self.device, self.backend
        dtype = self.loaded.dtype
        if self.parallel is None:
            return build_runner(model, kv_caches, config, device, backend, dtype=dtype)
        self.parallel.send_pool(kv_caches[0][0].shape[1])  # the same pool on every rank
        runner = build_runner(model, kv_caches, config, device, backend, LeaderRunner, dtype)
        runner.parallel = self.parallel
        return runner

    def _use_graphs(self) -> bool:
        cuda = self.device.type == "cuda"
        return cuda and self.backend == "triton" and self.config.device.cuda_graphs

    def _capture_graphs(self, max_len: int) -> DecodeGraphs:
        if self.parallel is not None:
            self.parallel.send_graphs(max_len)  # every rank captures: collectives inside
        return capture_graphs(self.loaded.model, self.kv_caches, self.config, max_len, self.device)

    def _num_pages(self, page_bytes: int) -> int:
        if self.device.type == "cuda":
            return max(self._profile_kv_bytes() // page_bytes, 1)
        gib = self.config.cache.kv_cache_gib
        if page_bytes > gib * 2**30:  # not even one page: never a pool past what was asked for
            raise ValueError(
                f"cache.page_size = {self.config.cache.page_size}: one KV page takes "
                f"{page_bytes / 2**20:.1f} MiB, more than cache.kv_cache_gib = {gib:g}; raise "
                "cache.kv_cache_gib or lower cache.page_size"
            )
        num_pages = int(gib * 2**30 // page_bytes)
        # Zeroing a pool past what the machine has would end in the OOM killer, not a message.
        # On CPU every rank of a tensor-parallel engine holds a pool of this size.
        ranks = self.config.engine.tensor_parallel_size
        available = host_memory.available_bytes()
        if available is not None and num_pages * page_bytes * ranks > available:
            pools = f"{ranks} KV pools" if ranks > 1 else "the KV pool"
            raise ValueError(
                f"cache.kv_cache_gib = {gib:g}: {pools} would take more than the "
                f"{available / 2**30:.1f} GiB of memory left after loading the model; lower it"
            )
        return num_pages

    def _profile_kv_bytes(self) -> int:
        """Run the largest step once over a temporary pool; size the KV pool from the peak."""
        sched = self.config.scheduler
        seqs, pages = warmup_seqs(
            sched.max_num_batched_tokens, sched.max_num_seqs, self.config.cache.page_size
        )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = self._allocate_kv(pages)
        temporary = sum(k.nbytes + v.nbytes for k, v in caches)
        self._runner(caches).execute(Batch(seqs, sum(len(s.token_ids) for s in seqs)))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temporary
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_cache_bytes(
            total=total,
            free=free,
            torch_reserved=torch.cuda.memory_reserved(self.device),
            torch_peak=peak,
            utilization=self.config.cache.gpu_memory_utilization,
            graph_reserve=GRAPH_RESERVE_BYTES if self._use_graphs() else 0,
        )
        log.info("warm-up peak %.2f GiB; KV pool %.2f GiB", peak / 2**30, budget / 2**30)
        return budget

    def execute(self, batch: Batch) -> StepOutput:
        """Run one step. A step that raises is run again one sequence at a time, so a request
        that breaks it (a bad row in the sampler, say) fails alone and the rest go on; K/V writes
        are idempotent, so running a sequence twice is harmless. A CUDA error is fatal: the
        device state cannot be trusted, so the engine stops (and its process is restarted)."""
        try:
            return self._execute(batch)
        except Exception as exc:
            return self._failed(batch, exc)

    # Overlapped steps (engine.overlap_steps): the engine launches a step, schedules the next
    # while the device runs it, then calls advance() with both. One tensor-parallel rank only.

    def launch(self, batch: Batch) -> LaunchedStep | StepOutput:
        """Queue a step's device work (ModelRunner.launch); a step that raises is finished here,
        as execute() would, and its StepOutput returned instead."""
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            return self.runner.launch(batch)
        except Exception as exc:
            return self._failed(batch, exc)

    def advance(
        self, ahead: Batch | None, pending: LaunchedStep | StepOutput
    ) -> tuple[StepOutput, LaunchedStep | None]:
        """Launch ``ahead`` (scheduled on the tokens ``pending`` is sampling), then wait for
        ``pending``: (pending's output, ahead's launch or None). None when ahead was not
        launched (it raised: the engine schedules that step again from the host's view) or
        must not be used (pending failed, so its tokens, ahead's inputs, are meaningless)."""
        launched = None
        if ahead is not None and isinstance(pending, LaunchedStep):
            try:
                if self.fault_hook is not None:
                    self.fault_hook(ahead)
                launched = self.runner.launch(ahead, pending)
            except Exception as exc:
                log.warning("a step scheduled ahead failed to launch: %s", describe(exc))
                if self._fatal(exc):
                    return StepOutput([], error=describe(exc), fatal=True), None
        output = self.collect(pending)
        if launched is not None:
            if output.error is not None or output.failed:
                # Queued on the device already: let it finish, and drop it. Its failure, if any,
                # is the one pending reported (a dead device) or concerns nobody.
                with contextlib.suppress(Exception):
                    self.runner.collect(launched)
                return output, None
            launched.started = time.perf_counter()  # its own model time starts now
        return output, launched

    def collect(self, pending: LaunchedStep | StepOutput) -> StepOutput:
        """Wait for a launched step (ModelRunner.collect); a failure there fails the step."""
        if isinstance(pending, StepOutput):
            return pending
        try:
            return self.runner.collect(pending)
        except Exception as exc:
            return self._failed(pending.batch, exc)

    def _failed(self, batch: Batch, exc: Exception) -> StepOutput:
        error = describe(exc)
        log.error("step failed: %s\n%s", error, traceback.format_exc())
        if self._fatal(exc):
            return StepOutput([], error=error, fatal=True)
        if len(batch.seqs) == 1:
            return StepOutput([], error=error)
        return rerun_one_by_one(batch, error, self._execute, self._fatal)

    def _fatal(self, exc: Exception) -> bool:
        """Whether the engine must stop (is_fatal, or tensor-parallel ranks out of step); the
        ranks then go now, not at their timeout."""
        if is_fatal(exc) or self._ranks_out_of_step():
            self.close()
            return True
        return False

    def _execute(self, batch: Batch) -> StepOutput:
        if self.parallel is not None:
            self.parallel.check_ranks()
        if self.fault_hook is not None:
            self.fault_hook(batch)
        return self.runner.execute(batch)

    def _ranks_out_of_step(self) -> bool:
        """Tensor parallel: rank 0 failed between a command and the end of its collectives, so
        the other ranks wait in one it will never reach. Nothing can resync them: the engine
        stops (and is restarted)."""
        return self.parallel is not None and self.parallel.group.pending

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any; safe from any thread, and twice."""
        if self.parallel is not None:
            self.parallel.close()
