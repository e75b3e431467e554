"""Tiny random models, scripted draft sources and child processes shared by the tests."""

import signal
import subprocess
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models import llama

from decoder import Draft, DraftSource


def tiny_llama(vocab_size=64, num_layers=2, hidden_size=32, seed=0, sharp=4.0):
    """A random Llama small enough to run thousands of steps in a test.

    ``sharp`` scales the head so the distributions are not flat, which would make
    greedy ties and sampling tests uninformative.
    """
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * sharp
    mx.eval(model.parameters())
    return model


class ScriptedSource(DraftSource):
    """Proposes tokens from a function of the position; records what it was told."""

    def __init__(self, propose_fn, name="scripted", probs_fn=None):
        self.name = name
        self.propose_fn = propose_fn
        self.probs_fn = probs_fn
        self.updates = []
        self.resets = 0

    def reset(self, *args):
        super().reset(*args)
        self.resets += 1

    def propose(self, tokens, max_draft, max_nodes=None):
        draft = self.propose_fn(tokens, max_draft)
        if not draft:
            return None
        probs = self.probs_fn(tokens, draft) if self.probs_fn else None
        return Draft(list(draft), probs)

    def update(self, tokens, num_proposed, num_accepted):
        self.updates.append((len(tokens), num_proposed, num_accepted))


def end_with_a_match(tokens: list, ngram: int):
    """Extend ``tokens`` in place with new ids so that its end repeats ``ngram`` earlier tokens and
    agrees with them exactly ``ngram`` tokens back: a prompt-lookup match of that size, whose copy
    (the 16 tokens that followed, then more) is long enough for any draft length."""
    first = max(tokens, default=0) + 1
    before, other_before, *pattern = range(first, first + 2 + ngram)
    follow = list(range(first + 2 + ngram, first + 18 + ngram))
    tokens += [before, *pattern, *follow, other_before, *pattern]


def target_accepts(source, tokens: list, num_accepted: int, times: int = 60):
    """Let ``source`` copy at the end of ``tokens`` ``times`` times, and report to it what a target
    that accepts the first ``num_accepted`` tokens of each copy and rejects the next one would."""
    for _ in range(times):
        draft = source.propose(tokens, max_draft=100)
        num_proposed = len(draft.tokens) if draft else 0
        source.update(tokens, num_proposed, min(num_accepted, num_proposed))


def chi_square_p_value(counts, probs):
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled."""
    import numpy as np
    from scipy.stats import chisquare

    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    observed_cells = list(counts[big]) + [counts[~big].sum()]
    expected_cells = list(expected[big]) + [expected[~big].sum()]
    if expected_cells[-1] == 0:
        observed_cells.pop()
        expected_cells.pop()
        assert counts[~big].sum() == 0, "a token with zero probability was sampled"
    return chisquare(observed_cells, expected_cells).pvalue


def assert_sampling_keeps_the_target_distribution(
    target, make_run, temp, top_p, runs=1500, stats=None, tree_nodes=0
):
    """Sample two tokens ``runs`` times through the loop and chi-square them against the target's
    own joint distribution. ``make_run() -> (model, draft_sources)`` builds fresh sources per run;
    ``stats`` collects the runs' decoding statistics; ``tree_nodes``: the loop's."""
    import numpy as np

    from decoder import DecodingStats, Sampling, enable_trees, generate_step

    vocab, prompt, sampling = target.args.vocab_size, [1, 2, 3], Sampling(temp, top_p)
    p1 = np.array(sampling.probs(target(mx.array([prompt]))[0, -1:])[0])
    nexts = mx.array([prompt + [t] for t in range(vocab)])
    p2 = np.array(sampling.probs(target(nexts)[:, -1]))
    joint = (p1[:, None] * p2).reshape(-1)

    mx.random.seed(11)
    stats = DecodingStats() if stats is None else stats
    counts = np.zeros(vocab * vocab, dtype=np.int64)
    for _ in range(runs):
        model, sources = make_run()
        if tree_nodes:
            enable_trees(model)
        out = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                draft_sources=sources,
                sampling=sampling,
                eos_token_ids=(),
                max_tokens=2,
                stats=stats,
                tree_nodes=tree_nodes,
            )
        ]
        counts[out[0] * vocab + out[1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3
    assert 0 < stats.draft_accepted < stats.draft_proposed


def assert_constrained_sampling_is_exact(model, constraint, temp=1.0, runs=1500):
    """Two tokens sampled under ``constraint`` with a source that ignores it (its own q puts mass
    on forbidden tokens, as a draft model's does), chi-squared against the target's masked joint
    distribution computed by brute force. A forbidden draft token must be rejected into the
    residual (p - q)+; cutting the draft there and sampling from p would skew the output."""
    import numpy as np

    from decoder import DecodingStats, Sampling, generate_step

    vocab, prompt, sampling = model.args.vocab_size, [1, 2, 3], Sampling(temp)

    def masked(context, mask):
        logits = model(mx.array([context]))[0, -1]
        return np.array(sampling.probs(mx.where(mx.array(mask), logits, -mx.inf)[None]))[0]

    first_mask = np.array(constraint.masks(constraint.walk([])))[0]
    p1 = masked(prompt, first_mask)
    joint = np.zeros((vocab, vocab))
    for first in np.flatnonzero(first_mask):
        second_mask = np.array(constraint.masks(constraint.walk([int(first)])))[1]
        joint[first] = p1[first] * masked(prompt + [int(first)], second_mask)

    q = np.full(vocab, 0.2 / vocab)
    q[[ord(c) for c in "abcx"]] += 0.2  # mostly allowed letters, some forbidden tokens
    q = q / q.sum()
    rng = np.random.default_rng(0)
    source = ScriptedSource(
        lambda tokens, k: rng.choice(vocab, size=min(k, 2), p=q).tolist(),
        name="random",
        probs_fn=lambda tokens, draft: mx.array(np.tile(q, (len(draft), 1)), mx.float32),
    )
    mx.random.seed(5)
    counts, stats = np.zeros(vocab * vocab, dtype=np.int64), DecodingStats()
    for _ in range(runs):
        out = [
            token
            for token, _ in generate_step(
                prompt,
                model,
                draft_sources=[source],
                constraint=constraint,
                sampling=sampling,
                max_tokens=2,
                stats=stats,
                eos_token_ids=(),
            )
        ]
        counts[out[0] * vocab + out[1]] += 1
    assert chi_square_p_value(counts, joint.reshape(-1)) > 1e-3
    assert 0 < stats.draft_accepted < stats.draft_proposed


def tiny_byte_tokenizer(thinking: bool = False):
    """A byte-level BPE tokenizer with every byte, a few merges and an EOS: vocab of ~270.

    Small enough for a tiny random model, yet it has multi-byte tokens (so forced
    text and token masks are not trivially one byte per token). ``thinking``: with
    ``<think>`` and ``</think>`` as special tokens after EOS, as thinking models have.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from constrained.token_index import gpt2_unicode_to_byte

    alphabet = {byte: char for char, byte in gpt2_unicode_to_byte().items()}
    vocab = {alphabet[byte]: byte for byte in range(256)}
    pairs = ["1 2", "2 0", "- 0", "a b", '" :', "a m", "e :", "n a", "na m", "nam e:"]
    merges = []
    for pair in pairs:
        left, right = (("".join(alphabet[b] for b in part.encode())) for part in pair.split(" "))
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    if thinking:
        tokenizer.add_special_tokens(
            [AddedToken("<think>", special=True), AddedToken("</think>", special=True)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def qwen3_small_tokenizer(opens: bool = False):
    """Qwen3's tokenizer and shipped chat template (tests/data/qwen3-small: its first 4096 tokens
    and every added token), as mlx-lm wraps it; ``opens``: the template's generation prompt opens
    the think block, as Qwen3.5's and Qwen3-Thinking-2507's do."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parent / "data" / "qwen3-small")
    if opens:
        tokenizer.chat_template = tokenizer.chat_template.replace(
            "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
        )
        assert "assistant\\n<think>\\n' }}" in tokenizer.chat_template
    return TokenizerWrapper(tokenizer)


def restore_sigint():
    """A child's SIGINT at its default (``preexec_fn``): a shell that runs the tests in the
    background starts them with SIGINT ignored, and a child would inherit that and never see one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_process(command: list, **popen_args) -> subprocess.Popen:
    """``subprocess.Popen`` with SIGINT at its default; end it with ``stop`` on every path."""
    return subprocess.Popen(command, preexec_fn=restore_sigint, **popen_args)


def stop(process: subprocess.Popen, timeout: float = 30):
    """End ``process`` if it still runs (SIGTERM, SIGKILL after ``timeout`` s), reap it and close
    its pipes."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


@contextmanager
def running(command: list, **popen_args):
    """A child process for the length of the block, stopped on every way out of it (a timeout or
    a failed assertion too)."""
    process = start_process(command, **popen_args)
    try:
        yield process
    finally:
        stop(process)


def drain(generator, uids) -> list:
    """Run a ``BatchGenerator`` until it is done; each uid's tokens, every response error-free."""
    tokens = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            assert response.error is None
            tokens[response.uid] += response.tokens
    return [tokens[uid] for uid in uids]


def count_trees(source, shapes: list):
    """Make ``source`` note in ``shapes``, for each draft it proposes when asked for a tree,
    whether it gave one (so a test of trees can check that trees were verified)."""
    propose = source.propose

    def counted(tokens, max_draft, max_nodes=None):
        draft = propose(tokens, max_draft, max_nodes)
        if max_nodes is not None:
            shapes.append(draft is not None and draft.parents is not None)
        return draft

    source.propose = counted
    return source
