"""What a decomposition after a low-rank sync costs, with full SVDs and with --ab-svd update.

    .venv/bin/python benchmarks/svd_update.py [--threads 1] [--repeats 3] [--shapes 1024x1568:660,1024x1024:762]
        [--q 64]

For each m×n shape at rank r: W is the SVD (U, σ, Vᵀ) of a phase's start plus a rank-q change P·Qᵀ,
merged as the sync does with --ab-tangent-core mean. Timed, each the median of the repeats:

- merge: forming W from the dense change (basis, change, core 0.5) and from its parts (--ab-svd update);
- SVD: torch.linalg.svd of W (full) and lowrank.svd_update from the parts, with its check against W;
- map: the pseudo-inverse of the frozen factor Vᵀ that --ab-optimizer-state map takes with full SVDs
  (update reads it as its transpose).

The default shapes and ranks are the wide Fashion-MNIST model's fc1 and fc2 at the ranks the GPT's
configuration keeps (docs/notebook/2026-12-svd-update.md, "Updating the SVD after a low-rank sync"). It also prints
how far the updated singular values are from the full SVD's, and the updated SVD's relative residual
‖W − U·S·Vᵀ‖_F / ‖W‖_F. Writes benchmarks/results/svd_update.json.
"""
import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

from abtrain.methods.ab import lowrank
from abtrain.methods.ab.lowrank.optimizer_state import PINV_RTOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1, help="torch threads (a worker of 4 on 2 cores uses 1)")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--shapes", default="1024x1568:660,1024x1024:762", help="MxN:RANK, comma-separated")
p.add_argument("--q", type=int, default=64, help="rank of the sync's change (--ab-sync-rank)")
args = p.parse_args()
torch.set_num_threads(args.threads)


def timed(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


rows = []
for spec in args.shapes.split(","):
    shape, rank = spec.split(":")
    m, n = (int(x) for x in shape.split("x"))
    r, q = int(rank), args.q
    gen = torch.Generator().manual_seed(0)
    (fp,) = lowrank.prepare_model(nn.Sequential(nn.Linear(n, m)), full_rank_patterns=())
    u = torch.linalg.qr(torch.randn(m, r, generator=gen))[0]
    vh = torch.linalg.qr(torch.randn(n, r, generator=gen))[0].T.contiguous()
    basis = lowrank.SVD(u, torch.linspace(1.0, 0.05, r), vh)
    pq = (0.01 * torch.randn(m, q, generator=gen), torch.randn(n, q, generator=gen))
    parts = lowrank.tangent_parts(basis, *pq, core=0.5)
    lowrank.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")

    def merge_change():
        lowrank.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")
        lowrank.recompose(fp, basis, pq[0] @ pq[1].T, core=0.5)

    def merge_parts():
        lowrank.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")
        lowrank.recompose(fp, parts=parts)

    t_merge_change, t_merge_parts = timed(merge_change), timed(merge_parts)
    # recompose switched the layer to full mode: W now holds the merge, as after a sync
    full_svd = lowrank.svd(fp)
    w = fp.weight.detach()
    updated = lowrank.svd_update(fp, parts)
    if updated is None:
        raise SystemExit(f"{m}x{n} at rank {r}: the update did not hold (r + q >= min(m, n)?)")
    k = updated.U.shape[1]
    row = {"m": m, "n": n, "rank": r, "q": q,
           "merge_change_s": t_merge_change, "merge_parts_s": t_merge_parts,
           "svd_full_s": timed(lambda: lowrank.svd(fp)), "svd_update_s": timed(lambda: lowrank.svd_update(fp, parts)),
           "pinv_s": timed(lambda: torch.linalg.pinv(vh.T, rtol=PINV_RTOL)),  # as map_state takes it
           "sigma_max_abs_diff": float((updated.S[:k] - full_svd.S[:k]).abs().max()),
           "relative_residual": float(torch.linalg.matrix_norm(w - (updated.U * updated.S[:k]) @ updated.Vh)
                                      / torch.linalg.matrix_norm(w)),
           "sigma_1": float(full_svd.S[0])}
    rows.append(row)

print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats}; q = {args.q}")
print(f"{'shape':>11} {'rank':>5} | {'merge: change':>13} {'parts':>7} | {'SVD: full':>9} {'update':>7} {'ratio':>6} | "
      f"{'pinv':>7} | {'max |dσ|':>9} {'residual':>9}")
for row in rows:
    print(f"{row['m']:>5}x{row['n']:<5} {row['rank']:>5} | {row['merge_change_s']:>12.3f}s {row['merge_parts_s']:>6.3f}s | "
          f"{row['svd_full_s']:>8.3f}s {row['svd_update_s']:>6.3f}s {row['svd_full_s'] / row['svd_update_s']:>5.1f}x | "
          f"{row['pinv_s']:>6.3f}s | {row['sigma_max_abs_diff']:>9.2e} {row['relative_residual']:>9.2e}")
out = os.path.join(ROOT, "benchmarks", "results", "svd_update.json")
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w") as f:
    json.dump({"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats, "rows": rows}, f, indent=1)
print(f"wrote {os.path.relpath(out, ROOT)}")
