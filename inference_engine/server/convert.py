"""Protobuf <-> the runtime's dataclasses for the text, sampling and model-info fields.

Each function validates what it converts against the one bounds table (validation.py), so
nothing below the servicer sees a protobuf or an unchecked value.
"""

from __future__ import annotations

import secrets
from typing import Sequence

from inference_engine.config import ServerConfig
from inference_engine.decoding.call_output import Usage
from inference_engine.decoding.logprobs import TokenLogprobs
from inference_engine.decoding.options import GenerationOptions
from inference_engine.decoding.sampler import SamplingParams
from inference_engine.errors import InvalidRequest
from inference_engine.runtime.types import DEFAULT_DRAFT_TOKENS, AppendParams, DecodeMode, GenerateChunk, GenerateParams
from inference_engine.server.model_info import ModelInfo
from inference_engine.server.validation import Validator
from inference_engine.text.chat import ChatInput, TextInput
from inference_engine.text.codec import ChatMessage
from inference_engine.text.constraint import ANY_JSON_OBJECT, Constraint
from inference_engine.v1 import runtime_pb2 as pb


def chat_messages(v: Validator, field: str, messages: Sequence[pb.ChatMessage]) -> tuple[ChatMessage, ...]:
    """Validated chat messages (count, role lengths, and their contents' characters together)."""
    v.length(field, len(messages))
    for m in messages:
        v.length("ChatMessage.role", len(m.role), "characters")
    read = tuple(ChatMessage(m.role, m.content) for m in messages)  # each content read once (see append_params)
    v.length(f"{field}.content", sum(len(m.content) for m in read), "characters of content together")
    return read


def append_params(v: Validator, r: pb.AppendTokensRequest) -> AppendParams:
    """AppendTokensRequest -> AppendParams (exactly one of tokens, text, messages).

    Raises:
        InvalidRequest: none or several inputs; a bound is broken.
    """
    sid = v.session_id(r.session_id)
    expected = r.expected_history_length if r.HasField("expected_history_length") else None
    text = r.text  # read once: each read decodes the whole field anew (~0.4 ms of the GIL for 64 Ki CJK characters)
    given = v.one_of("AppendTokensRequest", {"tokens": len(r.tokens) > 0, "text": text != "",
                                             "messages": len(r.messages) > 0})
    if r.add_generation_prompt and given != "messages":
        raise InvalidRequest("AppendTokensRequest.add_generation_prompt applies to messages only", "add_generation_prompt")
    if given == "tokens":
        return AppendParams(sid, v.items("AppendTokensRequest.tokens", list(r.tokens)), expected_history_length=expected)
    if given == "text":
        v.length("AppendTokensRequest.text", len(text), "characters")
        return AppendParams(sid, (), TextInput(text), expected_history_length=expected)
    messages = chat_messages(v, "AppendTokensRequest.messages", r.messages)
    return AppendParams(sid, (), ChatInput(messages, r.add_generation_prompt), expected_history_length=expected)


def generate_params(v: Validator, cfg: ServerConfig, r: pb.GenerateRequest) -> GenerateParams:
    """GenerateRequest -> GenerateParams; every 0 replaced by its meaning.

    Raises:
        InvalidRequest: a bound is broken.
    """
    sampling = SamplingParams(
        temperature=v.real("GenerateRequest.temperature", r.temperature),
        top_k=v.value("GenerateRequest.top_k", r.top_k),
        top_p=v.real("GenerateRequest.top_p", r.top_p),
        min_p=v.real("GenerateRequest.min_p", r.min_p),
        repetition_penalty=v.real("GenerateRequest.repetition_penalty", r.repetition_penalty),
        seed=r.seed if r.HasField("seed") else secrets.randbits(64),
    )
    if r.top_logprobs and not r.logprobs:
        raise InvalidRequest("GenerateRequest.top_logprobs needs logprobs = true", "top_logprobs")
    options = GenerationOptions(
        constraint=constraint(v, r),
        sampling=sampling,
        stop=v.strings("GenerateRequest.stop", list(r.stop)),
        eos_token_ids=v.items("GenerateRequest.eos_token_ids", list(r.eos_token_ids)),
        logprobs=r.logprobs,
        top_logprobs=v.value("GenerateRequest.top_logprobs", r.top_logprobs),
    )
    return GenerateParams(
        session_id=v.session_id(r.session_id),
        max_new_tokens=v.value("GenerateRequest.max_new_tokens", r.max_new_tokens) or cfg.default_new_tokens,
        ignore_eos=r.ignore_eos,
        mode=DecodeMode(v.value("GenerateRequest.mode", r.mode)),
        num_draft_tokens=v.value("GenerateRequest.num_draft_tokens", r.num_draft_tokens) or DEFAULT_DRAFT_TOKENS,
        options=options,
    )


def constraint(v: Validator, r: pb.GenerateRequest) -> Constraint | None:
    """GenerateRequest.constraint -> Constraint (None when unset); compiled later, against the tokenizer.

    Raises:
        InvalidRequest: json_object false, or a source longer than the bound.
    """
    if not r.HasField("constraint"):
        return None
    kind = r.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("GenerateRequest.constraint needs one of json_schema, json_object, regex, grammar; "
                             "got none (leave constraint unset for free text)", "constraint")
    if kind == "json_object":
        if not r.constraint.json_object:
            raise InvalidRequest("GenerateRequest.constraint.json_object must be true when set", "constraint.json_object")
        return Constraint("json_object", ANY_JSON_OBJECT)
    source = getattr(r.constraint, kind)
    v.length(f"GenerateRequest.constraint.{kind}", len(source), "characters")
    return Constraint(kind, source)


def _logprobs(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token=lp.token, logprob=lp.logprob,
                           top=[pb.TopLogprob(token=t, logprob=x) for t, x in lp.top])


def _usage(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, generated_tokens=u.generated_tokens,
                    time_to_first_token_ms=u.time_to_first_token_ms, total_time_ms=u.total_time_ms,
                    tokens_per_second=u.tokens_per_second)


def generate_response(chunk: GenerateChunk) -> pb.GenerateResponse:
    """One streamed GenerateChunk as its GenerateResponse."""
    msg = pb.GenerateResponse(
        tokens=chunk.tokens,
        stop_reason=chunk.stop_reason.value if chunk.stop_reason else pb.STOP_REASON_UNSPECIFIED,
        history_length=chunk.history_length,
        drafted_tokens=chunk.drafted,
        accepted_tokens=chunk.accepted,
        text=chunk.text,
        logprobs=[_logprobs(lp) for lp in chunk.logprobs],
        seed=chunk.seed,
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(_usage(chunk.usage))
    return msg


def tokenize_input(v: Validator, r: pb.TokenizeRequest) -> TextInput | ChatInput:
    """TokenizeRequest -> the text or the conversation to tokenize.

    Raises:
        InvalidRequest: both text and messages; a flag that does not apply; a bound is broken.
    """
    text = r.text  # read once (see append_params)
    if text and r.messages:
        raise InvalidRequest("TokenizeRequest needs exactly one of text, messages; got text and messages", "text,messages")
    if r.messages:
        if r.add_special_tokens:
            raise InvalidRequest("TokenizeRequest.add_special_tokens applies to text only (the template adds them)",
                                 "add_special_tokens")
        return ChatInput(chat_messages(v, "TokenizeRequest.messages", r.messages), r.add_generation_prompt)
    if r.add_generation_prompt:
        raise InvalidRequest("TokenizeRequest.add_generation_prompt applies to messages only", "add_generation_prompt")
    v.length("TokenizeRequest.text", len(text), "characters")
    return TextInput(text)


def model_info_response(i: ModelInfo) -> pb.GetModelInfoResponse:
    """ModelInfo -> GetModelInfoResponse."""
    msg = pb.GetModelInfoResponse(
        model_name=i.model_name, vocab_size=i.vocab_size, eos_token_ids=i.eos_token_ids,
        has_tokenizer=i.has_tokenizer, has_chat_template=i.has_chat_template, exact=i.is_exact,
        block_size=i.block_size, kernels=i.kernels, model_fingerprint=i.model_fingerprint,
        has_draft_model=i.has_draft_model, family=i.family, weight_formats=i.weight_formats,
        layer_attention=i.layer_attention,
        limits=pb.ModelLimits(
            default_sink_tokens=i.default_sink, max_sink_tokens=i.max_sink, default_window_tokens=i.default_window,
            max_window_tokens=i.max_window, default_new_tokens=i.default_new_tokens, max_new_tokens=i.max_new_tokens,
            max_tokens_per_request=i.max_tokens_per_request, max_draft_tokens=i.max_draft_tokens,
            max_top_logprobs=i.max_top_logprobs, max_sessions=i.max_sessions,
        ),
    )
    if i.bos_token_id is not None:
        msg.bos_token_id = i.bos_token_id
    return msg
