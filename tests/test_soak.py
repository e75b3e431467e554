"""Valid requests never fail (#59): a randomized soak of the server (tests/soak.py, bounded here;
``python -m benchmarks.soak`` runs it longer), and the same at the library level, a property test
of ``BatchGenerator`` over random per-row settings with rows joining and leaving."""

import logging

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from constrained import ForcedTextSource, RegexConstraint
from decoder import DraftSource, Sampling, generate_step, make_logits_processors
from decoder.hidden_states import output_rows
from draft_head import HeadDrafter
from draft_head.head import DraftHead, head_args
from draft_model import DraftModel
from prompt_lookup import PromptLookupSource
from tests import soak
from tests.helpers import tiny_byte_tokenizer, tiny_llama
from tests.test_batch import assert_same_or_near_tie, run


@pytest.mark.parametrize("server", list(soak.SERVERS))
def test_random_valid_requests_are_all_served(server, tmp_path, caplog):
    """Two rounds of concurrent random requests (the first one also warms the caches, so the
    second's RSS growth is what a leak would show)."""
    caplog.set_level(logging.WARNING, logger="server")
    report = soak.soak(server, tmp_path, requests=36, seed=59, rounds=2)
    assert report["problems"] == [], "\n".join(report["problems"])
    assert report["health"] == 200 and report["left_open"] == {}
    assert report["rss_growth_mib"] < 48, report
    refused = report["statuses"].get(400, 0)
    assert refused + report["statuses"][200] == 2 * 36
    # every refusal is in the log, one line each; no 5xx
    logged = [r for r in caplog.records if r.name == "server"]
    assert len(logged) == refused and all(r.levelno == logging.WARNING for r in logged)


def test_a_failed_request_is_logged_with_its_id_api_and_traceback_once(tmp_path, caplog):
    """A 500 with nothing in the log is a defect: a planted fault in a draft source fails every
    request, and each leaves one line naming it; the traceback comes once per kind of error."""
    caplog.set_level(logging.WARNING, logger="server")
    engine, _ = soak.build_engine("lookup", tmp_path)

    class Faulty(DraftSource):
        def propose(self, tokens, max_draft, max_nodes=None):
            raise RuntimeError("planted fault")

    engine.make_sources = lambda: [Faulty()]
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "ab"}]},
        "/v1/completions": {"prompt": "ab"},
        "/v1/messages": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 4},
        "/v1/responses": {"input": "ab"},
    }
    with soak.serving(engine) as base, soak.httpx.Client(timeout=60) as client:
        ids = {}
        for path, body in bodies.items():
            answer = client.post(base + path, json={"model": "tiny", **body})
            assert answer.status_code == 500 and "planted fault" in answer.text
        for path in bodies:
            lines = [
                r.getMessage() for r in caplog.records if f" to {path} failed" in r.getMessage()
            ]
            assert (
                len(lines) == 1 and "500 generation failed: RuntimeError: planted fault" in lines[0]
            )
            ids[path] = lines[0].split()[1]
        assert ids["/v1/chat/completions"].startswith("chatcmpl-")
        assert ids["/v1/completions"].startswith("cmpl-")
        assert ids["/v1/messages"].startswith("msg_") and ids["/v1/responses"].startswith("resp_")
        text = caplog.text
        assert text.count("Traceback") == 1 and "raise RuntimeError" in text
        assert client.get(base + "/health").status_code == 200


@pytest.fixture(scope="module")
def drafting():
    """A tiny target (on a head's tap) with a byte-level tokenizer, a draft model and a head."""
    tokenizer = tiny_byte_tokenizer()
    vocab = len(tokenizer)
    target = tiny_llama(vocab_size=vocab, num_layers=2, hidden_size=32, seed=3, sharp=3.0)
    mx.random.seed(7)
    vocab_ids = mx.arange(0, vocab)
    head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
    mx.eval(head.parameters())
    tap, head_drafter = HeadDrafter.around(target, head, vocab_ids)
    draft = tiny_llama(vocab_size=vocab, num_layers=1, hidden_size=32, seed=3, sharp=3.0)
    return (
        target,
        tap,
        tokenizer,
        head_drafter,
        DraftModel.create(draft, tokenizer, target, tokenizer),
    )


def row_sources(kind: str, drafting, constraint) -> list:
    _, _, tokenizer, head, draft_model = drafting
    forced = [ForcedTextSource(constraint)] if constraint is not None else []
    return (
        forced
        + {
            "none": [],
            "lookup": [PromptLookupSource()],
            "head": [head.source()],
            "draft_model": [draft_model.source()],
            "lookup+head": [PromptLookupSource(), head.source()],
        }[kind]
    )


ROW = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(40, 46), min_size=1, max_size=32),
        "max_tokens": st.integers(1, 16),
        "join": st.integers(0, 4),
        "sources": st.sampled_from(["none", "lookup", "head", "draft_model", "lookup+head"]),
        "temp": st.sampled_from([0.0, 0.0, 0.8, 1.0]),
        "top_k": st.sampled_from([0, 0, 3]),
        "min_p": st.sampled_from([0.0, 0.0, 0.1]),
        "xtc": st.booleans(),
        "penalty": st.sampled_from([None, "repetition", "presence", "bias"]),
        "regex": st.sampled_from([None, None, r"[a-c]{1,6}", r"(yes|no) [0-9]+"]),
        "seed": st.integers(0, 1000),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(ROW, min_size=1, max_size=6),
    tree_nodes=st.sampled_from([0, "auto", 3]),
    max_width=st.sampled_from([None, None, 1, 2, 3]),
    remove=st.dictionaries(st.integers(0, 5), st.integers(1, 6), max_size=2),
)
def test_random_rows_never_fail_and_greedy_rows_decode_as_alone(
    drafting, rows, tree_nodes, max_width, remove
):
    """``max_width`` cuts drafts (trees too) to what a narrow pass verifies, down to nothing."""
    target, tap, tokenizer, *_ = drafting
    specs, alone_specs = [], []
    for row in rows:
        processors = {
            None: {},
            "repetition": {"repetition_penalty": 1.3},
            "presence": {"presence_penalty": 0.8},
            "bias": {"logit_bias": {row["prompt"][0]: 3.0}},
        }[row["penalty"]]

        def constraint():
            if row["regex"] is None:
                return None
            return RegexConstraint.from_regex(row["regex"], tokenizer, vocab_size=len(tokenizer))

        sampling = Sampling(
            temp=row["temp"],
            top_k=row["top_k"],
            min_p=row["min_p"],
            xtc_probability=0.5 if row["xtc"] else 0.0,
        )
        options = dict(max_tokens=row["max_tokens"], sampling=sampling, seed=row["seed"])
        made = constraint()
        specs.append(
            dict(
                prompt=row["prompt"],
                join=row["join"],
                draft_sources=row_sources(row["sources"], drafting, made),
                constraint=[made],
                logits_processors=[make_logits_processors(**processors)],
                **options,
            )
        )
        alone_specs.append((constraint, processors, options))
    generator = BatchGenerator(tap, eos_token_ids=(), tree_nodes=tree_nodes, max_width=max_width)
    out, finish, errors, _ = run(
        generator, specs, {i: at for i, at in remove.items() if i < len(rows)}
    )
    assert errors == [None] * len(rows), errors
    for index, (row, (constraint, processors, options)) in enumerate(zip(rows, alone_specs)):
        if row["temp"] == 0 and finish[index] != "removed":
            want = [
                token
                for token, _ in generate_step(
                    row["prompt"],
                    target,
                    eos_token_ids=(),
                    constraint=constraint(),
                    logits_processors=make_logits_processors(**processors),
                    **options,
                )
            ]
            assert_same_or_near_tie(target, row["prompt"], out[index], want)
