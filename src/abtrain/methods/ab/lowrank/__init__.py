"""Low-rank factorisation of weights for AB-training.

Every factorisable weight W (shape S) is viewed as the matrix m×n with
m = S[0] and n = prod(S[1:]) (a conv kernel (C_out, C_in/groups, kh, kw) becomes
(C_out, C_in/groups·kh·kw)), or, turned tall (``orientation="tall"``), as that
matrix's transpose where it is wide (m < n); every part below works on the matrix
the layer factorises. :func:`prepare_model` puts a :class:`LowRankWeight`
parametrization (``torch.nn.utils.parametrize``) on each such weight, so the owning
module -- ``nn.Linear``, any ``nn.Conv*``, ``nn.MultiheadAttention`` -- keeps calling
``self.weight`` and gets either W itself (mode ``"full"``) or W of the matrix ``A @ B``
(mode ``"lowrank"``).

The factors A (m×r) and B (r×n) are parameters of the parametrization from the
start (as 0-size placeholders), so an optimizer built once over
``model.parameters()`` after :func:`prepare_model` sees every parameter it will
ever need. Decomposition and recomposition only swap ``.data`` of those same
Parameter objects; :func:`resize_state` (called by :func:`decompose` when given
the optimizer) keeps the optimizer's moment buffers in step with the new ranks.

This package is single-process. Where workers must agree (the rank of each layer),
the pieces are exposed separately: :func:`svd` (or :func:`svd_update`) -> :meth:`RankRule.choose` ->
all-reduce(MAX) by the caller -> :func:`decompose` / :func:`decompose_all`.

Its rooms: ``layers`` (the parametrization, preparing a model), ``modes`` (W or A·B, which factor trains), ``ranks``
(rank rules), ``decompose`` (SVD, factors, initialisation), ``optimizer_state``
(the factors' optimizer state resized, mapped into a new basis or dropped),
``report`` (counts, ratios, per-layer lines, the output layer). The plain
state_dict that folds the parametrizations back is every method's export
(:func:`abtrain.methods.loop.plain_state_dict`).
"""


from .decompose import (SVD, SVDError, LowRankSum, decompose, decompose_all, ortho_sigma_init, recompose, svd,
                        svd_update, tangent_parts, unit_spectrum)
from .layers import (APPLY_MODES, DEFAULT_FULL_RANK_PATTERNS, ORIENTATIONS, FactorizedParam, LowRankWeight,
                     factors_cheaper, prepare_model)
from .modes import set_mode, set_trainable
from .optimizer_state import map_state, reset_state, resize_state
from .ranks import RankRule, factors_compress, paying_rank, state_rank
from .report import (ab_param_count, compression_ratio, decision_lines, describe, format_ratio, full_param_count,
                     full_tensor_count, log_decisions, output_weights)

__all__ = [
    "APPLY_MODES",
    "DEFAULT_FULL_RANK_PATTERNS",
    "ORIENTATIONS",
    "FactorizedParam",
    "LowRankSum",
    "LowRankWeight",
    "RankRule",
    "SVD",
    "SVDError",
    "ab_param_count",
    "compression_ratio",
    "decompose",
    "decompose_all",
    "decision_lines",
    "describe",
    "factors_cheaper",
    "factors_compress",
    "format_ratio",
    "full_param_count",
    "full_tensor_count",
    "log_decisions",
    "map_state",
    "ortho_sigma_init",
    "output_weights",
    "paying_rank",
    "prepare_model",
    "recompose",
    "reset_state",
    "resize_state",
    "set_mode",
    "set_trainable",
    "state_rank",
    "svd",
    "svd_update",
    "tangent_parts",
    "unit_spectrum",
]
