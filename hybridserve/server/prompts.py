"""What the API's prompt forms become: token ids (never with a BOS re-added to given ids), checked against the
context length, computed off the event loop.

Tokenizing a long text or rendering a chat template can take seconds; on the event loop that would freeze every
stream and /health. So all of it runs on one worker thread (one, because the HTTP-side tokenizer is then never
used from two threads at once), and template code runs under a deadline: a template that loops for longer than
`TEMPLATE_TIME_LIMIT_S` is stopped with a 400. Tokenization itself is native code that cannot be interrupted; the
request-body limit bounds it.

The engine itself rejects empty prompts, out-of-vocabulary ids and prompts that fill the context; this module adds
the check it cannot make (prompt + max_tokens must fit, as vLLM requires).
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatMessage, PromptInput, Truncation
from hybridserve.tokenizer import render_chat

TEMPLATE_TIME_LIMIT_S = 5.0
_TEMPLATE_FILE = "<template>"  # the file name of jinja templates compiled from strings

T = TypeVar("T")


class TemplateTimeout(Exception):
    pass


def _deadline_tracer(deadline: float) -> Callable:
    """A sys.settrace function that raises TemplateTimeout inside template code once `deadline` has passed.

    Only frames of compiled templates get line events (every loop iteration of a template executes lines there),
    so tokenizers and Python libraries run at full speed."""
    def on_line(frame: FrameType, event: str, arg) -> Callable | None:
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return on_line

    def on_call(frame: FrameType, event: str, arg) -> Callable | None:
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    return on_call


def _with_deadline(fn: Callable[..., T], *args) -> T:
    sys.settrace(_deadline_tracer(time.monotonic() + TEMPLATE_TIME_LIMIT_S))
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


class PromptWorker:
    """The thread that tokenizes, detokenizes and renders chat templates for the HTTP side."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridserve-prompts")

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, _with_deadline, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def count_prompts(prompt: PromptInput) -> int:
    """How many prompts a completions `prompt` holds (known before tokenizing)."""
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)


def completion_prompts(tokenizer: PreTrainedTokenizerBase, prompt: PromptInput, add_special_tokens: bool,
                       truncation: Truncation | None = None) -> list[tuple[list[int], str | None]]:
    """(token ids, original text or None) per prompt of a completions request, each cut to `truncation`'s length
    (a cut prompt's text is None: echo then decodes what was kept)."""
    if isinstance(prompt, str):
        prompts = [(tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt)]
    elif not prompt:
        raise APIError("prompt is an empty list; give a string, token ids, or a list of either", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [(list(prompt), None)]
    elif isinstance(prompt[0], str):
        prompts = [(tokenizer.encode(text, add_special_tokens=add_special_tokens), text) for text in prompt]
    else:
        prompts = [(list(ids), None) for ids in prompt]
    return [_truncated(ids, text, truncation) for ids, text in prompts]


def _truncated(ids: list[int], text: str | None, truncation: Truncation | None) -> tuple[list[int], str | None]:
    """A prompt cut to `truncation`: the kept ids, and its text only if nothing was cut."""
    kept = ids if truncation is None else truncation.apply(ids)
    return kept, text if len(kept) == len(ids) else None


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], template_options: dict,
                add_special_tokens: bool, tools: list[dict] | None = None,
                truncation: Truncation | None = None) -> tuple[list[int], str]:
    """The prompt's token ids and its text (cut to `truncation`: the text of the kept ids, which the reasoning and
    tool checks read)."""
    rendered = [message.as_template_input() for message in messages]
    try:
        text = render_chat(tokenizer, rendered, template_options, tools)
    except TemplateTimeout:
        raise APIError(f"the chat template ran for more than {TEMPLATE_TIME_LIMIT_S:g} s on these messages and was "
                       "stopped", param="messages", code="template_timeout") from None
    except Exception as err:  # the template is code run on user input (jinja errors, raise_exception, bad kwargs)
        raise APIError(f"the chat template could not render these messages: {err}", param="messages") from None
    ids, kept_text = _truncated(tokenizer.encode(text, add_special_tokens=add_special_tokens), text, truncation)
    return ids, kept_text if kept_text is not None else tokenizer.decode(ids)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, max_tokens_param: str) -> None:
    """prompt + max_tokens must fit the context (a prompt that alone fills it is the engine's error)."""
    if max_tokens is not None and prompt_len < max_model_len < prompt_len + max_tokens:
        raise APIError(f"{max_tokens_param}={max_tokens} plus the prompt's {prompt_len} tokens exceeds this model's "
                       f"context length of {max_model_len} tokens; lower {max_tokens_param} to at most "
                       f"{max_model_len - prompt_len} or shorten the prompt", param=max_tokens_param)
