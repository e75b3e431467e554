"""Why the draft head gains little at temperature 1: ``python -m benchmarks.head_temperature``.

Teacher-forced on text the target samples itself at temperature 1 from held-out chat prompts,
this measures, at draft depth 1, the chance that the first draft token is accepted when it is
  - drawn from the head's q and accepted with min(1, p/q): sum_x min(p(x), q(x)),
  - the head's argmax proposed as a point mass (q = 1): p(argmax q),
  - drawn from q sharpened by a lower temperature.
Each is exact sampling under the loop's rule, so the larger one is the better draft. No timing:
the figures are expectations, free of machine noise.
"""

import argparse

import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402

from benchmarks.draft_head import heldout_prompts  # noqa: E402
from decoder import eos_ids_of, generate_step, sampling_probs  # noqa: E402
from loading import load_model  # noqa: E402
from speculative.head import FINAL, body_with_features, logits_from_hidden, output_weight  # noqa: E402
from speculative.head_loading import load_head  # noqa: E402


def depth1_distributions(target, head, vocab_ids, tokens: list, temp: float):
    """(p, q_logits) for every position whose next-but-one token the head predicts."""
    hidden, features = body_with_features(target, mx.array(tokens)[None], head.feature_layers, None)
    logits = logits_from_hidden(target, hidden)[0]
    # Position i reads (h_i, x_{i+1}) and predicts x_{i+2}, which the target scores at i + 1.
    embeddings = target.model.embed_tokens(mx.array(tokens[1:])[None])
    predicted = head(features[:, :-1], embeddings, cache=None)[0]
    q_logits = predicted @ mx.take(output_weight(target), vocab_ids, axis=0).T
    p = sampling_probs(logits[1:], temp)
    return p, q_logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--head", default=None)
    args = parser.parse_args()

    target, tokenizer, _ = load_model()
    head, vocab_ids = load_head(args.head, target)
    assert list(head.feature_layers) == [FINAL], "this study reads the last hidden state only"
    temp = 1.0
    mx.random.seed(0)
    sums = {"sample from q": 0.0, "argmax of q, point mass": 0.0}
    sharpened = (0.7, 0.5, 0.3)
    sums.update({f"sample from q at temperature {t}": 0.0 for t in sharpened})
    same_argmax, count = 0, 0
    for _, prompt in heldout_prompts(tokenizer)[: args.prompts]:
        answer = [t for t, _ in generate_step(prompt, target, temp=temp, max_tokens=args.max_tokens,
                                              eos_token_ids=eos_ids_of(tokenizer))]
        p, q_logits = depth1_distributions(target, head, vocab_ids, prompt + answer, temp)
        p = p[len(prompt) - 1 :]  # the answer's positions (the prompt's are not drafted)
        q_logits = q_logits[len(prompt) - 1 :]
        p_sub = mx.take(p, vocab_ids, axis=1)  # q is zero outside the sub-vocabulary
        q = mx.softmax(q_logits / temp, axis=-1)
        top = mx.argmax(q_logits, axis=-1)
        sums["sample from q"] += mx.minimum(p_sub, q).sum().item()
        sums["argmax of q, point mass"] += mx.take_along_axis(p_sub, top[:, None], axis=1).sum().item()
        for t in sharpened:
            sums[f"sample from q at temperature {t}"] += mx.minimum(p_sub, mx.softmax(q_logits / t, axis=-1)).sum().item()
        same_argmax += (mx.take(vocab_ids, top) == mx.argmax(p, axis=-1)).sum().item()
        count += p.shape[0]
    print(f"{count} answer positions from {args.prompts} held-out chat prompts, sampled at temperature {temp}\n")
    print("| first draft token | expected acceptance at temperature 1 |")
    print("|---|---:|")
    for name, total in sums.items():
        print(f"| {name} | {total / count:.3f} |")
    print(f"\nhead argmax = target argmax on {same_argmax / count:.1%} of these positions (greedy acceptance)")


if __name__ == "__main__":
    main()
