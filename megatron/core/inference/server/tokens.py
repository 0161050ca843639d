"""POST /tokenize and /detokenize, in vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` or chat ``messages`` (then the ids are exactly the prompt a chat
completion with those messages and tools would see) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}``.
"""

from __future__ import annotations

from megatron.core.inference.prompts import tokenize_prompt
from megatron.core.inference.server import responses as R
from megatron.core.inference.server.chat import chat_prompt, offered_tools
from megatron.core.inference.server.errors import bad_request
from megatron.core.inference.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from megatron.core.inference.server.service import OpenAIService


def tokenize(service: OpenAIService, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    if body.model is not None:
        service.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        tools = offered_tools(body.tools)
        tokens = chat_prompt(service, body.messages, tools, body.add_generation_prompt, body.chat_template_kwargs)
    else:
        tokens = tokenize_prompt(service.tokenizer, body.prompt, add_bos=None if body.add_special_tokens else False)
    token_strs = [R.token_text(service.tokenizer, t) for t in tokens] if body.return_token_strs else None
    return {
        "count": len(tokens),
        "max_model_len": service.config.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }


def detokenize(service: OpenAIService, body: DetokenizeRequest) -> dict:
    if body.model is not None:
        service.check_model(body.model)
    vocab = service.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens holds ids {bad[:5]} outside 0..{vocab - 1}", param="tokens", code="invalid_value")
    return {"prompt": service.tokenizer.detokenize(body.tokens)}
