"""What each method costs in time and memory at the layer shapes of ResNet-50, ViT-B/16 and GPT-2 small.

    .venv/bin/python benchmarks/cost.py [--models gpt2,vit,resnet50] [--methods none,ddp,powersgd,ab,...]
        [--size cpu|gpu|tiny] [--full] [--device cpu|cuda] [--run-steps 10000] [--out FILE]

Each model is a synthetic stand-in that stacks real layer shapes of the model it is named after
(random inputs and labels, AdamW; DeMo, which hands the optimizer the sign of its own momentum, plain SGD):

- gpt2: GPT-2 small's transformer block (qkv 768x2304, proj 768x768, MLP 768x3072 and 3072x768,
  12 heads) on a 1024-token sequence, with a tied token embedding and head of 50,257 / 12 = 4,188
  tokens, so that the head's share of the compute is the real model's (``--full``: the 12 blocks
  and the real 50,257-token vocabulary);
- vit: ViT-B/16's patch embedding (16x16 convolution, 3 -> 768), one encoder block of the same
  dims as GPT-2's (not causal) on 197 tokens per 224x224 image, the 1,000-class head (``--full``:
  12 blocks);
- resnet50: the stem, the first bottleneck of each of the four stages (1x1 and 3x3 convolutions at
  64..512 channels, the 1x1 down-sampling shortcuts up to 2048) and the 2048x1000 fc on 224x224
  images (``--full``: the real [3, 4, 6, 3] bottlenecks, ResNet-50 itself).

``--size`` picks the batch: cpu (the default on CPU: one 1024-token sequence, 4 images: a step
well under a second on one core), gpu (the default with ``--device cuda``: 8 sequences, 64
images, per worker), tiny (small made-up widths, not the real shapes: for the tests).

Every method runs in one real world of 2 workers on this machine (gloo; NCCL with --device cuda
on 2 or more GPUs; on one GPU both workers share it), one after the other, from the same seed:
``--warm`` untimed steps, then steps of each of the method's phases, then (AB-training) syncs and
decompositions on a short schedule in steps (``--cycles`` syncs, a sync every ``--cycle`` steps, a
last one when the run ends); every other option is the method's default. Measured on each worker, the slower worker's figure
reported (the run goes at its pace):

- step: forward + backward + optimizer step (the method's hooks and communication included),
  median over the steps of each phase; the first step of each phase, every step with an event
  and the step after it (new shapes: new gradients and optimizer state) are left out;
- events (AB-training): the sync and the decomposition, each timed around the method's own call
  (after a barrier, the device synchronised), median per event; the first decomposition
  (not truncated) apart from the later, truncated ones; and the time to form every low-rank W = A·B once
  (what the forward pass adds per step with --ab-linear-apply weight), on the last AB step;
- amortised: the time per step of a run of ``--run-steps`` steps on the method's default
  schedule (AB-training's schedule scales with the run: abtrain.methods.ab.Schedule, the first
  decomposition, the syncs and the truncations it holds), from the medians above; the extra
  time per step against DDP's step and against no communication's, and as % of DDP's step;
- training state: the most bytes any worker held after a step (abtrain.methods.memory: parameters,
  gradients, optimizer state, the method's own tensors), over the run and in the phase that fills
  most of it (AB-training's AB phase: its warm-up holds DDP's state and the PowerSGD memories),
  against DDP's measured state (the dense model's parameters, gradients and AdamW's two moments);
  peak CUDA memory (torch.cuda.max_memory_allocated, activations included) with --device cuda.

Prints a table; writes the JSON (``--out``, default benchmarks/results/cost.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 2

# -- the stand-ins ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention with GPT-2's and ViT's fused qkv projection (d -> 3d) and output projection."""

    def __init__(self, d: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block of GPT-2 and ViT: x + attn(ln(x)), x + mlp(ln(x)), MLP d -> 4d -> d."""

    def __init__(self, d: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2's decoder: token and position embeddings, blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, d: int, heads: int, layers: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads, causal=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


class ViT(nn.Module):
    """ViT's encoder: patch embedding (a strided convolution), class token, position embedding, blocks, head."""

    def __init__(self, d: int, heads: int, layers: int, patch: int, image: int, classes: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, d))
        self.blocks = nn.Sequential(*[Block(d, heads, causal=False) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 down to ``mid`` channels, 3x3 (with the stride), 1x1 up to 4·mid, shortcut."""

    def __init__(self, c_in: int, mid: int, stride: int) -> None:
        super().__init__()
        out = 4 * mid
        self.conv1, self.bn1 = nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50's layout: 7x7 stem and max-pool, four stages of bottlenecks (``blocks`` each), pool, fc."""

    def __init__(self, widths: tuple[int, ...], blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, c_in = [], widths[0]
        for i, (mid, count) in enumerate(zip(widths, blocks)):
            stage = []
            for j in range(count):
                stage.append(Bottleneck(c_in, mid, stride=2 if i > 0 and j == 0 else 1))
                c_in = 4 * mid
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


#: per model and --size: the model's dimensions and the batch of one worker; "layers"/"blocks" are the
#: default stand-in's, "full_*" those of the real model (--full)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "cpu": {"d": 768, "heads": 12, "context": 1024, "batch": 1},
        "gpu": {"d": 768, "heads": 12, "context": 1024, "batch": 8},
        "tiny": {"d": 32, "heads": 2, "context": 16, "batch": 2},
    },
    "vit": {
        "cpu": {"d": 768, "heads": 12, "image": 224, "patch": 16, "batch": 4},
        "gpu": {"d": 768, "heads": 12, "image": 224, "patch": 16, "batch": 64},
        "tiny": {"d": 32, "heads": 2, "image": 32, "patch": 8, "batch": 2},
    },
    "resnet50": {
        "cpu": {"widths": (64, 128, 256, 512), "image": 224, "batch": 4},
        "gpu": {"widths": (64, 128, 256, 512), "image": 224, "batch": 64},
        "tiny": {"widths": (4, 8, 8, 16), "image": 32, "batch": 2},
    },
}
GPT2_VOCAB, GPT2_LAYERS, VIT_LAYERS, VIT_CLASSES = 50257, 12, 12, 1000
RESNET50_BLOCKS = (3, 4, 6, 3)


def build(model: str, size: str, full: bool) -> tuple[nn.Module, Callable[[torch.Generator, torch.device], tuple], str]:
    """The stand-in, a function drawing one worker's batch (inputs, labels), and a one-line description."""
    s = SIZES[model][size]
    tiny = size == "tiny"
    if model == "gpt2":
        layers = GPT2_LAYERS if full else 1
        vocab = (128 if tiny else GPT2_VOCAB) // (1 if full else GPT2_LAYERS)
        net = GPT2(s["d"], s["heads"], layers, vocab, s["context"])

        def batch(gen: torch.Generator, device: torch.device) -> tuple:
            idx = torch.randint(vocab, (s["batch"], s["context"] + 1), generator=gen)
            return idx[:, :-1].to(device), idx[:, 1:].to(device)
        text = f"{layers} block(s) d={s['d']}, vocabulary {vocab}, {s['batch']}x{s['context']} tokens"
    elif model == "vit":
        layers = VIT_LAYERS if full else 1
        classes = 10 if tiny else VIT_CLASSES
        net = ViT(s["d"], s["heads"], layers, s["patch"], s["image"], classes)

        def batch(gen: torch.Generator, device: torch.device) -> tuple:
            return (torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen).to(device),
                    torch.randint(classes, (s["batch"],), generator=gen).to(device))
        tokens = (s["image"] // s["patch"]) ** 2 + 1
        text = f"{layers} block(s) d={s['d']}, {s['batch']} images x {tokens} tokens, {classes} classes"
    elif model == "resnet50":
        blocks = RESNET50_BLOCKS if full else (1, 1, 1, 1)
        classes = 10 if tiny else VIT_CLASSES
        net = ResNet50(s["widths"], blocks, classes)

        def batch(gen: torch.Generator, device: torch.device) -> tuple:
            return (torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen).to(device),
                    torch.randint(classes, (s["batch"],), generator=gen).to(device))
        text = f"bottlenecks {list(blocks)}, widths {list(s['widths'])}, {s['batch']} images {s['image']}x{s['image']}"
    else:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(SIZES)}")
    return net, batch, text


# -- the methods -------------------------------------------------------------------------------------------

#: name in --methods -> (registered method, its options); everything else is the method's default
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "ddp": ("ddp", {}),
    "powersgd": ("powersgd", {}),
    "ab": ("ab", {}),
    "ab-cap-state": ("ab", {"rank_cap": "state"}),
    "ab-cap-none": ("ab", {"rank_cap": "none"}),
    "ab-r0.25": ("ab", {"rank_fraction": 0.25}),
    "diloco": ("diloco", {}),
    "streaming-diloco": ("streaming-diloco", {}),
    "demo": ("demo", {}),
}
DEFAULT_METHODS = "none,ddp,powersgd,ab,ab-cap-state,ab-cap-none,ab-r0.25,diloco,streaming-diloco,demo"


def plan(variant: str, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """The options that fix where the measured run's phases and events fall, and its number of steps."""
    name, options = VARIANTS[variant]
    warm, steps = args.warm, args.steps
    if name == "powersgd":  # uncompressed steps, then compressed ones (the first of each phase is left out)
        start = warm + max(2, steps // 2)
        return {**options, "warmup_steps": start}, start + steps + 1
    if name == "ab":  # warm-up steps, then --cycles syncs, each followed by a decomposition (and one at the end)
        warmup = warm + max(2, steps // 2) + 1  # the last warm-up step ends with the first decomposition
        last_sync = (warmup // args.cycle + args.cycles) * args.cycle  # syncs fall at multiples of the cycle
        return {**options, "warmup_steps": warmup, "sync_every": args.cycle}, last_sync + 1
    return dict(options), warm + steps


def default_phases(variant: str, run_steps: int) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    """Steps of each phase and events of each kind in a run of ``run_steps`` on the method's default schedule."""
    name, options = VARIANTS[variant]
    if name == "ab":
        from abtrain.methods.ab import ABConfig, Schedule
        sched = Schedule.from_config(ABConfig(**options, quiet=True), run_steps)
        phases: dict[str, int] = {}
        for t in range(run_steps):
            p = sched.phase_at(t)
            phases[p] = phases.get(p, 0) + 1
        decompositions = sum(sched.decomposes_at(t) for t in range(1, run_steps + 1)) + (sched.warmup == 0)
        first = 1 if sched.warmup < run_steps else 0
        events = {"sync": sched.syncs(), "decompose_first": first, "decompose": decompositions - first}
        return phases, events, {"warmup_steps": sched.warmup, "sync_every": sched.sync_every,
                                "rebound_steps": sched.rebound, "describe": sched.describe()}
    if name == "powersgd":
        from abtrain.methods.powersgd import PowerSGDConfig
        start = min(run_steps, PowerSGDConfig(**options).warmup_steps)
        return {"warmup": start, "train": run_steps - start}, {}, {"warmup_steps": start}
    if name in ("diloco", "streaming-diloco"):  # the inner steps; an outer step's arithmetic (a few vector
        return {"inner": run_steps}, {}, {}      # operations per parameter every H steps) is left out
    return {"local" if name == "none" else "train": run_steps}, {}, {}


# -- one worker ------------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(method: Any, attr: str, label: Callable[..., str], device: torch.device,
                log: list[tuple[str, float]]) -> None:
    """Time every call of ``method.<attr>`` (after a barrier: a worker that arrives first does not count its
    wait), device synchronised; appends (label, seconds)."""
    original = getattr(method, attr)

    def timed(*a: Any, **k: Any) -> Any:
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        out = original(*a, **k)
        _synchronize(device)
        log.append((label(*a, **k), time.perf_counter() - start))
        return out

    setattr(method, attr, timed)


def measure(model_name: str, variant: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Train the stand-in with one method for the planned steps; this worker's times and state."""
    import abtrain
    from abtrain.methods.memory import moments_per_element

    device = torch.device(args.device)
    name, _ = VARIANTS[variant]
    options, total = plan(variant, args)
    torch.manual_seed(0)  # the same initial model everywhere (prepare() broadcasts rank 0's anyway)
    net, draw, _ = build(model_name, args.size, args.full)
    net = net.to(device)
    params = sum(p.numel() for p in net.parameters())
    tensors = len(list(net.parameters()))
    gen = torch.Generator().manual_seed(1000 + rank)
    x, y = draw(gen, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    method = abtrain.setup(name, total_steps=total, device=args.device, quiet=True, **options)
    module = method.prepare(net)
    # DeMo hands the optimizer sign(...) of its own momentum and takes plain SGD (as its authors run it)
    opt = (torch.optim.SGD(module.parameters(), lr=1e-4) if name == "demo"
           else torch.optim.AdamW(module.parameters(), lr=1e-4))
    events: list[tuple[str, float]] = []
    if name == "ab":
        _time_calls(method, "_sync", lambda *a, **k: "sync", device, events)
        # the first decomposition keeps full rank (truncate=False), the later ones cut
        _time_calls(method, "_decompose", lambda *a, **k: "decompose" if k["truncate"] else "decompose_first",
                    device, events)
    method.attach(opt)
    rows = []
    product_seconds = None
    for t in range(total):
        phase = method.phase
        if name == "ab" and t == total - 1:
            product_seconds = _product_time(method, device)
        before = len(events)
        _synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = module(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        _synchronize(device)
        seconds = time.perf_counter() - start
        rows.append({"step": t, "phase": phase, "seconds": seconds, "events": [e[0] for e in events[before:]]})
    method.detach()  # AB-training's last sync, when the run ends inside an AB phase
    result = {
        "rank": rank, "params": params, "param_tensors": tensors, "moments_per_element": moments_per_element(opt),
        "steps": rows, "events": events, "lowrank_product_seconds": product_seconds,
        "training_state_bytes": method.peak_state_bytes, "training_state_by_phase": method.peak_state,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "options": {k: v for k, v in options.items()},
    }
    if name == "ab":
        result["ranks"] = method.ranks[-1]["layers"] if method.ranks else {}
        result["compression_ratio"] = method.state.ratio
        result["role"] = method.role
    method.close()
    del method, module, opt, net, x, y
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


@torch.no_grad()
def _product_time(method: Any, device: torch.device) -> float | None:
    """Seconds to form W = A·B of every low-rank layer once (median of 3): the forward pass's extra product."""
    low = [fp for fp in method.records if fp.mode == "lowrank"]
    if not low:
        return None
    times = []
    for _ in range(3):
        _synchronize(device)
        start = time.perf_counter()
        for fp in low:
            fp.A @ fp.B
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORKERS),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORKERS))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    # NCCL needs a GPU per worker; on one GPU both workers share it through gloo (which takes CUDA tensors)
    backend = "nccl" if cuda and torch.cuda.device_count() >= WORKERS else "gloo"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=WORKERS)
    results, skipped = [], []
    start = time.perf_counter()
    try:
        for model_name in args.models:
            for variant in args.methods:
                # rank 0 alone decides whether time is left, so that both workers measure the same runs
                go = [args.budget is None or time.perf_counter() - start < args.budget]
                dist.broadcast_object_list(go, src=0)
                if not go[0]:
                    skipped.append(f"{model_name}/{variant}")
                    continue
                if rank == 0:
                    print(f"  {model_name} / {variant} ...", flush=True)
                results.append({"model": model_name, "variant": variant, **measure(model_name, variant, args, rank)})
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"backend": backend, "results": results, "skipped": skipped}, f)
        dist.destroy_process_group()


# -- summary ---------------------------------------------------------------------------------------------------


def phase_medians(steps: list[dict[str, Any]], warm: int) -> dict[str, float]:
    """Median step time per phase: without the first ``warm`` steps, the first step of each stretch of a
    phase, the steps in which an event ran and the step after each (new shapes: new gradients and optimizer
    state, the training state measured again)."""
    by_phase: dict[str, list[float]] = {}
    previous, after_event = None, False
    for row in steps:
        first_of_stretch = row["phase"] != previous or after_event
        previous, after_event = row["phase"], bool(row["events"])
        if row["step"] < warm or first_of_stretch or row["events"]:
            continue
        by_phase.setdefault(row["phase"], []).append(row["seconds"])
    return {p: statistics.median(v) for p, v in by_phase.items()}


def summarise(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One row: the slower worker's medians, event times and amortised cost; the larger worker's state."""
    first = per_rank[0]
    variant = first["variant"]
    medians = [phase_medians(r["steps"], args.warm) for r in per_rank]
    phases = sorted({p for m in medians for p in m})
    step_by_phase = {p: max(m[p] for m in medians if p in m) for p in phases}
    event_times: dict[str, list[float]] = {}
    for r in per_rank:
        for label, seconds in r["events"]:
            event_times.setdefault(label, []).append(seconds)
    # both workers time the same events after a barrier; the slower of the two counts
    event_medians = {}
    for label in event_times:
        per_worker = [[s for lab, s in r["events"] if lab == label] for r in per_rank]
        event_medians[label] = max(statistics.median(v) for v in per_worker if v)
    counts, event_counts, schedule = default_phases(variant, args.run_steps)
    missing = [p for p, n in counts.items() if n and p not in step_by_phase]
    missing += [e for e, n in event_counts.items() if n and e not in event_medians]
    amortised = events_per_step = None
    if not missing:
        events_per_step = sum(n * event_medians[e] for e, n in event_counts.items() if n) / args.run_steps
        amortised = sum(n * step_by_phase[p] for p, n in counts.items() if n) / args.run_steps + events_per_step
    main_phase = max(counts, key=counts.get)
    products = [r["lowrank_product_seconds"] for r in per_rank if r["lowrank_product_seconds"] is not None]
    from abtrain.methods.memory import dense_training_state_bytes
    moments = first["moments_per_element"]
    row = {
        "model": first["model"], "method": VARIANTS[variant][0], "variant": variant, "options": first["options"],
        "params": first["params"], "param_tensors": first["param_tensors"], "moments_per_element": moments,
        "step_seconds": step_by_phase.get(main_phase), "main_phase": main_phase,
        "step_seconds_by_phase": step_by_phase,
        "step_seconds_by_phase_by_rank": medians,
        "event_seconds": event_medians, "event_seconds_all": event_times,
        "lowrank_product_seconds": max(products) if products else None,
        "default_schedule": {"run_steps": args.run_steps, "phase_steps": counts, "events": event_counts, **schedule},
        "missing": missing,
        "amortised_step_seconds": amortised,
        "amortised_event_seconds": events_per_step,  # the syncs' and decompositions' share of it
        "training_state_bytes": max(r["training_state_bytes"] for r in per_rank),
        "training_state_bytes_by_rank": [r["training_state_bytes"] for r in per_rank],
        "training_state_by_phase_by_rank": [r["training_state_by_phase"] for r in per_rank],
        # the phase that fills most of the run (AB-training's AB phase; its warm-up holds the dense state)
        "training_state_main_phase_bytes": max(sum(r["training_state_by_phase"].get(main_phase, {}).values())
                                               for r in per_rank),
        "ddp_formula_bytes": dense_training_state_bytes(first["params"], moments),
        "peak_cuda_bytes": (max(r["peak_cuda_bytes"] for r in per_rank)
                            if first["peak_cuda_bytes"] is not None else None),
        "steps": [r["steps"] for r in per_rank],
    }
    for key in ("ranks", "compression_ratio"):
        if key in first:
            row[key] = first[key]
    if "role" in first:
        row["roles"] = [r["role"] for r in per_rank]
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Each row's extra time per step against DDP's and no communication's row of the same model, and its
    training state against DDP's measured one."""
    for row in rows:
        same = {r["variant"]: r for r in rows if r["model"] == row["model"]}
        for base in ("ddp", "none"):
            ref = same.get(base)
            ok = ref is not None and row["amortised_step_seconds"] is not None and ref["amortised_step_seconds"]
            extra = row["amortised_step_seconds"] - ref["amortised_step_seconds"] if ok else None
            row[f"extra_vs_{base}_seconds"] = extra
            row[f"extra_vs_{base}_percent"] = 100 * extra / ref["amortised_step_seconds"] if ok else None
        ddp = same.get("ddp")
        row["state_vs_ddp"] = row["training_state_bytes"] / ddp["training_state_bytes"] if ddp else None
        row["main_phase_state_vs_ddp"] = (row["training_state_main_phase_bytes"] / ddp["training_state_bytes"]
                                          if ddp else None)
        row["state_vs_ddp_formula"] = row["training_state_bytes"] / row["ddp_formula_bytes"]
        if ddp and row["peak_cuda_bytes"] is not None and ddp["peak_cuda_bytes"]:
            row["peak_cuda_vs_ddp"] = row["peak_cuda_bytes"] / ddp["peak_cuda_bytes"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f} %"


def table(rows: list[dict[str, Any]], cuda: bool) -> str:
    head = ["model", "method", "step ms", "warm-up ms", "sync ms", "decomp ms 1st/later", "W=AB ms",
            "amortised ms", "vs none", "vs DDP", "state MB", "state/DDP", "main phase/DDP"]
    if cuda:
        head += ["peak CUDA MB", "CUDA/DDP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        ev = r["event_seconds"]
        warm = r["step_seconds_by_phase"].get("warmup") if r["method"] in ("ab", "powersgd") else None
        decomp = "-" if not ev else f"{_ms(ev.get('decompose_first'))} / {_ms(ev.get('decompose'))}"
        cells = [r["model"], r["variant"], _ms(r["step_seconds"]), _ms(warm), _ms(ev.get("sync")), decomp,
                 _ms(r["lowrank_product_seconds"]), _ms(r["amortised_step_seconds"]),
                 _pct(r.get("extra_vs_none_percent")), _pct(r.get("extra_vs_ddp_percent")),
                 f"{r['training_state_bytes'] / 1e6:.1f}",
                 "-" if r["state_vs_ddp"] is None else f"{r['state_vs_ddp']:.2f}",
                 "-" if r["main_phase_state_vs_ddp"] is None else f"{r['main_phase_state_vs_ddp']:.2f}"]
        if cuda:
            cells += ["-" if r["peak_cuda_bytes"] is None else f"{r['peak_cuda_bytes'] / 1e6:.0f}",
                      "-" if r.get("peak_cuda_vs_ddp") is None else f"{r['peak_cuda_vs_ddp']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2,vit,resnet50", help="comma-separated, of: " + ", ".join(SIZES))
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--size", choices=("cpu", "gpu", "tiny"), default=None,
                    help="batch per worker (and dims for tiny); default cpu, gpu with --device cuda")
    ap.add_argument("--full", action="store_true", help="the real models' depth (12 blocks, ResNet-50's "
                    "[3, 4, 6, 3] bottlenecks) and GPT-2's real vocabulary, instead of one block per stage")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (2 workers on 2 cores: 1)")
    ap.add_argument("--warm", type=int, default=2, help="untimed steps at the start of each run")
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each phase (about)")
    ap.add_argument("--cycle", type=int, default=5, help="AB-training's measured runs: a sync every this many steps")
    ap.add_argument("--cycles", type=int, default=3, help="AB-training's measured runs: syncs (and truncations)")
    ap.add_argument("--run-steps", type=int, default=10_000,
                    help="the run over whose default schedule event times are amortised")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="start no further run (model and method) after this many seconds of measuring; "
                         "the runs left out are listed")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cost.json"))
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.models:
        if m not in SIZES:
            ap.error(f"unknown model {m!r}; choose from {', '.join(SIZES)}")
    for m in args.methods:
        if m not in VARIANTS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(VARIANTS)}")
    if args.size is None:
        args.size = "gpu" if args.device == "cuda" else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda was asked for but CUDA is not available here; run without it (CPU)")
    # a cycle of 4: the step with the sync, the step after it (new factors) and two that are timed
    if args.warm < 1 or args.steps < 2 or args.cycle < 4 or args.cycles < 1 or args.run_steps < 1:
        ap.error("need --warm >= 1, --steps >= 2, --cycle >= 4, --cycles >= 1, --run-steps >= 1")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.time()
    descriptions = {}
    for m in args.models:
        net, _, text = build(m, args.size, args.full)
        shapes = sorted({(int(p.shape[0]), math.prod(p.shape[1:])) for n, p in net.named_parameters()
                         if n.endswith("weight") and p.ndim >= 2}, reverse=True)
        descriptions[m] = {"description": text, "params": sum(p.numel() for p in net.parameters()),
                           "matrix_shapes": shapes}
        print(f"{m}: {text}, {descriptions[m]['params']:,} parameters")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else (platform.processor() or platform.machine())
    load_before = os.getloadavg()  # whatever else runs on the machine shares its cores with the workers
    print(f"{WORKERS} workers, {args.threads} thread(s) each, device {args.device} ({device_name}), "
          f"torch {torch.__version__}; amortised over {args.run_steps} steps")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(args, _free_port(), out_dir), nprocs=WORKERS, join=True,
                           start_method="spawn")
        per_rank = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORKERS)]
    rows = [summarise([per_rank[r]["results"][i] for r in range(WORKERS)], args)
            for i in range(len(per_rank[0]["results"]))]
    compare(rows)
    cuda = args.device == "cuda"
    print()
    print(table(rows, cuda))
    skipped = per_rank[0]["skipped"]
    if skipped:
        print(f"left out after --budget {args.budget:.0f} s: {', '.join(skipped)}")
    ab = [r for r in rows if r["variant"] == "ab"]
    for r in (r for r in rows if r["method"] == "ab"):
        events = r["default_schedule"]["events"]
        share = ("" if r["amortised_event_seconds"] is None else
                 f": {1000 * r['amortised_event_seconds']:.1f} ms per step from the events")
        print(f"{r['model']} {r['variant']}: {events['sync']} syncs, {events['decompose_first']} + "
              f"{events['decompose']} decompositions in {args.run_steps} steps{share}")
    for r in ab:
        print(f"{r['model']}: AB-training's default schedule over {args.run_steps} steps: "
              f"{r['default_schedule']['describe']}")
    record = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "cost.py"] + (argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.time() - started,
        "torch": torch.__version__, "device": args.device, "device_name": device_name,
        "cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "workers": WORKERS, "threads": args.threads, "backend": per_rank[0]["backend"],
        "size": args.size, "full": args.full, "warm": args.warm, "steps": args.steps, "cycle": args.cycle,
        "cycles": args.cycles, "run_steps": args.run_steps, "budget": args.budget, "skipped": skipped,
        "models": descriptions, "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"load average (1, 5, 15 min) before {', '.join(f'{v:.2f}' for v in load_before)}, after "
          f"{', '.join(f'{v:.2f}' for v in record['load_average_after'])} on {os.cpu_count()} cores")
    print(f"wrote {os.path.relpath(os.path.abspath(args.out), ROOT)} ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
