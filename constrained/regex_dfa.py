"""Compile a regular expression to a DFA over bytes.

The textbook pipeline, written out to be read in one sitting:

    pattern --parse (regex_parse.py)--> syntax tree over code points
            --Thompson--> NFA over UTF-8 bytes
            --subset construction--> DFA over byte equivalence classes
            --dead-state removal, Hopcroft minimization--> `DFA`

`DFA.matches(text.encode())` agrees with `re.fullmatch(pattern, text, re.ASCII)`. Working in bytes
lets a token that ends inside a multi-byte character still be checked; `token_index.py` builds
per-token masks on top of this.
"""

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np

# RegexError and parse_regex are re-exported: callers import everything regex-related from here.
from constrained.regex_parse import Alt, Chars, Concat, RegexError, parse_regex  # noqa: F401

DEFAULT_MAX_STATES = 50_000  # compile time at the cap bounds it; the index itself is lazy
# NFA states visited by the subset construction's closures: what bounds its time. Many
# alternatives open at once (hundreds of optional JSON properties) make each DFA state a large
# NFA-state set, so this budget can end a build long before the DFA reaches max_states.
MAX_SUBSET_WORK = 4_000_000


def utf8_sequences(lo: int, hi: int) -> list:
    """Split code points lo..hi into byte-range sequences, e.g. [(0xC2, 0xDF), (0x80, 0xBF)];
    surrogates (U+D800..U+DFFF) are left out: they are not valid UTF-8."""
    if lo > hi:
        return []
    if lo <= 0xDFFF and hi >= 0xD800:
        return utf8_sequences(lo, 0xD7FF) + utf8_sequences(0xE000, hi)
    if hi <= 0x7F:
        return [[(lo, hi)]]
    # Split where the encoded length changes, then where continuation bytes stop covering 80..BF
    # fully.
    for boundary in (0x7F, 0x7FF, 0xFFFF):
        if lo <= boundary < hi:
            return utf8_sequences(lo, boundary) + utf8_sequences(boundary + 1, hi)
    for num_trailing in (1, 2, 3):
        mask = (1 << (6 * num_trailing)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                return utf8_sequences(lo, lo | mask) + utf8_sequences((lo | mask) + 1, hi)
            if hi & mask != mask:
                return utf8_sequences(lo, (hi & ~mask) - 1) + utf8_sequences(hi & ~mask, hi)
    return [list(zip(chr(lo).encode(), chr(hi).encode()))]


class _NFA:
    """Thompson NFA: each state has byte-range edges and epsilon edges."""

    def __init__(self, max_states):
        self.max_states = max_states
        self.byte_edges = []  # per state: list of (byte_range_id, target)
        self.epsilons = []  # per state: list of targets
        self.byte_ranges = {}  # (lo, hi) -> byte_range_id

    def add_state(self):
        if len(self.byte_edges) >= self.max_states:
            raise RegexError(f"regex too large: more than {self.max_states} NFA states")
        self.byte_edges.append([])
        self.epsilons.append([])
        return len(self.byte_edges) - 1

    def add_byte_edge(self, source, byte_range, target):
        range_id = self.byte_ranges.setdefault(byte_range, len(self.byte_ranges))
        self.byte_edges[source].append((range_id, target))
        return target

    def build(self, node):
        """Add the fragment for `node`; returns its (entry, exit) states. Each node's `fragment` is
        a generator that yields a child and receives that child's (entry, exit); this loop runs them
        with its own stack, so deep trees need no recursion."""
        stack, built = [self.fragment(node)], None
        while stack:
            try:
                child = stack[-1].send(built)
            except StopIteration as finished:
                stack.pop()
                built = finished.value
            else:
                stack.append(self.fragment(child))
                built = None
        return built

    def fragment(self, node):
        """Thompson's construction for one node; `yield child` builds a child fragment."""
        entry = exit_ = self.add_state()
        if isinstance(node, Chars):
            exit_ = self.add_state()
            for lo, hi in node.ranges:
                for sequence in utf8_sequences(lo, hi):
                    source = entry
                    for byte_range in sequence[:-1]:
                        source = self.add_byte_edge(source, byte_range, self.add_state())
                    self.add_byte_edge(source, sequence[-1], exit_)
        elif isinstance(node, Concat):
            for item in node.items:
                exit_ = self.after(exit_, (yield item))
        elif isinstance(node, Alt):
            exit_ = self.add_state()
            for option in node.options:
                self.epsilons[self.after(entry, (yield option))].append(exit_)
        else:  # Repeat: min_count copies, then a loop or (max - min) optional copies
            for _ in range(node.min_count):
                exit_ = self.after(exit_, (yield node.item))
            if node.max_count is None:
                self.epsilons[self.after(exit_, (yield node.item))].append(exit_)
            else:
                skip_to = self.add_state()
                for _ in range(node.max_count - node.min_count):
                    self.epsilons[exit_].append(skip_to)
                    exit_ = self.after(exit_, (yield node.item))
                self.epsilons[exit_].append(skip_to)
                exit_ = skip_to
        return entry, exit_

    def after(self, source, fragment):
        """Link a built fragment (entry, exit) after state `source`; returns its exit."""
        entry, exit_ = fragment
        self.epsilons[source].append(entry)
        return exit_

    def closure(self, states):
        seen, stack = set(states), list(states)
        while stack:
            for target in self.epsilons[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)


@dataclass(frozen=True, eq=False)
class DFA:
    """A DFA over bytes; bytes are grouped into classes that every state treats alike."""

    byte_class: np.ndarray  # (256,) int32: byte -> class
    transitions: np.ndarray  # (num_states, num_classes) int32, -1 = no match possible
    accepting: np.ndarray  # (num_states,) bool
    start: int

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def step(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`, or -1."""
        for byte in data:
            state = int(self.transitions[state, self.byte_class[byte]])
            if state < 0:
                break
        return state

    def matches(self, data: bytes) -> bool:
        state = self.step(self.start, data)
        return state >= 0 and bool(self.accepting[state])

    def sample(self, rng, max_bytes: int = 2000):
        """A random member of the language, drawn with a `random.Random` (None if the walk passes
        max_bytes), for tests and benchmarks; an accepting state that can go on stops it 1 in 4
        times."""
        state, data = self.start, bytearray()
        while len(data) < max_bytes:
            (live_bytes,) = np.nonzero(self.transitions[state, self.byte_class] >= 0)
            if self.accepting[state] and (not len(live_bytes) or rng.random() < 0.25):
                return bytes(data)
            data.append(int(rng.choice(live_bytes)))
            state = int(self.transitions[state, self.byte_class[data[-1]]])
        return None

    def forced_bytes(self, state: int) -> bytes:
        """The bytes the regex forces from `state`: stops at an accepting state or a choice. May end
        inside a multi-byte character. Terminates: a cycle of forced, non-accepting states could
        never reach acceptance, and such states were removed."""
        class_sizes = np.bincount(self.byte_class, minlength=self.transitions.shape[1])
        forced = bytearray()
        while not self.accepting[state]:
            (live_classes,) = np.nonzero(self.transitions[state] >= 0)
            if len(live_classes) != 1 or class_sizes[live_classes[0]] != 1:
                break
            forced.append(int(np.argmax(self.byte_class == live_classes[0])))
            state = int(self.transitions[state, live_classes[0]])
        return bytes(forced)


def states_reaching(sources: np.ndarray, targets: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Bool mask of the states from which some `goal` state is reachable along edges sources ->
    targets."""
    predecessors = [[] for _ in range(len(goal))]
    for source, target in zip(sources.tolist(), targets.tolist()):
        predecessors[target].append(source)
    reached = goal.copy()
    queue = deque(np.flatnonzero(goal).tolist())
    while queue:
        for source in predecessors[queue.popleft()]:
            if not reached[source]:
                reached[source] = True
                queue.append(source)
    return reached


def _byte_classes(byte_ranges):
    """Group bytes that fall in exactly the same byte ranges; returns (byte_class, classes per
    range)."""
    membership = np.zeros((256, len(byte_ranges) + 1), dtype=bool)
    for column, (lo, hi) in enumerate(byte_ranges):
        membership[lo : hi + 1, column] = True
    byte_class = np.unique(membership, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)
    return byte_class, [np.unique(byte_class[lo : hi + 1]).tolist() for lo, hi in byte_ranges]


def _subset_construction(nfa, nfa_start, nfa_accept, max_states):
    byte_class, classes_of_range = _byte_classes(list(nfa.byte_ranges))
    num_classes = int(byte_class.max()) + 1
    start_set = nfa.closure([nfa_start])
    state_ids, state_sets, rows = {start_set: 0}, [start_set], []
    work = len(start_set)
    # state_sets grows while we walk it: each new subset is visited once.
    for state_set in state_sets:
        moves = {}
        for nfa_state in state_set:
            for range_id, target in nfa.byte_edges[nfa_state]:
                for cls in classes_of_range[range_id]:
                    moves.setdefault(cls, set()).add(target)
        row = [-1] * num_classes
        for cls, targets in moves.items():
            next_set = nfa.closure(targets)
            work += len(next_set)
            if work > MAX_SUBSET_WORK:
                raise RegexError(
                    f"regex too large: its DFA construction visits more than {MAX_SUBSET_WORK} "
                    "NFA states (too many alternatives open at once)"
                )
            if next_set not in state_ids:
                if len(state_sets) >= max_states:
                    raise RegexError(f"regex too large: more than {max_states} DFA states")
                state_ids[next_set] = len(state_sets)
                state_sets.append(next_set)
            row[cls] = state_ids[next_set]
        rows.append(row)
    transitions = np.array(rows, dtype=np.int32).reshape(len(rows), num_classes)
    return byte_class, transitions, np.array([nfa_accept in state_set for state_set in state_sets])


def _remove_dead_states(transitions, accepting, start):
    """Drop states that cannot reach an accepting state; edges into them become -1."""
    sources, classes = np.nonzero(transitions >= 0)
    live = states_reaching(sources, transitions[sources, classes], accepting)
    if not live[start]:
        raise RegexError("the regex matches no string")
    # The appended -1 lets new_ids[-1] map the "no match" marker to itself.
    new_ids = np.append(np.where(live, np.cumsum(live) - 1, -1), -1).astype(np.int32)
    return new_ids[transitions][live], accepting[live], int(new_ids[start])


def _minimize(transitions, accepting, start):
    """Hopcroft's algorithm: split blocks of states until the states of a block are
    indistinguishable."""
    num_states, num_classes = transitions.shape
    # Make "-1" an explicit sink so every state has a successor on every class.
    sink = num_states
    complete = np.vstack(
        [np.where(transitions >= 0, transitions, sink), np.full((1, num_classes), sink)]
    )
    # Incoming edges of each state as (class, source), sorted by target: one flat list, no list per
    # state.
    order = np.argsort(complete.ravel(), kind="stable")
    bounds = np.searchsorted(complete.ravel()[order], np.arange(num_states + 2)).tolist()
    edge_source, edge_class = (
        index.ravel()[order].tolist() for index in np.indices(complete.shape)
    )
    # Start from two blocks, accepting (0) and not (1, with the sink): neither is empty.
    is_final = np.append(accepting, False)
    blocks = [set(np.flatnonzero(group).tolist()) for group in (is_final, ~is_final)]
    block_of = (~is_final).astype(int).tolist()
    pending = {0, 1}
    while pending:
        # The states entering the splitter, per class; only edges into the splitter are visited.
        entering_by_class = {}
        for target in blocks[pending.pop()]:
            for edge in range(bounds[target], bounds[target + 1]):
                entering_by_class.setdefault(edge_class[edge], []).append(edge_source[edge])
        for sources_in in entering_by_class.values():
            # Split every block into the states that enter the splitter on this class and those that
            # do not.
            entering = {}
            for source in sources_in:
                entering.setdefault(block_of[source], set()).add(source)
            for block_id, inside in entering.items():
                if len(inside) == len(blocks[block_id]):
                    continue
                blocks[block_id] -= inside
                blocks.append(inside)
                for state in inside:
                    block_of[state] = len(blocks) - 1
                # Refining by the smaller half is enough (the other half is implied): O(n log n).
                smaller = len(blocks) - 1 if len(inside) <= len(blocks[block_id]) else block_id
                pending.add(len(blocks) - 1 if block_id in pending else smaller)
    # Number blocks by their smallest state: keeps the subset-construction order, so start stays
    # first.
    block_ids = np.array(block_of)
    _, representatives = np.unique(block_ids[:num_states], return_index=True)
    representatives.sort()
    new_id = np.full(len(blocks), -1, dtype=np.int32)  # the sink's block stays -1
    new_id[block_ids[representatives]] = np.arange(len(representatives))
    return (
        new_id[block_ids[complete[representatives]]],
        accepting[representatives],
        int(new_id[block_ids[start]]),
    )


def strip_leading_space(dfa: DFA) -> DFA:
    """The DFA of the raw text whose decoded form ``dfa`` matches, for a decoder that drops one
    leading space (SentencePiece's, as in Llama 2: the first token's "▁" is not shown). A new start
    state reads a space as nothing and any other byte as the old start does; no edge leads back to
    it."""
    space = 0x20
    num_classes = dfa.transitions.shape[1]
    byte_class = dfa.byte_class.copy()
    byte_class[space] = num_classes  # a class of its own: the new start treats it apart
    transitions = np.concatenate(
        [dfa.transitions, dfa.transitions[:, dfa.byte_class[space]][:, None]], axis=1
    )
    first = transitions[dfa.start].copy()
    first[num_classes] = dfa.start
    transitions = np.concatenate([transitions, first[None]]).astype(np.int32)
    accepting = np.append(dfa.accepting, dfa.accepting[dfa.start])
    return DFA(byte_class, transitions, accepting, dfa.num_states)


# main.py compiles the regex to check it before the model loads, then the index needs the same DFA:
# a large JSON Schema takes seconds, so keep the last few (DFAs are never modified after compiling).
@functools.lru_cache(maxsize=4)
def compile_regex(pattern: str, max_states: int = DEFAULT_MAX_STATES) -> DFA:
    """Compile `pattern` (Python `re` syntax, `re.ASCII`, fullmatch semantics) to a minimal byte
    DFA.

    Args:
        pattern: The regex. Unsupported: lookaround, backreferences, \\b, \\A, \\Z, inline flags,
            possessive quantifiers and atomic groups.
        max_states: Raise RegexError when the DFA needs more states than this.
    """
    nfa = _NFA(max_states=4 * max_states)
    nfa_start, nfa_accept = nfa.build(parse_regex(pattern))
    byte_class, transitions, accepting = _subset_construction(
        nfa, nfa_start, nfa_accept, max_states
    )
    transitions, accepting, start = _remove_dead_states(transitions, accepting, 0)
    transitions, accepting, start = _minimize(transitions, accepting, start)
    # Classes whose columns became identical are now one class.
    merged, columns = np.unique(transitions, axis=1, return_inverse=True)
    return DFA(columns.reshape(-1)[byte_class].astype(np.int32), merged, accepting, start)
