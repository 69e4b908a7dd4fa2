"""A validated request body -> the engine's Request: prompt ids, token limits, sampling, stops.
Fields OpenAI defines that this build cannot honour yet are refused by name, never ignored."""

from __future__ import annotations

import json
from dataclasses import fields, replace

from ..engine import Request, SamplingConfig
from ..errors import MlxkvError, first_line
from . import tools
from .errors import APIError, bad_request
from .protocol import ChatRequest
from .served import Served

_ENGINE_FIELDS = {f.name for f in fields(SamplingConfig)}
# request field -> (its neutral value, the SamplingConfig field that honours it)
_OPTIONAL_SAMPLING = {
    "top_k": (0, "top_k"),
    "repetition_penalty": (1.0, "repetition_penalty"),
    "presence_penalty": (0.0, "presence_penalty"),
    "frequency_penalty": (0.0, "frequency_penalty"),
    "logit_bias": ({}, "logit_bias"),
}
_FLAG_FIELDS = {"--temp": "temperature", "--top-p": "top_p", "--min-p": "min_p", "--seed": "seed",
                "--top-k": "top_k", "--repetition-penalty": "repetition_penalty", "--logprobs": "logprobs",
                "--presence-penalty": "presence_penalty", "--frequency-penalty": "frequency_penalty",
                "--logit-bias": "logit_bias"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(body, served: Served) -> None:
    """The base model's id or a served adapter's name (--lora-modules), else a 404."""
    if body.model not in served.models:
        serves = ", ".join(f"'{m}'" for m in served.models)
        raise APIError(404, f"The model '{body.model}' does not exist (this server serves {serves})",
                       "model", "model_not_found")


def unsupported(body) -> None:
    """400 for fields set to something this server does not do (yet)."""
    def refuse(field: str, what: str):
        raise bad_request(f"'{field}': {what} is not supported by this server yet", field, "unsupported_parameter")

    wants_logprobs = (body.logprobs or body.top_logprobs) if isinstance(body, ChatRequest) else body.logprobs
    if wants_logprobs and "logprobs" not in _ENGINE_FIELDS:
        refuse("logprobs", "logprobs")
    if wants_logprobs and body.stream:
        refuse("logprobs", "logprobs while streaming")
    if isinstance(body, ChatRequest):
        if body.top_logprobs and not body.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if body.response_format is not None and body.response_format.get("type") not in ("text", None) \
                and "constraint" not in _ENGINE_FIELDS:
            refuse("response_format", "a response format other than text")
        tools.check_choice(body)
        if tools.forced(body) and "constraint" not in _ENGINE_FIELDS:
            refuse("tool_choice", "forcing a tool call")
    else:
        if body.echo:
            refuse("echo", "echoing the prompt")
        if body.suffix:
            refuse("suffix", "a suffix (insertion)")
        if body.best_of not in (None, 1):
            refuse("best_of", "best_of")
    for name, (neutral, field) in _OPTIONAL_SAMPLING.items():
        value = getattr(body, name)
        if value is not None and value != neutral and field not in _ENGINE_FIELDS:
            refuse(name, name.replace("_", " "))


def logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}; ids outside the vocabulary are a 400."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise bad_request(f"'logit_bias' keys must be token ids in 0..{vocab - 1}, got {key[:40]!r}",
                              "logit_bias", "invalid_value")
        out[int(key)] = value
    return out


def sampling(body, vocab: int) -> SamplingConfig:
    kw = {"temp": 1.0 if body.temperature is None else body.temperature,
          "top_p": 1.0 if body.top_p is None else body.top_p,
          "min_p": body.min_p or 0.0, "seed": body.seed}
    for name, (neutral, field) in _OPTIONAL_SAMPLING.items():
        value = getattr(body, name)
        if value is not None and field in _ENGINE_FIELDS:
            kw[field] = logit_bias(value, vocab) if name == "logit_bias" else value
    if isinstance(body, ChatRequest):
        if body.logprobs:
            kw["logprobs"] = body.top_logprobs or 0
        must_call = tools.forced(body)
        constraint = tools.constraint(must_call) if must_call else response_constraint(body.response_format)
        if constraint is not None:
            kw["constraint"] = constraint
    elif body.logprobs is not None:
        kw["logprobs"] = body.logprobs
    try:
        return SamplingConfig(**kw)
    except (MlxkvError, ValueError, TypeError) as e:  # SamplingConfig names its fields as the CLI's flags
        msg = str(e)
        param = next((p for flag, p in _FLAG_FIELDS.items() if msg.startswith(flag + " ")), None)
        for flag, p in _FLAG_FIELDS.items():
            msg = msg.replace(flag, p)
        raise bad_request(msg, param, "invalid_value") from None


def response_constraint(fmt: dict | None):
    """response_format -> the engine's ConstraintSpec (json_schema: that schema; json_object: an object)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    from ..engine.constrain import ConstraintSpec

    if kind == "json_object":
        return ConstraintSpec("json_schema", '{"type": "object"}')
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                          "response_format.type")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema (an object)",
                          "response_format.json_schema.schema")
    try:
        return ConstraintSpec("json_schema", json.dumps(schema))
    except MlxkvError as e:
        raise bad_request(str(e).replace("--json-schema", "response_format.json_schema.schema"),
                          "response_format.json_schema.schema") from None


def refused(request: Request, e: MlxkvError) -> APIError:
    """The engine's refusal of a request (a constraint llguidance does not compile) as a 400 naming
    the field it came from: serve's only grammars are forced tool calls, its schemas response_format's."""
    msg = first_line(e, limit=None)
    spec = request.sampling.constraint if request.sampling is not None else None
    if spec is not None and " does not compile: " in msg:
        if spec.kind == "grammar":
            return tools.compile_error(msg)
        field = "response_format.json_schema.schema"
        return bad_request(msg.replace("--json-schema", f"'{field}'"), field, "invalid_value")
    return APIError(400, msg, code="invalid_request")


def max_tokens(body, prompt_len: int, served: Served, default: int) -> int:
    """The completion's token limit: asked (checked against the context) or the default (clamped to it)."""
    param = "messages" if isinstance(body, ChatRequest) else "prompt"
    asked = body.max_completion_tokens if isinstance(body, ChatRequest) and body.max_completion_tokens is not None \
        else body.max_tokens
    ctx = served.context
    if prompt_len == 0:
        raise bad_request(f"'{param}' is empty after tokenization", param)
    if ctx and prompt_len >= ctx:
        raise bad_request(f"This model's maximum context length is {ctx} tokens; the {param} have {prompt_len} "
                          f"tokens", param, "context_length_exceeded")
    if asked is None:
        return min(default, ctx - prompt_len) if ctx else default
    if ctx and prompt_len + asked > ctx:
        raise bad_request(f"This model's maximum context length is {ctx} tokens; you requested {prompt_len + asked} "
                          f"tokens ({prompt_len} in the {param}, {asked} for the completion)", param,
                          "context_length_exceeded")
    return asked


def engine_requests(body, rid: str, ids: list[int], served: Served) -> list[Request]:
    """One row per choice (`n`); with a seed, choice i draws from seed + i."""
    unsupported(body)
    default = served.config.max_tokens if isinstance(body, ChatRequest) else COMPLETION_DEFAULT_MAX_TOKENS
    limit = max_tokens(body, len(ids), served, default)
    cfg = sampling(body, served.vocab)
    adapter = served.adapters.get(body.model)  # None: the base model
    rows = []
    for i in range(body.n or 1):
        row = cfg if cfg.seed is None or i == 0 else replace(cfg, seed=(cfg.seed + i) % 2**63)
        # the engine's own (greedy) settings: None keeps the row on the batch's shared sampler
        rows.append(Request(tuple(ids), limit, f"{rid}-{i}", body.stops(), sampling=None if row == SamplingConfig() else row,
                            adapter=adapter))
    return rows
