"""The request's penalties, biases and logprobs as fields of the engine's ``sampling`` object.

Only fields that ask for something are sent (an engine that predates one refuses it by name rather
than a gateway sending defaults it cannot read). repetition_penalty and min_p default to the model's
generation_config, as temperature, top_p and top_k do.
"""

from __future__ import annotations

from services.gateway.generation import RequestError


def logprobs_asked(req) -> int | None:
    """How many alternatives per token the request wants logprobs for (None: no logprobs).
    Chat: ``logprobs: true`` + ``top_logprobs``; completions: ``logprobs: k``."""
    if hasattr(req, "messages"):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def extra_sampling(req, gen_cfg: dict, vocab_size: int) -> dict:
    out: dict = {}
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_tokens", 0)):
        if getattr(req, name) not in (None, neutral):
            out[name] = getattr(req, name)
    repetition = req.repetition_penalty if req.repetition_penalty is not None else gen_cfg.get("repetition_penalty")
    if repetition not in (None, 1, 1.0):
        out["repetition_penalty"] = float(repetition)
    min_p = req.min_p if req.min_p is not None else gen_cfg.get("min_p")
    if min_p:
        out["min_p"] = float(min_p)
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    k = logprobs_asked(req)
    if k is not None:
        out["logprobs"] = k
    return out


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[str, float]:
    for key, value in bias.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise RequestError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias[{key}] = {value} is outside [-100, 100]", "logit_bias")
    return {str(int(k)): float(v) for k, v in bias.items()}
