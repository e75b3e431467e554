"""Which target features should the draft head read? Short training runs, side by side.

    python -m benchmarks.draft_head_sweep                  # ~25 min on 2 cores, after `make draft-head`
    python -m benchmarks.draft_head_sweep --steps 600 --configs -1 "1 14 -1"

Every configuration trains on the same cached answers (those of `make draft-head`), with the same
seed, batches, sub-vocabulary and number of steps, at draft depth 1 only (training-time unrolling
triples a step's cost and does not change the ranking at depth 1), and reports the held-out
split's token accuracy at depth 1 and 2 (``train_head.evaluate``). The first run computes the
outputs of layers 1, 14 and 26 for every cached answer (one teacher-forced pass per batch, ~14
minutes) and caches them beside the answers.
"""

import sys

import numpy as np

from cli import CliError, Parser
from loading import cache_dir, load_model
from speculative.head import FINAL
from speculative.head_data import sub_vocabulary, training_data
from speculative.train_head import train

ALL_LAYERS = [1, 14, 26, FINAL]  # every configuration below reads a subset of these


def main():
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="Training steps per configuration (default: 300).")
    parser.add_argument("--head-layers", type=int, default=1, help="Decoder layers in each head (default: 1).")
    parser.add_argument("--configs", nargs="+", default=["-1", "1 14 26", "1 14 -1"],
                        help="Feature layers per configuration, each a quoted list "
                             "(default: -1, '1 14 26', '1 14 -1').")
    args = parser.parse_args()
    configs = [[int(layer) for layer in config.split() if layer.lstrip("-").isdigit()] for config in args.configs]
    if args.steps < 1 or args.head_layers < 1:
        parser.error("--steps and --head-layers must be at least 1")
    if any(not layers or len(layers) != len(config.split()) or set(layers) - set(ALL_LAYERS)
           for layers, config in zip(configs, args.configs)):
        parser.error(f"each of --configs is a list of layers among {' '.join(map(str, ALL_LAYERS))}")
    target, tokenizer, _ = load_model(None)
    try:  # `make draft-head`'s answers and settings; nothing new is generated (minutes=0)
        sequences, features, inputs, _ = training_data(target, tokenizer, cache_dir() / "draft-head-data",
                                                       ["self", "templates"], num_instructions=1000, seed=0,
                                                       max_tokens=128, batch_size=48, minutes=0.0,
                                                       feature_layers=ALL_LAYERS)
    except CliError as error:
        sys.exit(f"error: {error}; run `make draft-head` first")
    offsets = np.cumsum([0] + [len(s["tokens"]) for s in sequences])
    vocab_ids = sub_vocabulary(sequences, 8192, set(tokenizer.eos_token_ids), target.args.vocab_size)
    size = target.args.hidden_size
    rows = ["| features | held-out depth-1 accuracy | mean of depths 1-2 | minutes |", "|---|---:|---:|---:|"]
    for config, layers in zip(args.configs, configs):
        blocks = [ALL_LAYERS.index(layer) for layer in layers]
        # The last hidden state alone: as generated, as `make draft-head` trains on it.
        chosen = None if layers == [FINAL] else np.concatenate([inputs[:, b * size : (b + 1) * size] for b in blocks],
                                                               axis=1)
        _, report = train(target, sequences, features, offsets, vocab_ids, inputs=chosen, feature_layers=layers,
                          head_layers=args.head_layers, steps_limit=args.steps, minutes=10**6, unroll=1,
                          log=lambda *_: None)
        held_out = report["held_out"]
        rows.append(f"| layers {config}, {args.head_layers}-layer head | {held_out['depth<=1 mean accuracy']:.1%} | "
                    f"{held_out['depth<=2 mean accuracy']:.1%} | {report['minutes']:.1f} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
