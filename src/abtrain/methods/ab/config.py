"""AB-training's options (:class:`ABConfig`, the ``--ab-*`` flags) and the group layout it needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ...comm.topology import check_group_size, node_group_size
from ...compress.codec import CODECS
from ...compress.wire import WIRE_DTYPES
from ...validate import Options, opt
from . import lowrank
from .dense import DENSE_REDUCERS

SYNC_MODES = ("with-stale", "only-learned", "full", "only-b")
ONLY_B_GROUPS = ("group", "world")
SPLITS = ("sqrt", "sigma", "tangent")
SYNC_PAYLOADS = ("factors", "smaller", "lowrank")
TANGENT_CORES = {"sum": 1.0, "mean": 0.5}  # --ab-tangent-core: the weight of the shared part U·X·Vᵀ in the merge
STATE_POLICIES = ("keep", "map", "reset")
SVD_MODES = ("full", "update")
INITS = ("default", "ortho-sigma")
INIT_SCOPES = ("factorised", "all")
ONLY_B_SYNCS = ("average", "rank0")
RANK_CAPS = ("pays", "state", "none")
DEFAULT_TAU = 0.05  # the rank rule when none is given; why this value: docs/ab-training.md, "Defaults"

#: The method as its authors' code runs it, where abtrain's defaults differ (those were measured to send fewer
#: bytes between nodes: docs/notebook/): fp32 full-rank phases and sync, with-stale, the sqrt split,
#: tau 0.15 at every truncation whatever the factors' size, no rank floor, no averaged optimizer moments,
#: ortho-sigma initialisation of the factorised weights. ``ABConfig(**PAPER)``, ``abtrain.setup("ab", **PAPER)``,
#: or ``abtrain train --config examples/ab-paper.toml`` (the training recipe stays the user's; examples/
#: ab-resnet50.toml, ab-vgg16.toml and ab-vit.toml add the authors' recipe of each published setting, and their
#: code's tall turn of wide matrices and ortho-sigma on every matrix: orientation="tall", init_scope="all").
PAPER: dict[str, Any] = {
    "warmup_fraction": 0.25, "sync_fraction": 0.06, "rebound_fraction": 0.1, "lr_rebound_fraction": 0.3,
    "tau": 0.15, "sync": "with-stale", "split": "sqrt", "dense_comm": "fp32", "powersgd_rank": 4,
    "powersgd_codec": "fp32", "sync_codec": "fp32", "optimizer_state": "keep", "rank_cap": "none",
    "sync_moments": False, "min_rank": 1, "init": "ortho-sigma", "min_sync_every": 1,
}


@dataclass
class ABConfig(Options):
    """Options of AB-training; the CLI exposes each as ``--ab-<name>``.

    The schedule's period, ``sync_every`` (a sync at every multiple of it after the warm-up), is the
    option of that name when given, else ``max(2, round(sync_fraction * total_steps))`` for a run of
    ``total_steps``; the rebound and the learning-rate ramp are shares of it. :class:`~.schedule.Schedule`
    holds the steps.
    """

    section = "ab"
    #: options of which one at most may be given; a config file's is replaced by a flag's (``config.merge``)
    exclusive = (("tau", "rank", "rank_fraction"),)

    warmup_fraction: float = opt(0.01, "share of the run's steps trained full rank before the first decomposition (T_w); --ab-warmup-steps overrides it")
    sync_fraction: float = opt(0.015, "share of the run's steps between two syncs (the period); --ab-sync-every overrides it")
    rebound_fraction: float = opt(0.0, "full-rank DP steps after each sync (F) as a share of the period, 0 for none; --ab-rebound-steps overrides it")
    lr_rebound_fraction: float = opt(0.0, "learning-rate ramp after each phase switch (R) as a share of the period, 0 for none; --ab-lr-rebound-steps overrides it")
    warmup_steps: int | None = opt(None, "full-rank DP steps before the first decomposition (T_w), instead of the fraction; 0 decomposes before the first step")
    sync_every: int | None = opt(None, "steps between two syncs (the period), instead of the fraction: a sync at every multiple of it after the warm-up")
    min_sync_every: int = opt(16, "fewest steps between two syncs when the period comes from --ab-sync-fraction: a short run syncs no more often (each sync costs a decomposition of every factorised layer); 1 for no floor")
    sync_fragments: int = opt(1, "streaming syncs: the layers cut into this many fragments (contiguous groups of about equal size, dealt out in turn), fragment f synced and decomposed again at the steps t with t mod K = f*K//F, so that a sync's bytes and decompositions are spread over the period K (needs the tangent merge and no rebound); 1 syncs the whole model at once")
    rebound_steps: int | None = opt(None, "full-rank DP steps after each sync (F, less than the period), instead of the fraction; 0 re-decomposes right after the sync")
    lr_rebound_steps: int | None = opt(None, "steps over which the learning rate ramps back from the floor at each phase switch (R), instead of the fraction; 0 disables")
    tau: float | None = opt(None, f"rank rule: keep the singular values above tau * sigma_1 (default {DEFAULT_TAU} when no other rank rule is given)")
    rank: int | None = opt(None, "fixed rank for every factorised layer")
    rank_fraction: float | None = opt(None, "rank as a fraction of each layer's full rank, in (0, 1]")
    min_rank: int = opt(8, "rank floor: no layer is cut below it, and a matrix whose factors at this rank would not be smaller than W stays full rank")
    rank_cap: str = opt("pays", "bound on the rank of every decomposition: pays (factors smaller than W), state (training state within DDP's) or none (the rank rule alone)", choices=RANK_CAPS)
    sync: str = opt("only-learned", "how a sync averages the groups into one model", choices=SYNC_MODES)
    only_b_groups: str = opt("group", "only-b: train B with DP inside each group and average it at sync (group), or over one group of all workers every step (world)", choices=ONLY_B_GROUPS)
    only_b_sync: str = opt("average", "only-b: what a sync does with all but B (the parameters trained full rank, the buffers): average them over all workers, or take rank 0's copy (rank0: a broadcast, as the authors' code leaves them)", choices=ONLY_B_SYNCS)
    lr_floor: float = opt(1e-5, "learning rate right after a phase switch")
    split: str | None = opt(None, "how W's singular values go into A and B: sqrt, sigma, or tangent (in the factor each group trains); default: tangent with only-learned, else sqrt", choices=SPLITS)
    sync_payload: str | None = opt(None, "what an only-learned sync sends per low-rank layer: factors, smaller (of factors and W's change) or lowrank; default: lowrank with tangent, else factors", choices=SYNC_PAYLOADS)
    tangent_core: str | None = opt(None, "how the tangent merge counts the part of the groups' changes both can make: sum or mean; default: mean with tangent and only-learned, else sum", choices=tuple(TANGENT_CORES))
    sync_rank: int = opt(64, "rank q of the change each layer sends with --ab-sync-payload lowrank")
    svd: str | None = opt(None, "W's SVD after a sync: full, or update (from the parts a lowrank sync leaves); default: update with --ab-sync-payload lowrank, else full", choices=SVD_MODES)
    outer_lr: float = opt(1.0, "learning rate of an outer SGD on each sync's averaged change since the phase began (DiLoCo's outer step); 1 with --ab-outer-momentum 0 is the plain average")
    outer_momentum: float = opt(0.0, "Nesterov momentum of that outer SGD (0: none); it holds a model's worth of numbers on every worker")
    sync_moments: bool = opt(True, "at each sync, also average the optimizer moments of the parameters trained full rank during the AB phase")
    optimizer_state: str = opt("map", "the trained factors' optimizer state at each decomposition: keep (resized to the new rank), map (into the new basis) or reset", choices=STATE_POLICIES)
    init: str = opt("default", "ortho-sigma: every factorisable weight keeps its initial singular vectors with all singular values 1", choices=INITS)
    init_scope: str = opt("factorised", "the weights --ab-init ortho-sigma sets: factorised (those AB-training factorises) or all (every parameter of 2 or more dims, as the authors' code: kept layers and embeddings too; one of a single row or column is scaled to unit norm)", choices=INIT_SCOPES)
    orientation: str = opt("as-is", "which matrix a wide weight (C_out < C_in k k: most convolutions) is factorised as: as-is (C_out x C_in k k) or tall (its transpose, as the authors' code: B, r x min(m, n), is then the short factor)", choices=lowrank.ORIENTATIONS)
    full_rank: str = opt(",".join(lowrank.DEFAULT_FULL_RANK_PATTERNS), "comma-separated parameter-name patterns kept full rank (fnmatch)")
    dense_comm: str = opt("powersgd", "how the warm-up and rebounds average full-rank gradients over all workers: fp32, bf16, powersgd (--ab-powersgd-rank), or local (not at all: each worker steps alone and the model is averaged once, before the decomposition that ends the phase)", choices=DENSE_REDUCERS)
    powersgd_rank: int = opt(31, "rank of PowerSGD's P and Q for --ab-dense-comm powersgd")
    powersgd_codec: str = opt("bf16", "format of PowerSGD's P, Q and uncompressed tensors on the wire for --ab-dense-comm powersgd: fp32, bf16, int8 or e3m0 (4 bits; one float32 scale per --ab-scale-block elements), the rounding kept by PowerSGD's error memories", choices=CODECS)
    sync_memory_dtype: str = opt("fp32", "dtype of the low-rank sync's error memories (an m x n tensor per low-rank layer on every worker): bf16 holds them in half the bytes", choices=tuple(WIRE_DTYPES))
    sync_codec: str = opt("bf16", "format of the sync's payload on the wire: fp32, bf16, int8 or e3m0 (4 bits; one float32 scale per --ab-scale-block elements); int8 and e3m0 carry each layer's change of W, what they lose kept by the sync's error memories; every worker still ends the sync with the same model", choices=CODECS)
    scale_block: int = opt(256, "elements that share one scale in the int8 and e3m0 formats (--ab-sync-codec, --ab-powersgd-codec); even")
    linear_apply: str = opt("auto", "how a low-rank nn.Linear applies its factors: weight (forms W = A B), factors (input times B^T, then A^T), or auto (fewer multiply-adds per call)", choices=lowrank.APPLY_MODES)
    sync_batchnorm: bool = opt(False, "BatchNorm layers normalise with the statistics of every worker's batch at each training step, as SyncBatchNorm (one all-gather in the forward, one all-reduce in the backward per layer, counted in the ledger)")
    keep_output: bool = opt(True, "keep the layer that produces the model's output full rank (found from the autograd graph of the first training step, whatever its name)")
    quiet: bool = opt(False, "do not print the schedule and the per-layer decisions (rank 0 prints them by default)")

    def derived(self) -> dict[str, Any]:
        """The defaults that follow the other options, for those left None: the rank rule (tau
        :data:`DEFAULT_TAU` when no rule is given), the split (tangent with only-learned, else sqrt), and what
        needs the tangent merge of only-learned: the low-rank payload, the averaged core, the updated SVD."""
        out: dict[str, Any] = {}
        if all(getattr(self, name) is None for name in self.exclusive[0]):
            out["tau"] = DEFAULT_TAU
        out["split"] = self.split or ("tangent" if self.sync == "only-learned" else "sqrt")
        tangent_merge = self.sync == "only-learned" and out["split"] == "tangent"
        out["sync_payload"] = self.sync_payload or ("lowrank" if tangent_merge else "factors")
        out["tangent_core"] = self.tangent_core or ("mean" if tangent_merge else "sum")
        out["svd"] = self.svd or ("update" if out["sync_payload"] == "lowrank" else "full")
        return {name: value for name, value in out.items() if getattr(self, name) is None}

    def check(self) -> None:
        for name in ("warmup_steps", "rebound_steps", "lr_rebound_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--ab-{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.sync_every is not None and self.sync_every < 1:
            raise ValueError(f"--ab-sync-every must be a positive integer, got {self.sync_every!r}")
        if self.min_sync_every < 1:
            raise ValueError(f"--ab-min-sync-every must be a positive integer, got {self.min_sync_every!r}")
        for name in ("warmup_fraction", "sync_fraction", "rebound_fraction", "lr_rebound_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0 or (name == "sync_fraction" and value == 0.0):
                raise ValueError(f"--ab-{name.replace('_', '-')} must be in {'(0' if name == 'sync_fraction' else '[0'}, 1), "
                                 f"got {value!r}")
        if self.sync_fragments < 1:
            raise ValueError(f"--ab-sync-fragments must be a positive integer, got {self.sync_fragments!r}")
        if self.sync_fragments > 1 and not (self.sync == "only-learned" and self.split in (None, "tangent")):
            raise ValueError("--ab-sync-fragments needs the tangent merge, whose kept SVD is the model the workers "
                             "agree on between the fragments' syncs: use it with --ab-sync only-learned (and the "
                             "tangent split, its default)")
        if self.sync_fragments > 1 and self.outer_step:
            raise ValueError("--ab-sync-fragments syncs the fragments at different steps; --ab-outer-lr and "
                             "--ab-outer-momentum step the whole model at once: use one or the other")
        if self.min_rank < 1:
            raise ValueError(f"--ab-min-rank must be >= 1, got {self.min_rank}")
        if self.powersgd_rank < 1:
            raise ValueError(f"--ab-powersgd-rank must be >= 1, got {self.powersgd_rank}")
        rules = [n for n in self.exclusive[0] if getattr(self, n) is not None]
        if len(rules) > 1:
            raise ValueError(f"choose one rank rule, got {', '.join('--ab-' + r.replace('_', '-') for r in rules)}")
        _ = self.rule  # RankRule checks the values: a bad one fails here, before any training
        if self.split == "tangent" and self.sync == "with-stale":
            raise ValueError("--ab-split tangent splits W differently in A- and B-groups, and with-stale averages each "
                             "group's untrained factor with the others' trained one: use --ab-sync only-learned "
                             "(or --ab-split sigma)")
        if self.sync_rank < 1:
            raise ValueError(f"--ab-sync-rank must be >= 1, got {self.sync_rank}")
        if self.sync_payload == "lowrank" and (self.split != "tangent" or self.sync != "only-learned"):
            raise ValueError("--ab-sync-payload lowrank sends each group's change of W, which only the tangent "
                             "merge adds to the model: use it with --ab-split tangent --ab-sync only-learned")
        if self.tangent_core != "sum" and (self.split != "tangent" or self.sync != "only-learned"):
            raise ValueError(f"--ab-tangent-core {self.tangent_core} changes how the tangent merge adds the groups' "
                             "changes: use it with --ab-split tangent --ab-sync only-learned")
        if self.svd == "update" and self.sync_payload != "lowrank":
            raise ValueError("--ab-svd update takes W's SVD from the rank-q change that --ab-sync-payload lowrank "
                             f"sends: use it with --ab-sync-payload lowrank (got {self.sync_payload})")
        if not self.outer_lr > 0:
            raise ValueError(f"--ab-outer-lr must be > 0, got {self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--ab-outer-momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.outer_step and not (self.sync == "only-learned" and self.split == "tangent"):
            raise ValueError("--ab-outer-lr and --ab-outer-momentum step from the SVD the tangent merge started from: "
                             "use them with --ab-sync only-learned --ab-split tangent")
        if self.scale_block < 2 or self.scale_block % 2:
            raise ValueError(f"--ab-scale-block must be an even integer >= 2, got {self.scale_block!r}")
        if self.quantised_sync and not (self.sync == "only-learned" and self.split == "tangent"
                                        and self.sync_payload != "factors"):
            raise ValueError(f"--ab-sync-codec {self.sync_codec} quantises each layer's change of W, which only the "
                             "tangent merge sends: use it with --ab-sync only-learned --ab-split tangent and "
                             "--ab-sync-payload lowrank or smaller (or --ab-sync-codec bf16)")
        if self.only_b_sync != "average" and self.sync != "only-b":
            raise ValueError(f"--ab-only-b-sync {self.only_b_sync} changes what an only-b sync does: use it with "
                             f"--ab-sync only-b (got {self.sync})")
        if not self.lr_floor >= 0:
            raise ValueError(f"--ab-lr-floor must be >= 0, got {self.lr_floor}")

    @property
    def outer_step(self) -> bool:
        """A sync applies an outer step rather than the plain average."""
        return self.outer_lr != 1.0 or self.outer_momentum != 0.0

    @property
    def quantised_sync(self) -> bool:
        """The sync's payload travels in a quantised format (int8, e3m0), not as floats."""
        return self.sync_codec in ("int8", "e3m0")

    @property
    def needs_budget(self) -> bool:
        """True when the schedule is given as fractions of the run, which must then be told its length."""
        return self.warmup_steps is None or self.sync_every is None

    @functools.cached_property
    def rule(self) -> lowrank.RankRule:
        """The rank rule these options give, built once (when the options are checked)."""
        try:
            return lowrank.RankRule(tau=self.tau, rank=self.rank, fraction=self.rank_fraction)
        except ValueError as exc:
            raise ValueError(f"AB-training rank rule: {exc}") from None

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.full_rank.split(",") if p.strip())


def check_topology(cfg: ABConfig, world_size: int, group_size: int, cli: bool = True) -> None:
    """The group layout AB-training needs; raises before any training starts.

    ``cli`` words the fix as flags (``--group-size 2``), else as keyword arguments (``group_size=2``).
    """
    def fix(name: str, value: Any) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value!r}"

    check_group_size(world_size, group_size, "--group-size" if cli else "group_size=")
    if cfg.sync != "only-b" and world_size == 1:
        start = "--workers 2 (or more)" if cli else "torchrun --nproc-per-node 2 (or more)"
        raise ValueError(f"AB-training trains A and B in different groups of workers, so it needs at least 2; "
                         f"this is a world of one process: start it with {start}, or use "
                         f"{fix('ab_sync' if cli else 'sync', 'only-b')}")
    if cfg.sync != "only-b" and world_size // group_size < 2:
        raise ValueError(f"AB-training needs at least 2 groups of workers, got {world_size // group_size} "
                         f"({world_size} workers in groups of {group_size}): pass e.g. "
                         f"{fix('group_size', max(1, world_size // 2))}, or {fix('ab_sync' if cli else 'sync', 'only-b')}")


def default_group_size(world_size: int, local_world_size: int, cfg: ABConfig) -> int:
    """The group size AB-training uses when none was chosen: one group per node, or 2 groups on one node.

    On one node (all workers in one group) the world is split into the smallest
    number of groups above one that divides it: 2 groups for an even world.
    """
    g = node_group_size(world_size, local_world_size)
    if cfg.sync == "only-b" or world_size < 2 or world_size // g >= 2:
        return g
    groups = next(k for k in range(2, world_size + 1) if world_size % k == 0)
    return world_size // groups


# -- what the registry asks of AB-training ------------------------------------
def group_layout(cfg: ABConfig, world_size: int, local_world_size: int) -> tuple[int, str | None]:
    """The group size when none was chosen, and the line that says so (None: nothing to say)."""
    g = default_group_size(world_size, local_world_size, cfg)
    if g == node_group_size(world_size, local_world_size) or cfg.quiet:
        return g, None
    return g, f"AB-training: one node of {world_size} workers: {world_size // g} groups of {g}"
