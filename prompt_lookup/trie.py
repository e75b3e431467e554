"""The continuations of several matches, merged into one draft tree (``decoder.tree``).

Each node is a token that follows its parent in at least one match. A node is drafted when the
chance that the target accepts it pays for scoring it: given that its parent is accepted, the
best match's child (elsewhere, the child most matches agree on) is right with the estimated copy
rate ``a`` (the one chain drafting uses), so the best match alone drafts what a chain would. Where
it is wrong, another child is right with the measured rate ``b`` (``judge``), and the other
children share ``(1 - a) * b`` in proportion to the matches behind them. A node's chance is the
product along its path, which never grows with depth, so taking nodes best first always takes a
parent before its children.
"""

import heapq
from typing import Optional, Sequence

from decoder.draft import Draft


class _Node:
    def __init__(self, token: int, parent: int):
        self.token, self.parent = token, parent
        self.votes, self.children = 0, {}
        self.main = False  # on the best match's continuation


def merge(continuations: Sequence[Sequence[int]], max_depth: int) -> list:
    """The trie of ``continuations`` (best match first) cut at ``max_depth``: a list of nodes, the
    root's children first in the order their first match came."""
    root, nodes = _Node(-1, -2), []
    for rank, continuation in enumerate(continuations):
        at, index = root, -1
        for token in continuation[:max_depth]:
            if token not in at.children:
                nodes.append(_Node(token, index))
                at.children[token] = len(nodes) - 1
            index = at.children[token]
            at = nodes[index]
            at.votes += 1
            at.main = at.main or rank == 0
    return [root] + nodes  # nodes[i + 1] is node i; root's children keep their order


def _ranked(trie: list, node: int) -> list:
    """``node``'s children, the favoured one first: the best match's, else the one most matches
    agree on."""
    children = trie[node + 1].children.values()
    return sorted(children, key=lambda c: (not trie[c + 1].main, -trie[c + 1].votes))


def judge(continuations: Sequence[Sequence[int]], emitted: Sequence[int]) -> list:
    """Walk the text the target ``emitted`` down the trie of ``continuations``: at each node where
    the favoured child is wrong and others were offered, whether one of them was right (the walk
    goes on through it, else stops). Drafted or not, so the estimate never starves."""
    trie, node, verdicts = merge(continuations, len(emitted)), -1, []
    for token in emitted:
        ranked = _ranked(trie, node)
        if not ranked:
            break
        found = next((c for c in ranked if trie[c + 1].token == token), None)
        if found != ranked[0] and len(ranked) > 1:
            verdicts.append(found is not None)
        if found is None:
            break
        node = found
    return verdicts


def choose(
    continuations: Sequence[Sequence[int]],
    rate: float,
    token_cost: Optional[float],
    max_nodes: int,
    max_depth: int,
    second: float = 1.0,
) -> tuple:
    """``(draft, expected, main_depth)``: the tree of the nodes most likely accepted, at
    most ``max_nodes``, and only those whose chance exceeds ``token_cost`` (None: no threshold).
    ``second``: the rate ``b`` at which another child is right where the favoured one is wrong.
    ``expected``: the tokens it is expected to give, the target's own included (the sum of its
    nodes' chances + 1); ``main_depth``: how many of its nodes are the best match's."""
    trie = merge(continuations, max_depth)
    chance = {-1: 1.0}
    frontier = [(-1.0, 0, -1)]  # (-chance, order, node): the root first
    taken, order = [], 0
    while frontier and len(taken) < max_nodes + 1:
        negative, _, node = heapq.heappop(frontier)
        taken.append(node)
        ranked = _ranked(trie, node)  # the favoured child gets the copy rate
        others = sum(trie[c + 1].votes for c in ranked[1:])
        for rank, child in enumerate(ranked):
            share = rate if rank == 0 else (1 - rate) * second * trie[child + 1].votes / others
            chance[child] = -negative * share
            if token_cost is None or chance[child] > token_cost:
                order += 1
                heapq.heappush(frontier, (-chance[child], order, child))
    nodes = taken[1:]
    # Parents come before children in ``taken``; renumber in that order.
    index = {node: i for i, node in enumerate(nodes)}
    index[-1] = -1
    tokens = [trie[node + 1].token for node in nodes]
    parents = [index[trie[node + 1].parent] for node in nodes]
    expected = 1 + sum(chance[node] for node in nodes)
    main_depth = sum(trie[node + 1].main for node in nodes)
    chances = [chance[node] for node in nodes]
    return Draft(tokens, parents=parents, chances=chances), expected, main_depth
