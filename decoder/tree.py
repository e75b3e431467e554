"""A draft tree's geometry (SpecInfer, EAGLE-2): a ``Draft`` whose tokens name their parents, its
depths, paths and leaves, and each row's slots in a pass (``layout``). docs/draft_trees.md.
"""

from typing import Optional, Sequence

from .draft import Draft


def depths(parents: Sequence[int]) -> list:
    """Each node's depth: 1 for a child of the last held token."""
    result = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def is_chain(parents: Optional[Sequence[int]]) -> bool:
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def path_to(parents: Sequence[int], node: int) -> list:
    """The nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def layout(num_pending: int, parents: Optional[Sequence[int]], width: int) -> tuple:
    """``(depth, visible)`` of a row's ``width`` pass slots: its pending tokens, its draft's nodes,
    then padding. ``depth[j]``: slot j's position past the row's first fed token; ``visible[j][k]``:
    whether slot j sees slot k (its pending tokens, its ancestors and itself)."""
    num_nodes = 0 if parents is None else len(parents)
    node_depths = depths(parents) if parents is not None else []
    depth = list(range(num_pending)) + [num_pending - 1 + d for d in node_depths]
    depth += list(range(len(depth), width))
    visible = [[k <= j for k in range(width)] for j in range(num_pending)]
    for node in range(num_nodes):
        seen = [k < num_pending for k in range(width)]
        for ancestor in path_to(parents, node):
            seen[num_pending + ancestor] = True
        visible.append(seen)
    for j in range(num_pending + num_nodes, width):  # padding sees what comes before it
        visible.append([k <= j for k in range(width)])
    return depth, visible


def kept_slots(num_pending: int, path: Sequence[int]) -> list:
    """The pass slots a row keeps, in order: its pending tokens and its accepted path."""
    return list(range(num_pending)) + [num_pending + node for node in path]


def leaves(parents: Sequence[int]) -> list:
    """The nodes with no children, in index order."""
    children = children_of(parents)
    return [node for node in range(len(parents)) if node not in children]


def children_of(parents: Sequence[int]) -> dict:
    """Node -> its children in index order (-1: the root's)."""
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def select(draft, nodes: Sequence[int]):
    """The tree of ``draft``'s ``nodes`` (closed under parents, in index order), renumbered."""
    index = {node: i for i, node in enumerate(nodes)}
    parents = [index.get(draft.parents[node], -1) for node in nodes]
    chances = None if draft.chances is None else [draft.chances[node] for node in nodes]
    return Draft(
        [draft.tokens[node] for node in nodes],
        expected_speedup=draft.expected_speedup,
        parents=parents,
        chances=chances,
    )
