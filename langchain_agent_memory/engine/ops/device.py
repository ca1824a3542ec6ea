"""What the device the engine runs on asks for: the engine's defaults on a GPU (Metal or
CUDA) and on a CPU differ, and each is measured on its own device (benchmarks/README.md).

- prefill chunk: on the CPU 128 tokens while other requests are served (a new arrival
  waits for one chunk only), 256 for a request alone; on a GPU 2048, mlx-lm's own step (a
  128-token chunk leaves an 8B model's matmuls far from the H200's peak: 256 forward
  passes for a 32K prompt);
- memory budgets: from the device's memory on a GPU (an H200 holds ~140 GB; a Mac's unified
  memory is shared with the system), fixed on the CPU (what the 2-core machine measured).
"""

from __future__ import annotations

from .runtime import mx

#: CPU prefill chunk (benchmarks/concurrency.py: behind a 3.9K-token cold prefill a new
#: arrival waited 0.59 s with 128-token chunks, 3.9 s with 512; 3161 tokens prefilled in
#: 16-19 s at 128, 256 and 512 alike).
CPU_CHUNK_TOKENS = 128
#: CPU prefill chunk of a request with no other to serve: the model's matmuls run nearer
#: their peak (SmolLM2 cold 4K, runs alternated: 128 -> 26.6, 28.3 s, 512 -> 22.5, 26.9 s;
#: later 128 -> 32.1, 30.9 s, 256 -> 28.3, 28.1 s). 256, not 512: a request arriving
#: meanwhile waits for one such chunk, and 256 already takes most of the gain.
CPU_ALONE_CHUNK_TOKENS = 256
#: GPU prefill chunk: mlx-lm's ``prefill_step_size``.
GPU_CHUNK_TOKENS = 2048
#: CPU working-copy budget: one 16K-token SmolLM2 agent (754 MB at float32), or ~15 Gemma 3
#: 270M agents of 8K tokens (its sliding layers keep their window).
CPU_WORK_BUDGET_BYTES = 1 << 30
#: CPU memory tier of the block pool.
CPU_HOT_BUDGET_BYTES = 512 << 20
#: Shares of a GPU's memory: working copies of the agents being served, and the pool's
#: memory tier of stored blocks. The rest is the model's weights and activations.
GPU_WORK_SHARE = 0.25
GPU_HOT_SHARE = 0.0625
#: Share of a GPU's memory mlx's cache of freed buffers may hold between prefill chunks.
GPU_CACHE_SHARE = 0.125
#: Live agents (hot tier) by default: on the CPU 16; on a GPU their bytes bound them
#: (``GPU_LIVE_SHARE``), not a count. Served from the stored form, an 8K agent of an 8B
#: model is ~0.37 GB: a count of 16 held 6 GB of an 80 GB H100 and sent the 17th agent of a
#: user's run back to disk (its next turn a restore, the batch broken up while it loaded).
CPU_HOT_AGENTS = 16
GPU_HOT_AGENTS = 4096
#: Share of a GPU's memory the live agents' caches may take (the weights, the steps'
#: activations and mlx's buffer cache take the rest).
GPU_LIVE_SHARE = 0.5


def on_gpu() -> bool:
    """Whether mlx runs on a GPU (Metal or CUDA) rather than the CPU."""
    return mx.default_device().type != mx.DeviceType.cpu


def memory_bytes() -> int | None:
    """The GPU's memory (Metal: the unified memory mlx may use), None on the CPU."""
    if not on_gpu():
        return None
    info = mx.device_info()
    size = info.get("total_memory") or info.get("memory_size")
    return int(size) if size else None


def mlx_memory() -> tuple[int, int]:
    """mlx's memory in this process, every engine's together: the bytes its arrays hold
    (active) and the freed buffers it keeps for reuse (cache)."""
    return mx.get_active_memory(), mx.get_cache_memory()


def chunk_tokens() -> int:
    return GPU_CHUNK_TOKENS if on_gpu() else CPU_CHUNK_TOKENS


def alone_chunk_tokens() -> int:
    return GPU_CHUNK_TOKENS if on_gpu() else CPU_ALONE_CHUNK_TOKENS


def work_budget_bytes() -> int:
    mem = memory_bytes()
    return CPU_WORK_BUDGET_BYTES if mem is None else int(mem * GPU_WORK_SHARE)


def prefill_cache_bound() -> int | None:
    """Bytes of freed buffers mlx may keep between two prefill chunks (None: no bound).

    On a GPU mlx keeps what a chunk frees for reuse, up to its memory limit. A long
    prefill's chunks free buffers of new sizes every chunk (attention over a longer
    context) that no later chunk reuses: at 64K tokens of a Gemma 3 4B shape they held 122
    GB of an H200's 150 when the next allocation failed. On the CPU mlx keeps 32 MB, and
    the engine's own reserve (``kv.reserve``) lives in that cache: no bound there."""
    mem = memory_bytes()
    return None if mem is None else int(mem * GPU_CACHE_SHARE)


def hot_agents() -> int:
    return GPU_HOT_AGENTS if on_gpu() else CPU_HOT_AGENTS


def hot_bytes() -> int | None:
    """The live agents' byte bound: a share of a GPU's memory; none on the CPU (``hot_agents``
    and the working-copy budget bound them there)."""
    mem = memory_bytes()
    return None if mem is None else int(mem * GPU_LIVE_SHARE)


def hot_budget_bytes() -> int:
    mem = memory_bytes()
    return CPU_HOT_BUDGET_BYTES if mem is None else int(mem * GPU_HOT_SHARE)


def attention() -> str:
    """What a served agent attends over by default.

    On a GPU, its stored form (``kv.stored``; on CUDA through ``kv.stored_cuda``'s kernels):
    the most agents in the device's memory. On the H100 (benchmarks/gpu_users.py, 12-07,
    random-weight Llama-3.1-8B shape) 2.85x mlx-lm's agents of 8K in the same memory, at the
    price of decode alone at 0.59x mlx-lm's speed at 32K, where a working copy decodes at
    1.15x (``"copy"``: docs/guides/gpu.md says when to choose it). Metal takes the same
    path through mlx's own ``quantized_matmul`` (not measured here: no Apple machine).

    On the CPU, a full-precision working copy within ``work_budget_bytes``: mlx's quantized
    matmuls are scalar loops there (a decode step over the stored form was 5x slower)."""
    return "stored" if on_gpu() else "copy"


def merged_batch() -> bool:
    """Whether a decode batch of agents served from working copies attends over one merged,
    left-padded copy of them (built when the batch forms, rebuilt as members join): on a GPU,
    yes (one fused attention call per layer; the copy runs at the device's bandwidth). On
    the CPU, no: each agent attends over its own copy. mlx's CPU copies made the joins of a
    fan-out of 8 SmolLM2 agents at 1K tokens cost 1.9 s against ~15 ms a step saved
    (benchmarks/fanout.py, shared prefix: round 2 6.06 -> 3.61 s, round 1 10.2 -> 9.1 s)."""
    return on_gpu()


def weight_dtype() -> str:
    """What GGUF weights are converted to: float32 on the CPU (only fp32 matmuls go through
    BLAS there), bfloat16 on a GPU (half the memory traffic, native kernels)."""
    return "bfloat16" if on_gpu() else "float32"
