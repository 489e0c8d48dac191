"""The constraint compiler and matcher (text/constraint.py) over the packaged model's tokenizer, and the mask."""

import json

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.decoding.sampler import GREEDY, SamplingParams, choose, mask_logits
from inference_engine.errors import FeatureUnavailable, InvalidConstraint, InvariantViolation
from inference_engine.text.codec import TextCodec
from inference_engine.text.constraint import Constraint, ConstraintCompiler, ConstraintRun

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def codec(real_model) -> TextCodec:
    return TextCodec(real_model.tokenizer)


@pytest.fixture(scope="module")
def compiler(real_model, codec) -> ConstraintCompiler:
    return ConstraintCompiler(codec, real_model.spec.vocab_size, real_model.spec.eos_token_ids)


def test_the_mask_allows_exactly_what_the_constraint_does(compiler, codec):
    m = compiler.matcher(Constraint("regex", "(yes|no)"))
    allowed = m.allowed()
    assert allowed.shape == (compiler.vocab_size,) and allowed.dtype == bool
    texts = {codec.decode([int(t)]) for t in np.flatnonzero(allowed)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    yes = codec.encode("yes")
    assert m.valid_prefix(yes + codec.encode(" maybe")) == len(yes)
    for t in yes:
        m.consume(t)
    assert m.is_complete  # nothing may follow (EOS at most)
    m.rollback(len(yes))
    assert not m.is_complete and np.array_equal(m.allowed(), allowed)
    with pytest.raises(InvariantViolation, match="left its constraint"):
        m.consume(codec.encode("maybe")[0])


def test_masked_draws_pick_only_allowed_tokens():
    logits = mx.array(np.arange(16, dtype=np.float32))  # the argmax is 15
    allowed = np.zeros(16, dtype=bool)
    allowed[[2, 5, 9]] = True
    assert choose(mask_logits(logits, allowed), GREEDY, 0) == 9
    sampled = SamplingParams(temperature=1.5, top_k=8, top_p=0.9, seed=3)
    assert {choose(mask_logits(logits, allowed), sampled, p) for p in range(64)} <= {2, 5, 9}
    assert mask_logits(logits, None) is logits


@pytest.mark.parametrize("constraint, words", [
    (Constraint("json_schema", "{not json"), "constraint.json_schema is not JSON"),
    (Constraint("json_schema", "3"), "must be a JSON object"),
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}'), "constraint.json_schema is invalid"),
    (Constraint("regex", "(a"), "constraint.regex is invalid"),
    (Constraint("grammar", "start: x\nx: y"), "constraint.grammar is invalid"),
])
def test_compile_errors_name_the_field(compiler, constraint, words):
    with pytest.raises(InvalidConstraint, match=words) as e:
        compiler.matcher(constraint)
    assert e.value.field == constraint.field


def test_a_run_continues_only_while_the_tokens_since_match(compiler, codec):
    c = Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                              "required": ["n"], "additionalProperties": False}))
    prompt = codec.encode("Some prompt:")
    run, m = compiler.resume(c, None, prompt)
    assert run == ConstraintRun(c, len(prompt))
    half = prompt + codec.encode('{"n":')
    assert compiler.resume(c, run, half)[0] is run  # continues: the tokens since match and are incomplete
    assert compiler.resume(Constraint("json_object", '{"type": "object"}'), run, half)[0].start == len(half)
    nope = prompt + codec.encode("nope")
    assert compiler.resume(c, run, nope)[0].start == len(nope)  # the tokens since do not match: afresh at the end
    done = prompt + codec.encode('{"n":1}')
    assert compiler.resume(c, run, done)[0].start == len(done)  # complete: the next output starts afresh
    assert compiler.resume(c, ConstraintRun(c, len(done) + 5), done)[0].start == len(done)  # cut back below its start


def test_no_tokenizer_is_feature_unavailable():
    with pytest.raises(FeatureUnavailable, match="constrained output needs one"):
        ConstraintCompiler(None, 256, [2]).matcher(Constraint("regex", "a"))


def test_prefetched_masks_are_the_masks_computed_on_demand(compiler, codec):
    """`prefetch` computes the masks after each token of a block ahead of need: along that block `allowed`
    answers from them (the same object each time) with the bits a fresh matcher computes; off it, afresh."""
    c = Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {
        "type": "string", "maxLength": 8}}, "required": ["n", "s"], "additionalProperties": False}))
    text = codec.encode('{"n":12,"s":"ab"}')
    m, fresh = compiler.matcher(c), lambda k: compiler.matcher(c, text[:k]).allowed()
    first = m.allowed()
    m.prefetch(text[:4])
    assert np.array_equal(m.allowed(), first)  # the matcher is where it was (nothing consumed)
    for k in range(1, 5):
        m.consume(text[k - 1])
        mask = m.allowed()
        assert mask is m.allowed() and not mask.flags.writeable  # from the prefetch
        assert np.array_equal(mask, fresh(k)), k
    m.rollback(2)  # back along the block: its masks still answer
    assert m.allowed() is m.allowed() and np.array_equal(m.allowed(), fresh(2))
    m.consume(text[2])
    assert np.array_equal(m.allowed(), fresh(3))
    m.rollback(3)  # before the block: afresh
    assert m.allowed() is not m.allowed() and np.array_equal(m.allowed(), first)
    k = next(k for k in range(len(text)) if fresh(k).sum() > 1)  # a choice: the block's token or another
    for t in text[:k]:
        m.consume(t)
    m.prefetch(text[k:k + 2])
    choices = np.flatnonzero(fresh(k))
    other = int(choices[choices != text[k]][0])
    m.consume(other)  # leaves the block: afresh from here on, even back on it
    assert m.allowed() is not m.allowed() and np.array_equal(m.allowed(), compiler.matcher(c, [*text[:k], other]).allowed())
    m.rollback(1)
    assert m.allowed() is not m.allowed() and np.array_equal(m.allowed(), fresh(k))
    m.consume(text[k])
    assert m.allowed() is not m.allowed() and np.array_equal(m.allowed(), fresh(k + 1))
    m.prefetch(here=True)  # the mask here, ahead of need
    assert m.allowed() is m.allowed() and np.array_equal(m.allowed(), fresh(k + 1))
    m.consume(text[k + 1])
    assert m.allowed() is not m.allowed() and np.array_equal(m.allowed(), fresh(k + 2))


def test_a_prefetch_stops_before_a_refused_token_and_at_a_completed_output(compiler, codec):
    m = compiler.matcher(Constraint("regex", "(yes|no)"))
    yes, maybe = codec.encode("yes"), codec.encode("maybe")
    m.prefetch(maybe)  # refused at once: nothing prefetched, nothing consumed
    assert not m.is_complete and m.valid_prefix(yes) == len(yes)
    m.prefetch(yes)  # the last token completes the output: no mask after it
    for t in yes[:-1]:
        m.consume(t)
        assert m.allowed() is m.allowed()
    m.consume(yes[-1])
    assert m.is_complete
    m.prefetch(here=True)  # complete: no mask here either
    assert m.is_complete
    m.rollback(len(yes))
    assert not m.is_complete and m.valid_prefix(yes) == len(yes)


def test_a_failed_prefetch_leaves_the_matcher_where_it_began(compiler, codec, monkeypatch):
    """A mask that fails mid-prefetch (after tokens were consumed) propagates, and the matcher is back where it
    began: the next mask is the one computed before the prefetch."""
    m = compiler.matcher(Constraint("regex", "(yes|no), thank you"))
    yes, first = codec.encode("yes, thank you"), m.allowed()
    calls = []

    def failing() -> np.ndarray:
        calls.append(1)
        raise RuntimeError("mask failed")

    monkeypatch.setattr(m, "_compute", failing)
    with pytest.raises(RuntimeError, match="mask failed"):
        m.prefetch(yes)
    monkeypatch.undo()
    assert calls and np.array_equal(m.allowed(), first) and m.valid_prefix(yes) == len(yes)
