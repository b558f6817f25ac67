"""What the API's prompt forms become: token ids (never with a BOS re-added to given ids), checked against the
context length.

The engine itself rejects empty prompts, out-of-vocabulary ids and prompts that fill the context; this module adds
the check it cannot make (prompt + max_tokens must fit, as vLLM requires).
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatMessage, PromptInput, template_messages
from hybridserve.tokenizer import chat_prompt_ids


def completion_prompts(tokenizer: PreTrainedTokenizerBase, prompt: PromptInput) -> list[tuple[list[int], str | None]]:
    """(token ids, original text or None) per prompt of a completions request."""
    if isinstance(prompt, str):
        return [(tokenizer.encode(prompt), prompt)]
    if not prompt:
        raise APIError("prompt is an empty list; give a string, token ids, or a list of either", param="prompt")
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]
    if isinstance(prompt[0], str):
        return [(tokenizer.encode(text), text) for text in prompt]
    return [(list(ids), None) for ids in prompt]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage],
                chat_template_kwargs: dict | None) -> list[int]:
    rendered = template_messages(messages)
    try:
        return chat_prompt_ids(tokenizer, rendered, chat_template_kwargs)
    except Exception as err:  # the template is code run on user input (jinja errors, raise_exception, bad kwargs)
        raise APIError(f"the chat template could not render these messages: {err}", param="messages") from None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, max_tokens_param: str) -> None:
    """prompt + max_tokens must fit the context (a prompt that alone fills it is the engine's error)."""
    if max_tokens is not None and prompt_len < max_model_len < prompt_len + max_tokens:
        raise APIError(f"{max_tokens_param}={max_tokens} plus the prompt's {prompt_len} tokens exceeds this model's "
                       f"context length of {max_model_len} tokens; lower {max_tokens_param} to at most "
                       f"{max_model_len - prompt_len} or shorten the prompt", param=max_tokens_param)
