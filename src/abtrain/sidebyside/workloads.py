"""Named benchmark workloads: plain functions returning the ``abtrain train`` flags every method shares.

A workload fixes what a fair comparison must hold equal across methods: model,
data, seed, number of workers, ``--group-size`` (so that the scopes ``group``
and ``global`` mean the same thing for every method) and the step budget. Each
method may add its own flags (the tiny workload takes each method's ``short_run_args``).

A workload's learning-rate schedule, warm-up included, is given as shares of the run (``--warmup-lr-fraction``,
the cosine over all steps), so that a run given more steps (``abtrain bench --steps-factor``) follows the same
curve over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..data import steps_per_epoch
from ..methods import registry

#: What ``abtrain bench`` runs without ``--methods``: the methods that ask for it in their registration.
DEFAULT_METHODS = tuple(registry.bench_defaults())

FASHION_TRAIN = 60_000  # Fashion-MNIST's training split
SHAKESPEARE_STEPS = 2000


@dataclass
class Workload:
    """A named set of ``abtrain train`` flags shared by every method, plus per-method flags."""

    name: str
    description: str
    train_args: list[str]
    steps: int  # the step budget, to scale schedules and to report
    metric: str = "accuracy"  # "accuracy" (higher is better) or "perplexity" (lower is better)
    method_args: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metric not in ("accuracy", "perplexity"):
            raise ValueError(f"workload metric must be accuracy or perplexity, got {self.metric!r}")
        if self.steps < 1:
            raise ValueError(f"workload {self.name}: the step budget must be positive, got {self.steps}")

    def args_for(self, method: str, steps_factor: float = 1.0) -> list[str]:
        """The full ``abtrain train`` flags of ``method`` on this workload (without --out), with ``steps_factor``
        times the step budget (``--steps``, which overrides ``--epochs``; the schedule is shares of the run)."""
        own = registry.get(method).bench_args if method in registry.names() else ()
        longer = ["--steps", str(self.stretched_steps(steps_factor))] if steps_factor != 1 else []
        return [*self.train_args, "--method", method, *own, *self.method_args.get(method, []), *longer]

    def stretched_steps(self, steps_factor: float) -> int:
        """The step budget times ``steps_factor``, rounded to a whole step (at least one)."""
        return max(1, round(steps_factor * self.steps))


#: The authors' recipe (AdamW, weight decay 0.1, label smoothing 0.1, gradient clipping 1.0), for every method.
REFERENCE_RECIPE = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1", "--label-smoothing", "0.1",
                    "--grad-clip", "1.0"]


def _fashion(name: str, model: str, quick: bool, lr: float, recipe: list[str] | None = None) -> Workload:
    workers, group, batch = 4, 2, 64
    train = 6144 if quick else FASHION_TRAIN
    steps = 3 * steps_per_epoch(train, workers, batch)
    args = ["--model", model, "--dataset", "fashion-mnist", "--workers", str(workers), "--group-size", str(group),
            "--epochs", "3", "--batch-size", str(batch), "--seed", "0",
            "--eval-every", str(steps // 6),  # twice per epoch: time-to-accuracy needs a few points
            *(recipe or ["--optimizer", "sgd", "--lr", str(lr)])]
    if quick:
        args += ["--limit-train", str(train), "--limit-test", "2000"]
    how = "AdamW lr 3e-3, weight decay 0.1, label smoothing 0.1, gradient clipping 1.0" if recipe else f"SGD lr {lr}"
    return Workload(name, f"{model} on Fashion-MNIST, {workers} workers in groups of {group}, 3 epochs"
                          f"{' of the first 6144 samples (quick)' if quick else ''}, {how}",
                    args, steps)


def fashion_cnn(quick: bool = False) -> Workload:
    """The default job's CNN on Fashion-MNIST."""
    return _fashion("fashion-cnn", "cnn", quick, lr=0.05)


def fashion_wide(quick: bool = False) -> Workload:
    """Where low rank pays: two wide fully connected layers hold 99.4 % of the parameters (VGG16's shape),
    trained with the authors' recipe by every method."""
    return _fashion("fashion-wide", "wide", quick, lr=0.05, recipe=REFERENCE_RECIPE)


def fashion_resnet(quick: bool = False) -> Workload:
    """A small ResNet on Fashion-MNIST."""
    return _fashion("fashion-resnet", "resnet", quick, lr=0.05)


def shakespeare_gpt(quick: bool = False) -> Workload:
    """The character-level GPT on Shakespeare with AdamW and a fixed step budget."""
    workers, group = 4, 2
    steps = 60 if quick else SHAKESPEARE_STEPS
    batch = 32 if quick else 64
    args = ["--model", "gpt", "--dataset", "shakespeare", "--workers", str(workers), "--group-size", str(group),
            "--steps", str(steps), "--batch-size", str(batch), "--optimizer", "adamw", "--lr", "3e-3",
            "--weight-decay", "0.1", "--warmup-lr-fraction", "0.05",
            "--eval-every", str(steps // (5 if quick else 10)), "--seed", "0"]
    if quick:
        args += ["--limit-test", "512"]
    return Workload("shakespeare-gpt", f"character GPT on Shakespeare, {workers} workers in groups of {group}, "
                                       f"{steps} AdamW steps of batch {batch}{' (quick)' if quick else ''}, lr 3e-3",
                    args, steps, metric="perplexity")


def tiny(quick: bool = False) -> Workload:
    """An MLP on generated data, 2 workers that are each their own group: a smoke test in seconds."""
    steps = 8
    args = ["--model", "mlp", "--dataset", "synthetic", "--workers", "2", "--group-size", "1", "--steps", str(steps),
            "--batch-size", "16", "--limit-test", "128", "--eval-every", "4", "--log-every", "4", "--seed", "0"]
    return Workload("tiny", "MLP on synthetic data, 2 workers (groups of 1), 8 steps: a smoke test", args, steps,
                    method_args={s.name: list(s.short_run_args) for s in registry.specs() if s.short_run_args})


WORKLOADS: dict[str, Callable[[bool], Workload]] = {
    "fashion-cnn": fashion_cnn,
    "fashion-wide": fashion_wide,
    "fashion-resnet": fashion_resnet,
    "shakespeare-gpt": shakespeare_gpt,
    "tiny": tiny,
}


def get_workload(name: str, quick: bool = False) -> Workload:
    """The workload registered under ``name`` (its ``--quick`` variant when ``quick``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](quick)
