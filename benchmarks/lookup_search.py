"""Cost of one prompt-lookup search: ``python -m benchmarks.lookup_search``.

Median time of ``find_draft`` on a list, and of a source step (one new token, then
``propose``) as in generation, on random tokens.
"""

import random
import statistics
import time

import fast_blas

fast_blas.load()

from prompt_lookup import PromptLookupSource, find_draft  # noqa: E402


def median_ms(call, num_calls: int) -> float:
    times = []
    for _ in range(num_calls):
        tic = time.perf_counter()
        call()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def main(lengths=(4_000, 32_000), vocab_size=49152, num_calls=200):
    random.seed(0)
    for length in lengths:
        prompt = [random.randrange(vocab_size) for _ in range(length)]
        pure = median_ms(lambda: find_draft(prompt), num_calls)
        tokens = list(prompt)
        source = PromptLookupSource(adaptive=False)
        source.propose(tokens, 8)  # the prompt goes in once, as in generation

        def step():
            tokens.append(random.randrange(vocab_size))
            source.propose(tokens, 8)

        print(f"{length:>6} tokens  find_draft {pure:.2f} ms  source step {median_ms(step, num_calls):.2f} ms")


if __name__ == "__main__":
    main()
