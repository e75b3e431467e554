"""Published EAGLE heads (draft_head/eagle.py): draft logits equal the PyTorch reference
(tests/eagle_reference.py) on random weights; heads written in the published file layout run
through the library and main.py, lossless and accepted; heads that do not fit are refused."""

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from decoder import DecodingStats, generate_step  # noqa: E402
from decoder.hidden_states import HeadMismatch, body_with_features  # noqa: E402
from draft_head.eagle import Eagle1Head, Eagle3Head, eagle3_feature_layers  # noqa: E402
from draft_head.loading import load_head  # noqa: E402
from draft_head.source import HeadDrafter  # noqa: E402
from tests.eagle_reference import Eagle1Reference, Eagle3Reference, eagle3_layer_inputs  # noqa: E402
from tests.helpers import tiny_llama  # noqa: E402

VOCAB, WIDTH, LAYERS = 64, 32, 8


def head_config(target, draft_vocab_size=None, num_layers=1) -> dict:
    """A head config as SafeAILab publishes it (the head's own shape: here a narrower MLP and
    another RoPE base than the target's, so the head must read its own config)."""
    args = target.args
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "max_position_embeddings": 2048,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    return config


def to_torch(array: mx.array) -> torch.Tensor:
    return torch.tensor(np.array(array.astype(mx.float32)))


def reference_head(target, config: dict, seed: int, draft_ids=None):
    """A reference module with random weights (norms too), the target's embedding table and,
    for EAGLE-3, ``d2t`` mapping the draft vocabulary onto ``draft_ids``."""
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    llama_config = LlamaConfig(**{k: v for k, v in config.items() if k != "draft_vocab_size"})
    if draft_ids is not None:
        llama_config.draft_vocab_size = len(draft_ids)
        head = Eagle3Reference(llama_config)
        head.d2t.copy_(torch.tensor(draft_ids) - torch.arange(len(draft_ids)))
        head.t2d[torch.tensor(draft_ids)] = True
    else:
        head = Eagle1Reference(llama_config)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.2 * torch.randn_like(parameter))
        head.embed_tokens.weight.copy_(to_torch(target.model.embed_tokens.weight))
    return head.eval()


def write_head(path, config: dict, head, with_embeddings=False, pickled=False):
    """The published file layout: config.json and model.safetensors, or pytorch_model.bin as most
    EAGLE heads are published (no embedding table unless asked)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.contiguous()
        for k, v in head.state_dict().items()
        if with_embeddings or k != "embed_tokens.weight"
    }
    if pickled:
        torch.save(weights, path / "pytorch_model.bin")
    else:
        save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_target(target):
    """The tiny mlx-lm target as a transformers Llama (mlx-lm keeps Hugging Face's weight names)."""
    from mlx.utils import tree_flatten
    from transformers import LlamaConfig, LlamaForCausalLM

    args = target.args
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(
        {k: to_torch(v) for k, v in tree_flatten(target.parameters())}, strict=True
    )
    return model


def close(mine: mx.array, theirs: torch.Tensor, atol=2e-4):
    return np.allclose(np.array(mine), theirs.detach().numpy(), atol=atol, rtol=1e-4)


TARGET = tiny_llama(vocab_size=VOCAB, num_layers=LAYERS, hidden_size=WIDTH, seed=0)
TOKENS = [[5, 17, 3, 42, 8, 8, 61, 0, 33, 12, 7]]


@pytest.mark.parametrize(
    "with_embeddings,pickled",
    [(False, False), (True, False), (False, True)],
    ids=["safetensors", "with-embeddings", "pytorch_model.bin"],
)
def test_eagle3_draft_logits_match_the_reference(tmp_path, with_embeddings, pickled):
    draft_ids = sorted(np.random.default_rng(1).choice(VOCAB, 24, replace=False).tolist())
    config = head_config(TARGET, draft_vocab_size=len(draft_ids))
    reference = reference_head(TARGET, config, seed=2, draft_ids=draft_ids)
    head, vocab_ids = load_head(
        write_head(tmp_path, config, reference, with_embeddings, pickled), TARGET
    )
    assert isinstance(head, Eagle3Head) and vocab_ids.tolist() == draft_ids

    # The target features: the inputs of layers 2, L//2 and L-3, which the tap records as outputs.
    with torch.no_grad():
        layer_inputs = hf_target(TARGET)(
            torch.tensor(TOKENS), output_hidden_states=True
        ).hidden_states[:LAYERS]
        expected = eagle3_layer_inputs(list(layer_inputs))
    assert head.feature_layers == eagle3_feature_layers(LAYERS) == [1, 3, 4]
    _, features = body_with_features(TARGET, mx.array(TOKENS), head.feature_layers)
    assert close(features, expected)

    def next_token(my_logits, their_logits):
        index = int(their_logits[0, -1].argmax())
        assert mx.argmax(my_logits[0, -1]).item() == index
        token = int(reference.target_tokens(torch.tensor(index)))
        assert vocab_ids[index].item() == token  # d2t: draft index -> target token
        return token

    draft_steps_agree(
        reference, head, expected, features, reference.logits, head.logits, next_token
    )


def draft_steps_agree(reference, head, expected, features, their_scores, my_scores, next_token):
    """Reading the accepted text (h_t with x_{t+1}), then three draft steps on the heads' own
    outputs: the logits agree at every step (``next_token`` picks the token fed back)."""
    tokens, cache = mx.array(TOKENS), head.make_cache()
    with torch.no_grad():
        theirs, past = reference(expected[:, :-1], torch.tensor(TOKENS)[:, 1:])
    mine = head(features[:, :-1], TARGET.model.embed_tokens(tokens[:, 1:]), cache=cache)
    for step in range(4):
        their_logits, my_logits = their_scores(theirs), my_scores(mine)
        assert close(my_logits, their_logits), step
        token = next_token(my_logits, their_logits)
        with torch.no_grad():
            theirs, past = reference(theirs[:, -1:], torch.tensor([[token]]), past)
        mine = head(mine[:, -1:], TARGET.model.embed_tokens(mx.array([[token]])), cache=cache)


def test_eagle1_draft_logits_match_the_reference(tmp_path):
    config = head_config(TARGET, num_layers=2)  # the second layer has an input norm, the first not
    reference = reference_head(TARGET, config, seed=4)
    head, vocab_ids = load_head(write_head(tmp_path, config, reference), TARGET)
    assert isinstance(head, Eagle1Head) and vocab_ids.tolist() == list(range(VOCAB))
    oracle = hf_target(TARGET)
    with torch.no_grad():
        expected = oracle.model(torch.tensor(TOKENS)).last_hidden_state  # after the final norm
    _, features = body_with_features(TARGET, mx.array(TOKENS), head.feature_layers)
    assert close(features, expected)

    # EAGLE-1 scores with the target's own LM head.
    draft_steps_agree(
        reference,
        head,
        expected,
        features,
        oracle.lm_head,
        head.logits,
        lambda mine, theirs: int(theirs[0, -1].argmax()),
    )


def bigram_target(vocab_size, hidden_size=64, num_layers=LAYERS, seed=0):
    """A Llama whose blocks add nothing (zero output projections), so every layer's output is
    the token's embedding and the greedy next token is ``successor[x_t]``: row j of the LM head
    is the embedding of the token whose successor is j. Returns ``(target, successor)``."""
    target = tiny_llama(
        vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden_size, seed=seed, sharp=1.0
    )
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    successor = np.random.default_rng(seed).permutation(vocab_size)
    target.lm_head.weight = target.model.embed_tokens.weight[mx.array(np.argsort(successor))]
    mx.eval(target.parameters())
    greedy = mx.argmax(target(mx.arange(vocab_size)[:, None])[:, -1], axis=-1)
    assert greedy.tolist() == successor.tolist()  # embeddings are near-orthogonal at this width
    return target, successor


def good_heads(target, successor, tmp_path, draft_ids) -> tuple:
    """Published-layout heads that draft well for ``bigram_target``: the EAGLE-1 head passes the
    embedding of x_{t+1} to the target's LM head (every draft right); the EAGLE-3 head passes the
    low layer's output (the embedding of x_t) to rows that score successor(successor(x_t)), so
    its first draft token is right whenever it is in the draft vocabulary."""
    size, zero = target.args.hidden_size, torch.zeros
    eagle1 = reference_head(target, head_config(target), seed=5)
    eagle3 = reference_head(
        target, head_config(target, len(draft_ids)), seed=6, draft_ids=draft_ids
    )
    embeddings = to_torch(target.model.embed_tokens.weight)
    predecessor = np.argsort(successor)
    with torch.no_grad():
        for head, layer in ((eagle1, eagle1.layers[0]), (eagle3, eagle3.midlayer)):
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        eagle1.fc.weight.copy_(torch.cat([torch.eye(size), zero(size, size)], dim=1))
        eagle1.fc.bias.zero_()
        eagle3.fc.weight.copy_(torch.cat([torch.eye(size), zero(size, 2 * size)], dim=1))
        eagle3.norm.weight.fill_(1.0)
        eagle3.lm_head.weight.copy_(embeddings[torch.tensor(predecessor[predecessor[draft_ids]])])
    return (
        write_head(tmp_path / "eagle1", head_config(target), eagle1),
        write_head(
            tmp_path / "eagle3", head_config(target, len(draft_ids)), eagle3, with_embeddings=True
        ),
    )


def tokens_of(prompt, model, sources=(), **kwargs):
    return [
        t
        for t, _ in generate_step(
            prompt, model, draft_sources=list(sources), eos_token_ids=(), **kwargs
        )
    ]


@pytest.mark.parametrize("bits", [None, 4], ids=["float32", "4-bit"])
def test_published_heads_are_lossless_and_accepted_through_the_library(tmp_path, bits):
    import mlx.nn as nn

    target, successor = bigram_target(VOCAB, num_layers=LAYERS)
    draft_ids = sorted(np.random.default_rng(3).choice(VOCAB, 48, replace=False).tolist())
    eagle1_dir, eagle3_dir = good_heads(target, successor, tmp_path, draft_ids)
    if bits:  # as a Mac user runs them: heads trained on the float model, a quantized target
        nn.quantize(target, group_size=32, bits=bits)
    for head_dir in (eagle1_dir, eagle3_dir):
        stats = DecodingStats()
        for prompt in ([1, 2, 3], [40], [9, 9, 9, 9, 30]):
            tap, drafter = HeadDrafter.create(
                target, head_dir, num_draft=3, adaptive=bits is not None
            )
            source = drafter.source()
            assert tokens_of(prompt, tap, [source], max_tokens=24, stats=stats) == tokens_of(
                prompt, target, max_tokens=24
            )
        if head_dir == eagle1_dir:
            assert stats.draft_accepted == stats.draft_proposed > 0
        else:
            assert 0 < stats.draft_accepted < stats.draft_proposed


@pytest.mark.slow
def test_published_heads_from_the_command_line(tmp_path):
    from mlx.utils import tree_flatten

    from tests.helpers import tiny_byte_tokenizer
    from tests.test_cli import assert_one_line_error, cli

    tokenizer = tiny_byte_tokenizer()
    vocab = len(tokenizer.get_vocab())
    target, successor = bigram_target(vocab, num_layers=LAYERS)
    model_dir = tmp_path / "target"
    tokenizer.save_pretrained(str(model_dir))
    mx.save_safetensors(
        str(model_dir / "model.safetensors"), dict(tree_flatten(target.parameters()))
    )
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_") and v is not None}
    (model_dir / "config.json").write_text(json.dumps(config))
    draft_ids = sorted(np.random.default_rng(3).choice(vocab, vocab - 16, replace=False).tolist())
    args = ["--model", str(model_dir), "--prompt", "ab12-", "--max-tokens", "24", "--json"]
    plain = json.loads(cli(*args).stdout)
    for head_dir in good_heads(target, successor, tmp_path, draft_ids):
        result = cli(*args, "--draft-head", str(head_dir))
        assert result.returncode == 0, result.stderr
        fast = json.loads(result.stdout)
        assert fast["tokens"] == plain["tokens"] and fast["draft_accepted"] > 0
    (head_dir / "config.json").write_text("{draft_vocab_size")
    assert_one_line_error(
        cli(*args, "--draft-head", str(head_dir)), f"{head_dir / 'config.json'} is not valid JSON"
    )


def test_heads_that_do_not_fit_the_target_are_refused_in_one_line(tmp_path):
    draft_ids = list(range(0, VOCAB, 2))
    config = head_config(TARGET, draft_vocab_size=len(draft_ids))
    head_dir = write_head(
        tmp_path / "eagle3",
        config,
        reference_head(TARGET, config, seed=2, draft_ids=draft_ids),
        with_embeddings=True,
    )
    cases = [
        (
            tiny_llama(vocab_size=VOCAB, num_layers=LAYERS, hidden_size=64),
            "is 32 wide, the target 64",
        ),
        (
            tiny_llama(vocab_size=2 * VOCAB, num_layers=LAYERS, hidden_size=WIDTH),
            "a vocabulary of 64, the target 128",
        ),
        (
            tiny_llama(vocab_size=VOCAB, num_layers=5, hidden_size=WIDTH),
            "the target has only 5 layers",
        ),
        (
            tiny_llama(vocab_size=VOCAB, num_layers=LAYERS, hidden_size=WIDTH, seed=9),
            "trained for another model",
        ),
    ]
    for target, fragment in cases:
        with pytest.raises(HeadMismatch, match=fragment):
            load_head(head_dir, target)
    bad_map = dict(reference_head(TARGET, config, seed=2, draft_ids=draft_ids).state_dict())
    bad_map["d2t"] = bad_map["d2t"] + VOCAB
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in bad_map.items()}, str(head_dir / "model.safetensors"))
    with pytest.raises(HeadMismatch, match="d2t does not map 32 draft tokens"):
        load_head(head_dir, TARGET)
    weights = head_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(HeadMismatch, match=f"{weights} cannot be read"):
        load_head(head_dir, TARGET)
    weights.unlink()
    with pytest.raises(HeadMismatch, match="has neither model.safetensors nor pytorch_model.bin"):
        load_head(head_dir, TARGET)
    (head_dir / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(HeadMismatch, match="pytorch_model.bin cannot be read"):
        load_head(head_dir, TARGET)


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"intermediate_size": None}, "is not a complete Llama config"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"draft_vocab_size": "many"}, "draft_vocab_size must be a count of tokens"),
        (
            {"norm_before_residual": True},
            "norm_before_residual and eagle_aux_hidden_state_layer_ids are not supported",
        ),
        ({"num_key_value_heads": 4}, "does not match"),  # the weights have 2
    ],
)
def test_an_eagle3_config_that_does_not_match_is_one_line(tmp_path, change, fragment):
    draft_ids = list(range(0, VOCAB, 2))
    config = head_config(TARGET, draft_vocab_size=len(draft_ids))
    head_dir = write_head(
        tmp_path, config, reference_head(TARGET, config, seed=2, draft_ids=draft_ids)
    )
    config.update(change)
    (head_dir / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    with pytest.raises(HeadMismatch, match=fragment) as error:
        load_head(head_dir, TARGET)
    assert str(head_dir / "config.json") in str(error.value) and "\n" not in str(error.value)


def test_an_eagle3_head_is_refused_on_a_sharded_target(tmp_path):
    from distributed.sharding import ShardedBody

    draft_ids = list(range(VOCAB))
    config = head_config(TARGET, draft_vocab_size=VOCAB)  # no pruning: published without d2t/t2d
    state = reference_head(TARGET, config, seed=2, draft_ids=draft_ids).state_dict()
    head_dir = tmp_path / "eagle3"
    head_dir.mkdir()
    from safetensors.torch import save_file

    save_file(
        {
            k: v.contiguous()
            for k, v in state.items()
            if k not in ("d2t", "t2d", "embed_tokens.weight")
        },
        str(head_dir / "model.safetensors"),
    )
    (head_dir / "config.json").write_text(json.dumps(config))
    assert load_head(head_dir, TARGET)[1].tolist() == draft_ids
    sharded = tiny_llama(vocab_size=VOCAB, num_layers=LAYERS, hidden_size=WIDTH, seed=0)
    sharded.model = ShardedBody(sharded.model, group=None)
    with pytest.raises(HeadMismatch, match=r"reads layers \[1, 3, 4\].*sharded"):
        load_head(head_dir, sharded)


@pytest.mark.slow
def test_sampling_with_an_eagle3_head_keeps_the_target_distribution(tmp_path):
    from decoder.hidden_states import HiddenStateTap
    from tests.helpers import assert_sampling_keeps_the_target_distribution

    target = tiny_llama(vocab_size=8, num_layers=LAYERS, hidden_size=WIDTH, seed=3, sharp=2.0)
    draft_ids = [0, 2, 3, 5, 6, 7]  # q is zero on two tokens the target can still choose
    config = head_config(target, draft_vocab_size=len(draft_ids))
    head, vocab_ids = load_head(
        write_head(tmp_path, config, reference_head(target, config, 7, draft_ids)), target
    )

    def make_run():
        tap = HiddenStateTap(target, head.feature_layers)
        return tap, [HeadDrafter(tap, head, vocab_ids, num_draft=3, adaptive=False).source()]

    assert_sampling_keeps_the_target_distribution(target, make_run, 1.0, 1.0)
