"""A request's tools, tool_choice and parallel_tool_calls: what the chat template shows, which functions outputs
are parsed for, and the grammar that forces calls.

`auto` (the default with tools): the template lists the tools and outputs are parsed for calls of them. `none`:
neither (the template does not see the tools; past calls and tool results in the history still render).
`required` and a named function: the output is constrained, through structured output, to calls in the model's
format (one or more of any tool; exactly one of the named one), arguments valid for the tool's schema, so even a
model with random weights returns well-formed calls. With a reasoning parser any constrained output (forced calls,
or the request's own response_format / structured output) may first reason (the rest of a block the prompt
opened, or an optional `<think>` block; `ReasoningFormat.lead`), so the constrained part is the answer after the
reasoning and not text the reasoning parser reads as reasoning; a prompt that closed its block (thinking off) gets
no lead. parallel_tool_calls false: at most one call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybridserve.parsers.reasoning import ReasoningFormat
from hybridserve.parsers.tool_calls import ToolFormat, forced_calls_format
from hybridserve.sampling import SamplingParamError, SamplingParams
from hybridserve.server.assistant import OutputParsing
from hybridserve.server.errors import APIError
from hybridserve.server.prompts import chat_prompt, check_context
from hybridserve.server.protocol import ChatTool, NamedToolChoice, Truncation, invalid_field
from hybridserve.structured import StructuredOutputParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridserve.server.state import ServerState


@dataclass(frozen=True)
class ToolSelection:
    template_tools: list[dict] | None  # the `tools` the chat template gets
    offered: dict[str, dict]  # function name -> parameters schema: what outputs are parsed for
    forced: dict[str, dict] | None  # the functions the output must call (required / named), or None
    parallel: bool

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def structured_output(self, fmt: ToolFormat, reasoning: ReasoningFormat | None,
                          in_reasoning: bool) -> StructuredOutputParams | None:
        """The grammar of a forced selection (None when the model chooses)."""
        if self.forced is None:
            return None
        calls = forced_calls_format(fmt, self.forced, self.parallel)
        if reasoning is not None:
            calls = {"type": "sequence", "elements": [reasoning.lead(in_reasoning), calls]}
        return StructuredOutputParams(structural_tag={"type": "structural_tag", "format": calls})

    async def prepare_chat(self, server: ServerState, tokenizer: PreTrainedTokenizerBase, max_model_len: int,
                           messages: list, params: SamplingParams, template_options: dict, add_special_tokens: bool,
                           grammar_field: str | None, names: dict[str, str], truncation: Truncation | None = None
                           ) -> tuple[list[int], SamplingParams, OutputParsing]:
        """A chat-shaped request (chat completions, responses) made ready to queue: its prompt (the template on
        the prompt worker, cut to `truncation`), the context checked, the selection applied (`apply`), and only
        then the request's own grammar compiled (named by `grammar_field` in errors): a request that fails a cheap
        check never waits for a compile. `names` maps SamplingParams names to the request's fields."""
        prompt, text = await server.prompts.run(chat_prompt, tokenizer, messages, template_options,
                                                add_special_tokens, self.template_tools, truncation)
        check_context(len(prompt), params.max_tokens, max_model_len, names["max_tokens"])
        own_grammar = params.structured_output is not None
        params, parsing = await self.apply(server, text, params, names)
        if own_grammar:
            await server.compile_grammar(params, grammar_field)
        return prompt, params, parsing

    async def apply(self, server: ServerState, prompt_text: str, params: SamplingParams,
                    names: dict[str, str]) -> tuple[SamplingParams, OutputParsing]:
        """The request's SamplingParams with the forcing grammar (compiled before the request is queued) and how
        its outputs are parsed; `names` maps SamplingParams names to the request's fields (for errors)."""
        reasoning = server.reasoning_format
        in_reasoning = reasoning is not None and reasoning.prompt_opens_reasoning(prompt_text)
        # The reasoning a constrained output may write first: none when the prompt closed the block (thinking off).
        reasons_first = None if reasoning is None or reasoning.prompt_closes_reasoning(prompt_text) else reasoning
        fmt = server.tool_format() if self.offered else None  # a request without tools needs no tool format
        forced = self.structured_output(fmt, reasons_first, in_reasoning) if fmt is not None else None
        if forced is not None:
            if params.structured_output is not None:
                raise APIError("tool_choice 'required' or a named function already constrains the output; it "
                               "cannot be combined with another output constraint", param="tool_choice")
            try:
                params = replace(params, structured_output=forced)
            except SamplingParamError as err:  # min_tokens beside a grammar
                raise invalid_field(err, names) from None
            await server.compile_grammar(params, "tools")  # the grammar is made of the tools' schemas
        elif params.structured_output is not None and reasons_first is not None:  # the request's own, after it
            params = replace(params, structured_output=replace(params.structured_output,
                                                               reasoning=reasons_first.lead(in_reasoning)))
        parsing = OutputParsing(reasoning, in_reasoning, fmt, self.offered, self.max_calls)
        return params, parsing


def select_tools(tools: list[ChatTool] | None, choice: str | NamedToolChoice | None, parallel: bool | None,
                 param: str = "tool_choice") -> ToolSelection:
    """The request's selection; a choice that names no offered function (or needs tools that are not there) is
    a 400 on `param`."""
    tools = tools or []
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(f"tools define {duplicates} more than once; each function name must be unique", param="tools")
    offered = {tool.function.name: tool.function.schema for tool in tools}
    choice = choice if choice is not None else "auto"
    if choice == "none":
        return ToolSelection(None, {}, None, parallel is not False)
    if choice != "auto" and not tools:
        raise APIError(f"{param} {_describe(choice)} needs tools; this request offers none", param=param)
    forced = None
    if choice == "required":
        forced = offered
    elif isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in offered:
            raise APIError(f"{param} names the function {name!r}, which is not among the tools offered "
                           f"({', '.join(names)})", param=param)
        forced = {name: offered[name]}
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools] or None
    return ToolSelection(template_tools, offered, forced, parallel is not False)


def _describe(choice: str | NamedToolChoice) -> str:
    return f"{choice!r}" if isinstance(choice, str) else f"naming {choice.function.name!r}"
