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
