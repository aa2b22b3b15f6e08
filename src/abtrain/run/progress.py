"""What rank 0 prints while training: a progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any

from ..methods.summary import human_bytes


class Progress:
    """Rank 0's progress: a bar on a terminal, plain periodic lines otherwise."""

    def __init__(self, enabled: bool, total: int, every: int | None, initial: int = 0) -> None:
        self.enabled = enabled
        self.total = total
        self.initial = initial  # steps already done by a run this one continues
        self.every = every or max(1, total // 20)
        self.bar = None
        self.start = time.perf_counter()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def step(self, step: int, info: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # rank 0's own bytes (no collective per step): AB-training's groups send different amounts, so the
        # evaluation lines give the mean over workers
        text = (f"phase {info['phase']} loss {info['loss']:.4f} "
                f"rank 0 wire {human_bytes(info['wire'])} (global {human_bytes(info['global'])})")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(text, refresh=False)
        elif step % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.start
            rate = (step - self.initial) / max(elapsed, 1e-9)
            eta = (self.total - step) / max(rate, 1e-9)
            print(f"step {step}/{self.total} ({100 * step / self.total:.0f}%) {text} "
                  f"{rate:.1f} steps/s eta {eta:.0f}s", flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def eval_line(row: dict[str, Any]) -> str:
    """One evaluation row as rank 0 prints it."""
    text = (f"eval step {row['step']} epoch {row['epoch']:.2f}: test accuracy {100 * row['test_accuracy']:.2f} % "
            f"test loss {row['test_loss']:.4f}")
    if row["test_perplexity"] is not None:
        text += f" perplexity {row['test_perplexity']:.2f}"
    if row["train_loss"] is not None:
        text += f" train loss {row['train_loss']:.4f}"
    return text + f" wire {human_bytes(row['wire_bytes'])} per worker (mean)"
