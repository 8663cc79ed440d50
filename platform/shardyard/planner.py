"""`shardyard plan`: which parallelism a job should use on a given cluster, and why.

For every strategy and mesh the cluster allows, it estimates per-device memory (parameters,
gradients, optimizer state, activations of one micro-batch, communication buffers) and bytes each
device sends per optimizer step, then recommends the least intrusive plan that fits: data
parallel when the whole model fits, sharding (ZeRO-1, ZeRO-2, then FSDP) only when it does not,
tensor and pipeline parallelism only when sharding is not enough; and the CPU instead of a GPU
when the model is so small that a GPU step would be all launch and transfer overhead.

The state estimates follow what shardyard actually allocates, checked against
benchmarks/memory.py: fp32 weights and gradients; Adam's two moments (SGD's momentum buffer);
DeepSpeed's fp32 master copy of each optimizer partition, its partitioned gradients even at
stage 1, and at stage 3 a reduce bucket plus gathered copies of the largest layers. Activations
count what autograd saves for backward: 16 fp32 values per token per embedding dimension per
block (tensor parallelism shards 10 of them) and the logits' softmax, halved under bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardyard.layout.capabilities import check_tensor_parallel, pipeline_blocks
from shardyard.models.kv_layout import largest_lanes
from shardyard.spec import LANGUAGE_MODELS, ZERO_STAGES, GPTSpec, HFSpec, JobSpec, ModelSpec

FP32 = 4
USABLE = 0.9  # of device memory: the allocator, CUDA context and fragmentation take the rest
# A GPU step of a small model costs at least its kernel launches: about this many per block per
# pass (forward, backward counted twice) and this long each.
KERNELS_PER_BLOCK, LAUNCH_S = 12, 10e-6
GPU_FLOPS, CPU_FLOPS_PER_CORE = 100e12 * 0.3, 20e9  # sustained, fp32/bf16 mixed: rough by design


@dataclass
class Cluster:
    devices: int                   # GPUs, or CPU workers when gpu is False
    device_memory: float           # bytes per device
    nodes: int = 1
    gpu: bool = True
    cpu_cores: int = 16            # per node, for the CPU-versus-GPU estimate

    @property
    def per_node(self) -> int:
        return max(1, self.devices // self.nodes)


@dataclass
class Estimate:
    plan: str
    dp: int
    tp: int
    pp: int
    params: float
    grads: float
    optim: float
    activations: float
    buffers: float
    comm_per_step: float
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> float:
        """Parameters, gradients, optimizer state and buffers: what benchmarks/memory.py measures."""
        return self.params + self.grads + self.optim + self.buffers

    @property
    def total(self) -> float:
        return self.state + self.activations


@dataclass
class ModelShape:
    total: int          # parameters
    blocks: int         # parameters of all transformer blocks
    block_linear: int   # parameters of the blocks' linears (what tensor parallelism splits)
    largest: int        # the largest single tensor
    n_layer: int
    n_embd: int
    vocab: int
    linear: int = 0     # parameters of every linear's weight (what a CPU replica packs a copy of)

    @classmethod
    def of(cls, spec: JobSpec) -> ModelShape:
        return cls.of_model(spec.model)

    @classmethod
    def of_model(cls, spec: ModelSpec) -> ModelShape:
        from shardyard.models import build_model, repeated_blocks

        with torch.device("meta"):  # shapes only, no memory (and no pretrained weights read)
            model = build_model(spec)
        blocks = [getattr(parent, name) for parent, name in repeated_blocks(model)]
        block_params = sum(p.numel() for b in blocks for p in b.parameters())
        linear = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                     for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
        sizes = [p.numel() for p in model.parameters()]
        # Layers and width drive the activation estimate of transformers; others count as one layer.
        layers, width = 1, 0
        if isinstance(spec, GPTSpec):
            layers, width = len(blocks), spec.n_embd
        elif isinstance(spec, HFSpec):
            layers, width = len(blocks), spec.hf_config().hidden_size
        every_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return cls(sum(sizes), block_params, linear, max(sizes), layers, width, getattr(spec, "vocab_size", 0),
                   every_linear)


def optimizer_bytes_per_param(spec: JobSpec) -> int:
    if spec.optim.name == "adamw":
        return 2 * FP32  # exp_avg, exp_avg_sq
    return FP32 if spec.optim.momentum > 0 else 0


def estimate(spec: JobSpec, shape: ModelShape, strategy: str, dp: int, tp: int = 1, pp: int = 1,
             amp: bool = False) -> Estimate:
    """Per-device bytes for `strategy` over a (pp, dp, tp) mesh, and bytes sent per step."""
    # Parameters one device holds before data-parallel sharding: its stage's blocks (tensor
    # parallelism splits their linears), plus embeddings and head (on every stage, an upper bound).
    per_stage_blocks = shape.blocks / pp
    linear_share = shape.block_linear / shape.blocks if shape.blocks else 0.0
    psi = per_stage_blocks * (1 - linear_share + linear_share / tp) + (shape.total - shape.blocks)
    opt = optimizer_bytes_per_param(spec)
    weights, grads, optim, buffers = FP32 * psi, FP32 * psi, opt * psi, 0.0
    sharded_states = 2.0 if strategy in ("fsdp", "zero3") else 1.0  # all-gathers in fwd and bwd
    if strategy == "fsdp":
        weights, grads, optim = weights / dp, grads / dp, optim / dp
    elif strategy in ZERO_STAGES:
        # DeepSpeed: an fp32 master copy of each partition, and partitioned gradients at any stage.
        grads, optim = grads / dp, (opt + FP32) * psi / dp
        if ZERO_STAGES[strategy] == 3:
            weights /= dp
            buffers = FP32 * min(psi, 500_000_000) + (4 * FP32 * shape.largest if dp > 1 else 0)

    batch = spec.batch
    micro, tokens = batch.micro_batch_size, spec.model.block_size if isinstance(spec.model, LANGUAGE_MODELS) else 1
    accum = max(1, batch.global_batch_size // (micro * dp))
    per_token_block = FP32 * (6 + 10 / tp) * shape.n_embd  # 16 values a token per block at tp = 1
    in_flight = min(pp, accum) if pp > 1 else 1  # 1F1B: the first stage holds pp micro-batches
    acts = micro * tokens * (per_token_block * shape.n_layer / pp + 2 * FP32 * shape.vocab) * in_flight
    if not isinstance(spec.model, LANGUAGE_MODELS):
        acts = micro * FP32 * 4 * shape.total ** 0.5  # an MLP's few hidden layers: small anyway
    if amp:
        acts /= 2

    ring = (dp - 1) / dp if dp > 1 else 0.0
    comm = 2 * ring * FP32 * psi  # all-reduce, or reduce-scatter + all-gather: the same volume
    if strategy in ("fsdp", "zero3"):
        comm = ring * FP32 * psi * (1 + sharded_states * accum)  # gathers every micro-step
    activation_bytes = micro * tokens * FP32 * shape.n_embd * accum
    if tp > 1:  # two all-reduces per block forward, two backward
        comm += 4 * 2 * (tp - 1) / tp * activation_bytes * shape.n_layer / pp
    if pp > 1:  # activations forward, their gradients back, at each stage boundary
        comm += 2 * activation_bytes
    name = strategy + "".join(f" x {k}{v}" for k, v in (("tp", tp), ("pp", pp)) if v > 1)
    return Estimate(name, dp, tp, pp, weights, grads, optim, acts, buffers, comm)


def _splits_tensor(spec: JobSpec, tp: int) -> bool:
    try:
        check_tensor_parallel(spec.model, tp)
    except ValueError:
        return False
    return True


def _pipeline_blocks(spec: JobSpec) -> int:
    """Blocks a pipeline could split (a tied GPT counts: untying is a one-key change), 1 if none."""
    model = spec.model.model_copy(update={"tie_weights": False}) if isinstance(spec.model, GPTSpec) else spec.model
    try:
        return pipeline_blocks(model)
    except ValueError:
        return 1


def candidates(spec: JobSpec, shape: ModelShape, cluster: Cluster) -> list[Estimate]:
    """Every plan in order of preference: least communication and code change first."""
    n, amp = cluster.devices, cluster.gpu
    plans = [estimate(spec, shape, s, n, amp=amp) for s in ("ddp", "zero1", "zero2", "fsdp", "zero3")]
    splits_tp = {tp: _splits_tensor(spec, tp) for tp in (2, 4, 8)}
    layers = _pipeline_blocks(spec)
    # Tensor parallelism inside a node (it all-reduces every block), pipelines across nodes.
    for tp in (2, 4, 8):
        if tp <= cluster.per_node and n % tp == 0 and splits_tp[tp]:
            plans.append(estimate(spec, shape, "fsdp", n // tp, tp=tp, amp=amp))
    for pp in (2, 4, 8):
        if pp <= layers and n % pp == 0:
            plans.append(estimate(spec, shape, "pipeline", n // pp, pp=pp, amp=amp))
            for tp in (2, 4):
                if tp <= cluster.per_node and n % (pp * tp) == 0 and splits_tp[tp]:
                    plans.append(estimate(spec, shape, "fsdp", n // (pp * tp), tp=tp, pp=pp, amp=amp))
    return plans


def gpu_loses_to_cpu(spec: JobSpec, shape: ModelShape, cluster: Cluster) -> tuple[bool, str]:
    """Is one step faster on a node's CPU cores than on a GPU, counting the GPU's launch cost?"""
    tokens = spec.batch.global_batch_size * (spec.model.block_size if isinstance(spec.model, LANGUAGE_MODELS) else 1)
    flops = 6 * shape.total * tokens
    accum = max(1, spec.batch.global_batch_size // (spec.batch.micro_batch_size * cluster.devices))
    launches = 3 * KERNELS_PER_BLOCK * max(1, shape.n_layer) * accum
    gpu_s = launches * LAUNCH_S + flops / cluster.devices / GPU_FLOPS
    cpu_s = flops / (CPU_FLOPS_PER_CORE * cluster.cpu_cores * cluster.nodes)
    reason = (f"one step is {flops / 1e9:.2f} GFLOP: about {1e3 * cpu_s:.1f} ms on the CPUs against "
              f"{1e3 * gpu_s:.1f} ms on GPUs, mostly {launches} kernel launches")
    return cpu_s < gpu_s, reason


def recommend(spec: JobSpec, cluster: Cluster, shape: ModelShape | None = None
              ) -> tuple[Estimate | None, list[Estimate], str]:
    """(the chosen plan or None, every plan considered, why)."""
    shape = shape or ModelShape.of(spec)
    plans = candidates(spec, shape, cluster)
    budget = USABLE * cluster.device_memory
    if cluster.gpu:
        cpu_wins, why = gpu_loses_to_cpu(spec, shape, cluster)
        if cpu_wins:
            best = plans[0]
            return best, plans, (f"train on CPU with {best.plan}: {why}; transfers and launches "
                                 f"would dominate a GPU step")
    fitting = [p for p in plans if p.total <= budget]
    if not fitting:
        smallest = min(plans, key=lambda p: p.total)
        return None, plans, (f"nothing fits: the smallest plan ({smallest.plan}) needs "
                             f"{_gb(smallest.total)} per device, {_gb(budget)} usable; add devices or memory, "
                             f"or lower batch.micro_batch_size")
    best = fitting[0]
    skipped = plans[:plans.index(best)]
    if not skipped:
        reason = f"{best.plan}: the whole model fits on every device ({_gb(best.total)} of {_gb(budget)} usable)"
    else:
        reason = (f"{best.plan}: {', '.join(p.plan for p in skipped)} would need "
                  f"{_gb(min(p.total for p in skipped))}+ per device, over {_gb(budget)} usable; "
                  f"{best.plan} needs {_gb(best.total)}")
    return best, plans, reason


@dataclass(frozen=True)
class ServingMemory:
    """What one serving replica of a language model holds (split over its shards, if any), in its
    serving dtype (serve/executor/precision.py): the sizes the engine allocates."""
    dtype: torch.dtype
    weights: float      # the parameters
    packed: float       # on CPUs: each linear's weight again, in oneDNN's layout (serve/executor/packed_linear.py)
    kv_tokens: int
    kv_cache: float     # the paged KV cache's blocks
    lanes: float        # at most: every running request's positions again (models/kv_cache.py); paged: 0

    @property
    def total(self) -> float:
        return self.weights + self.packed + self.kv_cache + self.lanes

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        packed = f" + {_gb(self.packed)} packed for oneDNN" if self.packed else ""
        return (f"{_gb(self.total)} in {dtype}: weights {_gb(self.weights)}{packed} + KV cache {_gb(self.kv_cache)} "
                f"({self.kv_tokens:,} tokens)" + (f" + lanes up to {_gb(self.lanes)}" if self.lanes else ""))


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int | None:
    """The keys and values one position takes over every layer, or None for a model whose layers
    the spec does not describe (a custom module)."""
    if isinstance(spec, GPTSpec):
        return 2 * spec.n_layer * spec.n_embd * dtype.itemsize
    if not isinstance(spec, HFSpec):
        return None
    config = spec.hf_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def serving_memory(spec: ModelSpec, dtype: torch.dtype, kv_tokens: int, max_running: int,
                   use_gpu: bool, paged: bool = False) -> ServingMemory | None:
    """A replica's memory serving `spec` with a KV cache of `kv_tokens` positions and up to
    `max_running` requests at once over the model's whole context (`paged`: attention reads the
    blocks in place, no lanes); None where the KV cache's size cannot be told."""
    per_token = kv_bytes_per_token(spec, dtype)
    if per_token is None:
        return None
    shape = ModelShape.of_model(spec)
    lanes = largest_lanes(max_running, spec.block_size)
    packs = not use_gpu and dtype in (torch.float32, torch.bfloat16)
    return ServingMemory(dtype, shape.total * dtype.itemsize, shape.linear * dtype.itemsize if packs else 0,
                         kv_tokens, kv_tokens * per_token, 0 if paged else lanes[0] * lanes[1] * per_token)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def table(plans: list[Estimate], chosen: Estimate | None, budget: float) -> str:
    header = ["plan", "dp", "tp", "pp", "params", "grads", "optim", "activations", "buffers", "total",
              "fits", "comm/step"]
    rows = [[("* " if p is chosen else "  ") + p.plan, str(p.dp), str(p.tp), str(p.pp), _gb(p.params),
             _gb(p.grads), _gb(p.optim), _gb(p.activations), _gb(p.buffers), _gb(p.total),
             "yes" if p.total <= budget else "no", _gb(p.comm_per_step)] for p in plans]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def parse_bytes(text: str) -> float:
    """'80GB', '80GiB', '512MB', '1.5e9' -> bytes (GB and GiB both mean 2**30: device sizes)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: give a number with an optional unit, e.g. 80GB, 24GiB, "
                         f"512MB") from None
    if not value > 0:
        raise ValueError(f"{text!r}: a device's memory must be more than 0")
    return value * scale
