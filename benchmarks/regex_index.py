"""Regex index build: our DFA + token index vs outlines-core, on the embedded model's 49k vocabulary.

    python -m benchmarks.regex_index      # pip install outlines-core for the comparison columns

Also measures the per-token cost of masking (gather the state's mask, mx.where over the logits)
against one decoding step of the embedded model. Our index builds rows lazily: "index ms" is the
up-front part (the liveness check), "row ms" the mean cost of a state's row on first visit.
"""

import statistics
import time

import mlx.core as mx

from benchmarks.run import REGEX_CASES
from constrained.regex_dfa import compile_regex
from constrained.token_index import TokenIndex, token_byte_strings
from decoder import eos_ids_of
from loading import load_model

REPEATS = 3


def median_ms(call, repeats=REPEATS):
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3, result


def decode_step_ms(model) -> float:
    """Median ms of one decoding step (one token, KV cache of 64): what masking is compared with."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.zeros((1, 64), mx.int32), cache=cache)
    step = mx.array([[1]])

    def decode_step():
        mx.eval(model(step, cache=cache))
        for layer in cache:
            layer.trim(1)

    return median_ms(decode_step, 30)[0]


def outlines_vocabulary(token_bytes, eos):
    """The same token bytes, as outlines-core wants them (None when it is not installed)."""
    try:
        import outlines_core
    except ImportError:
        return None
    by_bytes = {}
    for token_id, data in enumerate(token_bytes):
        if data is not None:
            by_bytes.setdefault(data, []).append(token_id)
    return outlines_core.Vocabulary(min(eos), by_bytes)


def main():
    model, tokenizer, _ = load_model()
    vocab_size = model.args.vocab_size
    eos = eos_ids_of(tokenizer)
    bytes_ms, token_bytes = median_ms(lambda: token_byte_strings(tokenizer, vocab_size), 1)
    vocabulary = outlines_vocabulary(token_bytes, eos)

    print(f"token bytes of the {vocab_size}-token vocabulary: {bytes_ms:.0f} ms (once per tokenizer)\n")
    print("| regex | DFA states | byte classes | compile ms | index ms | row ms | outlines-core ms | outlines-core states |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    indexes = {}
    for name, (_, pattern) in REGEX_CASES.items():
        compile_ms, dfa = median_ms(lambda: compile_regex(pattern))
        index_ms, index = median_ms(lambda: TokenIndex.build(dfa, token_bytes, eos))
        indexes[name] = index
        theirs = "- | -"
        if vocabulary is not None:
            import outlines_core

            their_ms, their_index = median_ms(lambda: outlines_core.Index(pattern, vocabulary))
            theirs = f"{their_ms:.0f} | {len(their_index.get_transitions())}"
        row_ms, _ = median_ms(lambda: [index.row(s) for s in range(index.num_states)], 1)
        print(f"| {name} | {dfa.num_states} | {dfa.transitions.shape[1]} | {compile_ms:.1f} | {index_ms:.0f} | "
              f"{row_ms / index.num_states:.2f} | {theirs} |")

    index = indexes["json"]
    logits = mx.random.normal((1, vocab_size))

    def mask_step():
        states = [index.start]
        states.append(index.next_state(states[-1], 4))  # the walk: a table lookup per token
        mx.eval(mx.where(index.masks(states[:1]), logits, -mx.inf))

    decode_ms = decode_step_ms(model)
    mask_ms, _ = median_ms(mask_step, 200)
    print(f"\nmask cost per token: {mask_ms:.3f} ms = {100 * mask_ms / decode_ms:.2f}% of a {decode_ms:.1f} ms step")


if __name__ == "__main__":
    main()
