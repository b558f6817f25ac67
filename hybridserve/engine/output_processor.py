"""OutputProcessor: a processed step's tokens -> what users see. Per sequence it appends the drawn tokens, advances
the grammar (structured output), detokenizes, checks stop strings, stop tokens and lengths, keeps logprobs, forks
an n > 1 prompt into its sequences, and hands out one delta `RequestOutput` per progressed request as its
`output_kind` asks. The step loop (`LLMEngine`) only schedules, runs and settles; everything the user sees of a
request is decided here."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridserve.core.step import ChunkResult, SampledToken
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledStep, Scheduler
from hybridserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from hybridserve.sampling import SamplingParams
from hybridserve.structured.matcher import GrammarState
from hybridserve.tokenizer import IncrementalDetokenizer, StopStringMatcher

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    """One generated sequence plus what turns its tokens into user-facing output, and how much of it was handed
    out already (each step's output carries only what is new)."""

    group: Group
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    text: StopStringMatcher
    new_logprobs: list[dict[int, float]] | None = None  # of the tokens not handed out yet
    cumulative_logprob: float | None = None
    grammar: GrammarState | None = None  # where its output stands in the request's grammar (structured output)
    num_reported: int = 0  # output tokens handed out
    announced: bool = False  # handed out at least once (an empty sequence is announced too)
    reported_finish: bool = False


@dataclass(eq=False)
class Group:
    """A user's request: one prompt and its n sequences (the first forks the others once the prompt is done)."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    sequences: list[Sequence]
    prompt_logprobs: list[dict[int, float] | None] | None
    grammar: xgrammar.CompiledGrammar | None = None  # structured output: each sequence matches it
    error: str | None = None  # set when the request failed (and was aborted) while the others kept running
    started: bool = False  # a delta was built (the prompt logprobs go out with the first)
    total: RequestOutput | None = None  # the deltas so far, folded (CUMULATIVE and FINAL_ONLY requests)

    @property
    def finished(self) -> bool:
        return self.error is not None or (
            len(self.sequences) == self.params.n and all(s.request.finished for s in self.sequences))


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        """`scheduler`: where finished requests are retired and forks start."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, Group] = {}
        self.sequences: dict[str, Sequence] = {}  # by the scheduler's request id
        self.num_generation_tokens = 0

    def add(self, request: Request, prompt: str | None, grammar: xgrammar.CompiledGrammar | None) -> None:
        """Track a new request (the first sequence of its group)."""
        params = request.params
        group = Group(request.request_id, prompt, params, [], [None] if params.prompt_logprobs is not None else None,
                      grammar)
        self.groups[request.request_id] = group
        self._track(group, request)

    def abort(self, request_id: str) -> bool:
        """Forget a request and retire its unfinished sequences; False if it is not known (finished already)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for sequence in group.sequences:
            self.sequences.pop(sequence.request.request_id, None)
            if not sequence.request.finished:
                self.scheduler.finish(sequence.request, "abort")
        return True

    def _track(self, group: Group, request: Request) -> Sequence:
        params = group.params
        sequence = Sequence(group, request, len(group.sequences),
                            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                   params.skip_special_tokens),
                            StopStringMatcher(params.stop, params.include_stop_str_in_output),
                            grammar=GrammarState(group.grammar) if group.grammar is not None else None,
                            new_logprobs=[] if params.logprobs is not None else None,
                            cumulative_logprob=0.0 if params.logprobs is not None else None)
        group.sequences.append(sequence)
        self.sequences[request.request_id] = sequence
        return sequence

    def process(self, scheduled: ScheduledStep, results: list[ChunkResult],
                accepted: dict[int, int]) -> list[RequestOutput]:
        """Append a finished step's tokens (stop checks, forks, failures) and build the outputs it produced.
        `accepted`: each verify row's accepted drafts, by request serial."""
        progressed: dict[str, Group] = {}
        for request, result, chunk in zip(scheduled.requests, results, scheduled.plan.chunks):
            sequence = self.sequences.get(request.request_id)
            if sequence is None or request.finished:
                continue  # aborted, or finished by the step before while this one ran: its work is discarded
            group = sequence.group
            if group.error is not None:
                continue  # another sequence of the group failed earlier in this step
            try:
                if result.error is not None:
                    raise result.error
                if result.prompt_logprobs:
                    group.prompt_logprobs.extend(result.prompt_logprobs)
                if result.sampled:
                    request.draft_token_ids = result.drafts
                if chunk.num_drafts and result.sampled:  # the drawn tokens as far as they confirm the drafts
                    request.num_pending -= 1
                    for sampled in result.sampled[:accepted[request.serial] + 1]:
                        self._append_token(sequence, sampled)
                        if request.finished:
                            break  # a stop inside the accepted run: the rest is dropped
                    progressed[group.request_id] = group
                elif result.sampled:
                    first, *forks = result.sampled
                    for sampled in forks:  # fork before the parent can finish and free what the children copy
                        self._append_token(self._fork(group, request), sampled)
                    for _ in range(request.num_forks - len(forks)):  # not drawn in this step: they draw later
                        self._fork(group, request, drawn=False)
                    request.num_forks = 0
                    request.num_pending -= 1
                    self._append_token(sequence, first)
                    progressed[group.request_id] = group
            except Exception as err:  # this request's failure: abort it alone, everyone else keeps going
                self.fail(group, err)
                progressed[group.request_id] = group
        return self.outputs(list(progressed.values()))

    def outputs(self, progressed: list[Group]) -> list[RequestOutput]:
        """The outputs of groups that progressed; finished groups are forgotten."""
        outputs = [output for group in progressed if (output := self._output(group)) is not None]
        for group in progressed:
            if group.finished:
                del self.groups[group.request_id]
                for sequence in group.sequences:
                    del self.sequences[sequence.request.request_id]
        return outputs

    def fail(self, group: Group, err: Exception) -> None:
        logger.error("request %s failed; aborting it alone", group.request_id, exc_info=err)
        group.error = f"{type(err).__name__}: {err}"
        for sequence in group.sequences:
            if not sequence.request.finished:
                self.scheduler.finish(sequence.request, "abort")

    def _fork(self, group: Group, parent: Request, drawn: bool = True) -> Sequence:
        index = len(group.sequences)
        child = Request(request_id=f"{group.request_id}#{index}", prompt_token_ids=parent.prompt_token_ids,
                        params=group.params, seed=parent.seed + index, eos_token_ids=self.eos_token_ids)
        sequence = self._track(group, child)
        self.scheduler.fork(parent, child, drawn)
        return sequence
    def _append_token(self, sequence: Sequence, sampled: SampledToken) -> None:
        request, params = sequence.request, sequence.request.params
        stops = request.stop_token_hit(sampled.token_id)
        request.output_token_ids.append(sampled.token_id)
        self.num_generation_tokens += 1
        if sequence.new_logprobs is not None:
            entry = dict(sampled.top_logprobs or [])
            entry[sampled.token_id] = sampled.logprob
            sequence.new_logprobs.append(entry)
            sequence.cumulative_logprob += sampled.logprob
        if sequence.grammar is not None:
            sequence.grammar.accept(sampled.token_id)
        if sequence.text.add(sequence.detokenizer.add(sampled.token_id)):
            request.stop_reason = sequence.text.matched
            self.scheduler.finish(request, "stop")
        elif stops:
            request.stop_reason = None if sampled.token_id in self.eos_token_ids and \
                sampled.token_id not in params.stop_token_ids else sampled.token_id
            self.scheduler.finish(request, "stop")
        elif sequence.grammar is not None and sequence.grammar.terminated:  # its stop token, under ignore_eos
            self.scheduler.finish(request, "stop")
        elif (params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens) \
                or request.num_tokens >= self.max_model_len:
            self.scheduler.finish(request, "length")

    def _output(self, group: Group) -> RequestOutput | None:
        """This step's output of a group that progressed, by its output kind (None: nothing to hand out yet)."""
        delta = self._delta(group)
        kind = group.params.output_kind
        if kind is RequestOutputKind.DELTA:
            return delta
        if group.total is None:
            group.total = delta
        else:
            group.total.add(delta)
        if kind is RequestOutputKind.CUMULATIVE:
            return group.total.copy()
        return group.total if group.finished else None

    def _delta(self, group: Group) -> RequestOutput:
        """What is new in a group since its previous delta: per sequence the new tokens, their logprobs and the text
        that became safe to show, in time proportional to that (sequences with nothing new are left out)."""
        completions = []
        for seq in group.sequences:
            request = seq.request
            if seq.reported_finish:
                continue
            tokens = request.output_token_ids[seq.num_reported:]
            text = seq.text.release(request.finished)
            if seq.announced and not (tokens or text or request.finished):
                continue
            logprobs = seq.new_logprobs
            if logprobs is not None:
                seq.new_logprobs = []
            seq.num_reported += len(tokens)
            seq.announced, seq.reported_finish = True, request.finished
            completions.append(CompletionOutput(seq.index, text, tokens, request.finish_reason, request.stop_reason,
                                                seq.cumulative_logprob, logprobs))
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs and not group.started else None
        group.started = True
        first = group.sequences[0].request
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions, finished=group.finished,
                             num_cached_tokens=first.num_cached_tokens or 0, prompt_logprobs=prompt_logprobs,
                             error=group.error)
