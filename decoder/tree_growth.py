"""A drafting model's tree for one row, grown as EAGLE-2 (arXiv 2406.16858): each depth runs the
model from the nodes most likely accepted, and the tree takes the best of all nodes drawn.

A node's chance is the product of its path's edges: the most likely child is accepted with the
calibrated top probability c, another child x with ``(1 - c) * q(x) / (1 - q(top))``.
"""

from typing import Callable, NamedTuple, Optional

from decoder.draft import Draft


class Node(NamedTuple):
    chance: float  # of being accepted: the product of the edges' along its path
    depth: int  # 1 for a child of the row's last token
    parent: int  # its parent's index in ``TreeGrowth.nodes``; -1: the row's last token
    index: int  # its token as the drafting model indexes it (what the model is fed)
    token: int


def best_nodes(nodes: list, max_nodes: int, threshold: Optional[float]) -> list:
    """Indices of the ``max_nodes`` nodes of highest chance over ``threshold``, best first. A
    parent's chance is at least its child's, and ties go to the earlier: every prefix is a tree."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].chance, i))[:max_nodes]
    return [i for i in order if threshold is None or nodes[i].chance > threshold]


class TreeGrowth:
    """One row's tree while its drafter draws it; ``width``: the nodes per depth the model runs
    from, the greedy chain's among them."""

    def __init__(self, width: int, calibration: Callable[[float], float]):
        self.width, self.calibration = width, calibration
        self.nodes = []

    def add_children(self, parent: int, top: list, confidence: float) -> list:
        """Add the children of ``parent`` (-1: the row's last token) from the model's ``top``
        ``(index, token, q)`` there, most likely first; returns their indices."""
        reach = 1.0 if parent < 0 else self.nodes[parent].chance
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        chance = self.calibration(confidence)
        rest = max(1.0 - top[0][2], 1e-9)  # the model's mass beside its top token
        first = len(self.nodes)
        for rank, (index, token, q) in enumerate(top):
            edge = chance if rank == 0 else (1 - chance) * q / rest
            self.nodes.append(Node(reach * edge, depth, parent, index, token))
        return list(range(first, len(self.nodes)))

    def frontier(self, drawn: list, chain_node: Optional[int], stop: float) -> list:
        """The ``width - 1`` best nodes just ``drawn`` to run from beside the chain's, each at least
        ``stop``: below it, no descendant pays for its draft."""
        others = [node for node in drawn if node != chain_node and self.nodes[node].chance >= stop]
        others.sort(key=lambda node: -self.nodes[node].chance)
        return others[: self.width - 1]

    def tree(self, max_nodes: int, threshold: Optional[float]) -> tuple:
        """``(draft, expected)``: the ``best_nodes``' tree, best first (a narrower pass cuts the
        last), and the tokens it should give, the target's own included."""
        taken = best_nodes(self.nodes, max_nodes, threshold)
        place = {node: position for position, node in enumerate(taken)}
        nodes = [self.nodes[node] for node in taken]
        parents = [-1 if node.parent < 0 else place[node.parent] for node in nodes]
        draft = Draft(
            [node.token for node in nodes], parents=parents, chances=[node.chance for node in nodes]
        )
        return draft, 1 + sum(node.chance for node in nodes)
