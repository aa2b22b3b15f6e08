"""PowerSGD: DDP whose gradient buckets are compressed to rank-r factors P and Q before the all-reduce.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), as torch ships it as a DDP
communication hook:
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
(``PowerSGDState`` and ``powerSGD_hook``).

torch's hook calls ``dist.all_reduce`` itself, which would bypass the ledger,
and ``dist.all_reduce`` only accepts a real ProcessGroup, so a counting
stand-in cannot be handed to it. :func:`_powersgd_hook` is therefore torch's
``powerSGD_hook`` (without the optional same-shape batching) with its three
all-reduces (uncompressed tensors, the Ps, the Qs) issued through the
communicator; everything else is torch's: the :class:`PowerSGDState` object
with its error feedback, warm start, seeded random Qs and compression
statistics, ``_should_compress`` (the policy) and ``_orthogonalize``. The
ledger therefore holds, per compressed step, exactly
``state.compression_stats()[2]`` elements (``total_numel_after_compression``):
the uncompressed tensors plus every P and Q. The first ``start_iter`` steps
are plain averaged all-reduces of the buckets (phase ``warmup``); compressed
steps are phase ``train``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState, _orthogonalize,
                                                                        _should_compress)

from ..comm import Communicator, Group
from ..topology import Topology
from ..validate import Options, opt
from .ddp import DDPMethod
from .registry import MethodSpec, register


@dataclass
class PowerSGDConfig(Options):
    """Options of PowerSGD; the CLI exposes each as ``--powersgd-<name>``."""

    section = "powersgd"
    rank: int = opt(4, "rank r of the P and Q factors of each compressed gradient matrix (matrix_approximation_rank)")
    start_iter: int = opt(10, "plain all-reduce for the first steps, PowerSGD from this step on (start_powerSGD_iter, > 1)")
    min_compression_rate: float = opt(2.0, "compress a matrix only when (rows + cols) * r * this < rows * cols")
    orthogonalization_epsilon: float = opt(0.0, "added to column norms in the orthogonalisation (e.g. 1e-8 against all-zero gradients)")
    seed: int = opt(0, "seed of the random initial Qs (the same on every worker)")

    def check(self) -> None:
        self.require("rank", self.rank >= 1, "a positive integer")
        # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start:
        # DDP rebuilds its buckets after the first step, which would invalidate the memorised errors and Qs.
        self.require("start_iter", self.start_iter >= 2,
                     "an integer >= 2 (DDP rebuilds its buckets after the first step)")
        self.require("min_compression_rate", self.min_compression_rate > 0, "> 0")
        self.require("orthogonalization_epsilon", self.orthogonalization_epsilon >= 0, ">= 0")


def _all_reduce_sum(comm: Communicator, tensor: torch.Tensor, group: Group) -> torch.futures.Future:
    """A counted sum all-reduce; an empty tensor (a bucket with nothing to send) is not a collective."""
    if tensor.numel() == 0:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    return comm.all_reduce_async(tensor, group, average=False)


# torch's powerSGD_hook, communication through the ledger. No annotations: DDP checks the ``bucket`` one.
def _powersgd_hook(method, bucket):  # type: ignore[no-untyped-def]
    state: PowerSGDState = method.state
    comm: Communicator = method.comm
    group: Group = method.topo.world
    world_size = group.size
    input_tensor = bucket.buffer()

    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return comm.all_reduce_async(input_tensor, group, average=True)

    device, dtype = input_tensor.device, input_tensor.dtype
    bucket_index = bucket.index()
    input_tensor_cp = None
    if state.use_error_feedback:
        if bucket_index in state.error_dict:
            input_tensor.add_(state.error_dict[bucket_index])
        else:
            state.error_dict[bucket_index] = torch.zeros(input_tensor.shape[0], device=device, dtype=dtype)
        # The local error is what decompression loses of this copy.
        input_tensor_cp = input_tensor.detach().clone()

    # Step I: split the bucket's per-parameter gradients into those worth compressing and the rest.
    tensors = bucket.gradients()
    tensors_to_compress, uncompressed_tensors = [], []
    total_ps_size = total_qs_size = 0
    for tensor in tensors:
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        worth, numel_before, numel_after = _should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += numel_before
        if worth:
            tensors_to_compress.append(matrix.unsqueeze(0))
            total_ps_size += n * rank
            total_qs_size += m * rank
            state.total_numel_after_compression += numel_after
        else:
            uncompressed_tensors.append(tensor)
            state.total_numel_after_compression += numel_before

    # Step II: the uncompressed tensors, in one contiguous buffer.
    uncompressed_memory = (torch.cat([t.view(-1) for t in uncompressed_tensors]) if uncompressed_tensors
                           else torch.tensor([], device=device, dtype=dtype))

    # Step III: P and Q memory, reused across steps under warm start.
    need_randomize_qs = not state.warm_start or bucket_index not in state.p_memory_dict
    if need_randomize_qs:
        state.p_memory_dict[bucket_index] = torch.empty(total_ps_size, device=device, dtype=dtype)
        state.q_memory_dict[bucket_index] = torch.empty(total_qs_size, device=device, dtype=dtype)
    # torch's order: grouped by shape (this decides which random numbers each Q gets).
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for tensor in tensors_to_compress:
        by_shape.setdefault(tensor.shape, []).append(tensor)
    tensors_to_compress = [t for same_shape in by_shape.values() for t in same_shape]
    ps, qs = [], []
    p_idx = q_idx = 0
    for tensor in tensors_to_compress:
        _, n, m = tensor.shape
        rank = min(n, m, state.matrix_approximation_rank)
        ps.append(state.p_memory_dict[bucket_index][p_idx:p_idx + n * rank].view(1, n, rank))
        qs.append(state.q_memory_dict[bucket_index][q_idx:q_idx + m * rank].view(1, m, rank))
        p_idx += n * rank
        q_idx += m * rank

    if not need_randomize_qs:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        # The same seed on every worker gives the same random Qs; a new seed every step gives new projections.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                _orthogonalize(q, state.orthogonalization_epsilon)

    for tensor, q, p in zip(tensors_to_compress, qs, ps):
        torch.bmm(tensor, q, out=p)

    def unpack_uncompressed_and_allreduce_ps(fut: torch.futures.Future) -> torch.Tensor:
        memory = fut.value().div_(world_size)
        idx = 0
        for tensor in uncompressed_tensors:
            tensor.copy_(memory[idx:idx + tensor.numel()].view_as(tensor))
            idx += tensor.numel()
        # Not divided by the world size: the Ps are orthogonalised next.
        return _all_reduce_sum(comm, state.p_memory_dict[bucket_index], group).wait()

    def compute_qs(fut: torch.futures.Future) -> torch.Tensor:
        state.p_memory_dict[bucket_index] = fut.value()
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for tensor, p, q in zip(tensors_to_compress, ps, qs):
            torch.bmm(tensor.transpose(1, 2), p, out=q)
        return _all_reduce_sum(comm, state.q_memory_dict[bucket_index], group).wait()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        state.q_memory_dict[bucket_index] = fut.value().div_(world_size)
        for p, q, tensor in zip(ps, qs, tensors_to_compress):
            torch.bmm(p, q.transpose(1, 2), out=tensor)
        if input_tensor.is_cuda:
            torch.cuda.synchronize(device)
        if state.use_error_feedback:
            assert input_tensor_cp is not None
            state.error_dict[bucket_index] = input_tensor_cp - input_tensor
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return input_tensor

    return (_all_reduce_sum(comm, uncompressed_memory, group)
            .then(unpack_uncompressed_and_allreduce_ps)
            .then(compute_qs)
            .then(decompress))


class PowerSGD(DDPMethod):
    """torch DDP with torch's PowerSGD hook, every all-reduce counted (phases ``warmup`` then ``train``).

    ``use_error_feedback`` and ``warm_start`` (both on, as torch recommends)
    are keyword arguments of the Python API only.
    """

    name = "powersgd"

    def __init__(self, comm: Communicator, topo: Topology, config: PowerSGDConfig | None = None,
                 bucket_cap_mb: float = 25.0, use_error_feedback: bool = True, warm_start: bool = True,
                 **options: Any) -> None:
        super().__init__(comm, topo, bucket_cap_mb=bucket_cap_mb)
        self.cfg = config if config is not None else PowerSGDConfig(**options)
        self.state = PowerSGDState(
            process_group=topo.world.pg,
            matrix_approximation_rank=self.cfg.rank,
            start_powerSGD_iter=self.cfg.start_iter,
            min_compression_rate=self.cfg.min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=self.cfg.orthogonalization_epsilon,
            random_seed=self.cfg.seed,
        )
        self._step_iter: int | None = None  # state.iter when the current step began (None: read it)

    @property
    def phase(self) -> str:
        # Fixed when the step begins: the hook advances state.iter at the last bucket, before its all-reduce.
        iteration = self.state.iter if self._step_iter is None else self._step_iter
        return "warmup" if iteration < self.state.start_powerSGD_iter else "train"

    comm_hook = staticmethod(_powersgd_hook)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._step_iter = self.state.iter  # the hook has counted this step: the next step's label

    def extra_results(self) -> dict[str, Any]:
        rate, before, after = self.state.compression_stats()
        return {"bucket_cap_mb": self.bucket_cap_mb,
                "powersgd": {**asdict(self.cfg), "use_error_feedback": self.state.use_error_feedback,
                             "warm_start": self.state.warm_start, "compression_rate": rate,
                             "numel_before_compression": before, "numel_after_compression": after}}

    _STATE = ("iter", "error_dict", "p_memory_dict", "q_memory_dict", "total_numel_before_compression",
              "total_numel_after_compression", "next_stats_report")

    def state_dict(self) -> dict[str, Any]:
        out = {name: getattr(self.state, name) for name in self._STATE}
        # numpy's RandomState as plain values and a tensor, loadable with torch.load(weights_only=True).
        kind, keys, pos, has_gauss, cached = self.state.rng.get_state()
        out["rng"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._STATE:
            setattr(self.state, name, state[name])
        self._step_iter = None
        rng = state["rng"]
        self.state.rng.set_state((rng["kind"], rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"],
                                  rng["cached_gaussian"]))


register(MethodSpec("powersgd", PowerSGD, "PowerSGD", "torch's PowerSGD DDP hook: rank-r gradient compression with "
                    "error feedback and warm start", options=PowerSGDConfig, bucket_cap=True, order=40, bench=2,
                    short_run_args=("--powersgd-start-iter", "2")))
