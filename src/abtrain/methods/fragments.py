"""A model cut into fragments that meet at staggered steps: Streaming DiLoCo's outer steps, AB-training's syncs.

The paper's pattern (Douillard et al. 2025): the layers, in model order, cut into contiguous groups of about equal
size, dealt out to the fragments in turn (:func:`layer_groups`); ``option`` names the flag an error message blames.
"""

from __future__ import annotations

from torch import nn


def parameter_units(model: nn.Module) -> list[list[int]]:
    """Indices (in ``model.parameters()`` order) of the parameters each module holds itself, modules in model order."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: set[int] = set()
    units = []
    for module in model.modules():
        own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in module.parameters(recurse=False))
        if own:
            units.append(own)
    return units


def parameter_layers(model: nn.Module) -> list[list[int]]:
    """The parameter indices of each layer, in model order: a module that holds a parameter of 2 or more dims
    (a ``Linear``, a convolution, an embedding), joined by the modules after it that hold only smaller ones
    (a norm, a bias-only module); those before the first layer join it."""
    params = list(model.parameters())
    layers: list[list[int]] = []
    before: list[int] = []  # small modules before the first layer
    for unit in parameter_units(model):
        if any(params[i].ndim >= 2 for i in unit):
            layers.append(before + unit)
            before = []
        elif layers:
            layers[-1].extend(unit)
        else:
            before.extend(unit)
    return layers or ([before] if before else [])


def equal_groups(sizes: list[int], count: int) -> list[list[int]]:
    """``sizes`` cut into ``count`` contiguous, non-empty groups of about equal sums (indices into ``sizes``).

    Group by group, each takes items while its sum comes closer to the mean of what is left (the remaining
    total over the remaining groups), at least one item and never so many that a later group would be empty;
    the last takes the rest. An item larger than the mean stands alone, and the groups after it share the rest.
    """
    if not 1 <= count <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} items into {count} non-empty groups")
    groups, start, left = [], 0, sum(sizes)
    for g in range(count):
        rest = count - g  # groups still to fill, this one included
        end = start + 1 if rest > 1 else len(sizes)
        total, target = sizes[start], left / rest
        while end < len(sizes) - (rest - 1) and abs(total + sizes[end] - target) < abs(total - target):
            total += sizes[end]
            end += 1
        groups.append(list(range(start, end)))
        left -= sum(sizes[start:end])
        start = end
    return groups


def layer_groups(model: nn.Module, count: int, per_fragment: int,
                 option: str = "--streaming-diloco-fragments") -> list[list[int]]:
    """The paper's strided pattern: the layers (:func:`parameter_layers`) cut into ``K * count`` contiguous groups of
    about equal size (:func:`equal_groups`), ``K`` = ``per_fragment`` or fewer where the model has fewer than
    ``K * count`` layers, and group ``g`` in fragment ``g mod count``: each fragment holds ``K`` groups spread over
    the depth. Returns the parameter indices of each fragment."""
    params = list(model.parameters())
    layers = parameter_layers(model)
    if len(layers) < count:
        raise ValueError(f"{option} {count}: the model has {len(layers)} layers (modules with a weight of 2 or more "
                         f"dims); choose at most {len(layers)}")
    k = max(1, min(per_fragment, len(layers) // count))
    sizes = [sum(params[i].numel() for i in layer) for layer in layers]
    groups = [[i for j in group for i in layers[j]] for group in equal_groups(sizes, k * count)]
    return [sorted(i for group in groups[f::count] for i in group) for f in range(count)]


def fragments_of(model: nn.Module, count: int, pattern: str = "strided", per_fragment: int = 2,
                 option: str = "--streaming-diloco-fragments") -> list[list[int]]:
    """The parameter indices of each of ``count`` fragments: ``pattern="strided"`` (:func:`layer_groups`), or
    ``"modules"``: module ``u`` (:func:`parameter_units`) in fragment ``u mod count``."""
    if pattern == "strided":
        return layer_groups(model, count, per_fragment, option)
    units = parameter_units(model)
    if len(units) < count:
        raise ValueError(f"{option} {count}: the model has {len(units)} modules with parameters; choose at most "
                         f"{len(units)}")
    return [sorted(i for u in units[f::count] for i in u) for f in range(count)]
