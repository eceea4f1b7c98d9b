"""Group flat parameter names by decoder layer, with no per-architecture table."""

from __future__ import annotations

__all__ = ["in_layer_stack", "layerwise_groups"]


def _stack_key(name: str) -> tuple[str, int] | None:
    """`(prefix, index)` of the outermost all-digit segment of `name`, or `None`.

    The outermost index keeps a MoE layer whole: `model.layers.3.mlp.experts.7.w1`
    keys on layer 3, not on expert 7.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def in_layer_stack(name: str) -> bool:
    """Whether `name` belongs to a repeated layer (it has an all-digit segment)."""
    return _stack_key(name) is not None


def layerwise_groups(names: list[str]) -> list[list[str]]:
    """Partition `names` into one group per layer, keyed on the outermost index.

    Because the key is the index segment, `model.layers.0.`, `transformer.h.0.`,
    `backbone.layers.0.` or `visual.blocks.0.` all group alike. Names without an
    index are the *pre* block (before the first indexed name) and the *post* block
    (after it; the post block comes last even when it arrived before the layers, as a
    pipeline stage may send it). Stacks are ordered by first appearance of their
    prefix, then by index. Group *g* means the same thing on every rank because it
    is derived from metadata order. No group is empty.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        key = _stack_key(name)
        if key is None:
            (post if stacks else pre).append(name)
        else:
            stacks.setdefault(key, []).append(name)
    prefix_order: dict[str, int] = {}
    for prefix, _ in stacks:
        prefix_order.setdefault(prefix, len(prefix_order))
    ordered = sorted(stacks, key=lambda key: (prefix_order[key[0]], key[1]))
    groups = [pre] if pre else []
    groups.extend(stacks[key] for key in ordered)
    if post:
        groups.append(post)
    return groups
