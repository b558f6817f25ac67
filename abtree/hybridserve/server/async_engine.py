"""AsyncEngine: the single-threaded LLMEngine on its own thread, beside the asyncio event loop.

The event loop never calls the engine. It queues commands (add a group of requests, abort requests) under a
condition variable; the engine thread drains them between steps, steps while there is work, sleeps on the
condition when idle, and hands each step's outputs back to the loop in one `call_soon_threadsafe` call, which
leaves every output in the mailbox of the API call that owns it. A long prefill therefore never blocks accepting
or streaming other requests, and the engine is only ever touched by one thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.outputs import RequestOutput, RequestOutputKind
from hybridserve.sampling import SamplingParams
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the API layer needs to know about the loaded model."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    tokenizer: PreTrainedTokenizerBase  # a second instance, used only on the event-loop thread


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class EngineDead(RuntimeError):
    """Raised to every open API call when the engine thread fails."""


class OutputMailbox:
    """Where one API call's outputs arrive (event-loop side).

    A newer output of a request meets an unread older one there: a delta is folded into it (RequestOutput.add), a
    cumulative output replaces it. A slow reader costs no extra memory and simply gets bigger deltas.
    """

    def __init__(self):
        self._latest: dict[str, RequestOutput] = {}
        self._interrupt: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput, delta: bool) -> None:
        unread = self._latest.get(output.request_id)
        if delta and unread is not None:
            unread.add(output)
        else:
            self._latest[output.request_id] = output
        self._ready.set()

    def interrupt(self, reason: BaseException) -> None:
        """Make the reader's next `get` raise `reason` (the engine failed, the client went away)."""
        self._interrupt = reason
        self._ready.set()

    async def get(self) -> list[RequestOutput]:
        """The outputs left since the last call (at least one), latest per request; once they are read, the
        interruption (if any) is raised."""
        while not self._latest and self._interrupt is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._latest:
            raise self._interrupt
        outputs, self._latest = list(self._latest.values()), {}
        return outputs


@dataclass
class _Add:
    requests: list[EngineRequest]
    mailbox: OutputMailbox
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


class AsyncEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None):
        self.config = config
        self.chat_template = chat_template  # replaces the model's, for the HTTP side's tokenizer
        self.info: EngineInfo | None = None  # set once the model is loaded
        self.error: BaseException | None = None  # set if loading or a step failed; the server then stops
        self._stats: dict[str, int] = {}
        self._commands: list[_Add | _Abort] = []
        self._wakeup = threading.Condition()
        self._stopping = False
        # Engine thread only: request id -> its API call's mailbox, and whether its outputs are deltas.
        self._mailboxes: dict[str, tuple[OutputMailbox, bool]] = {}
        self._engine: LLMEngine | None = None  # kept after the thread ends: freeing its caches can take a second
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_fatal: Callable[[], None] = lambda: None
        self._thread: threading.Thread | None = None

    # --- event-loop side -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[], None]) -> None:
        """Load the model and serve on a new thread; `on_fatal` runs on the loop if loading or a step fails."""
        self._loop, self._on_fatal = loop, on_fatal
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 30) -> None:
        """Stop after the current step; wait at most `wait_s` for it (the thread is a daemon)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    def stats(self) -> dict[str, int]:
        """The engine's stats after its latest step or command ({} while loading)."""
        return self._stats

    async def add(self, requests: list[EngineRequest], mailbox: OutputMailbox) -> None:
        """Queue requests as one group: all are accepted, or none (the engine's ValueError is raised here).

        Their outputs (RequestOutputs of each request's output kind) arrive in `mailbox`.
        """
        accepted = self._loop.create_future()
        if not self._submit(_Add(requests, mailbox, accepted)):
            raise EngineDead(f"the engine has failed ({self.error}); restart the server")
        await accepted

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are (pages and state are freed by the engine); no output follows."""
        self._submit(_Abort(request_ids))

    def _submit(self, command: _Add | _Abort) -> bool:
        """Queue a command for the engine thread; False once the engine has failed (nothing runs any more)."""
        with self._wakeup:
            if self.error is not None:
                return False
            self._commands.append(command)
            self._wakeup.notify()
            return True

    # --- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        start = time.monotonic()
        try:
            engine = self._engine = LLMEngine(self.config)
            tokenizer = load_tokenizer(self.config.tokenizer or engine.model_dir)
        except Exception as err:  # a bad model directory or engine option: report it and stop the server
            self._fail(err, "the engine could not start")
            return
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        self._stats = engine.stats()
        self.info = EngineInfo(engine.model_dir, engine.max_model_len, engine.vocab_size, tokenizer)
        runner = engine.runner
        logger.info("model ready in %.1f s: %s (%s), device %s, dtype %s, max_model_len %d",
                    time.monotonic() - start, engine.model_dir, type(runner.model).__name__, runner.device,
                    str(runner.dtype).removeprefix("torch."), engine.max_model_len)
        try:
            while (commands := self._wait_for_work(engine)) is not None:
                for command in commands:
                    self._apply(engine, command)
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self._stats = engine.stats()
        except Exception as err:  # an engine bug: its state can no longer be trusted
            self._fail(err, "the engine failed")
        finally:
            engine.shutdown()  # tensor-parallel workers

    def _wait_for_work(self, engine: LLMEngine) -> list[_Add | _Abort] | None:
        with self._wakeup:
            while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                self._wakeup.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _apply(self, engine: LLMEngine, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            for request_id in command.request_ids:
                engine.abort_request(request_id)
                self._mailboxes.pop(request_id, None)
            return
        added = []
        try:
            for request in command.requests:
                engine.add_request(request.request_id, request.prompt_token_ids, request.params)
                added.append(request.request_id)
        except Exception as err:  # ValueError: a bad request (400); anything else: this group failed alone (500)
            if not isinstance(err, ValueError):
                logger.error("adding request group %s failed", [r.request_id for r in command.requests],
                             exc_info=err)
            for request_id in added:
                engine.abort_request(request_id)
            self._loop.call_soon_threadsafe(_settle, command.accepted, err)
            return
        self._mailboxes.update(
            (request.request_id, (command.mailbox, request.params.output_kind is RequestOutputKind.DELTA))
            for request in command.requests)
        self._loop.call_soon_threadsafe(_settle, command.accepted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            pop = self._mailboxes.pop if output.finished else self._mailboxes.get
            target = pop(output.request_id, None)
            if target is not None:
                batch.append((*target, output))
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail(self, err: Exception, what: str) -> None:
        if isinstance(err, (ValueError, FileNotFoundError)):
            logger.error("%s: %s", what, err)
        else:
            logger.exception(what)
        dead = EngineDead(f"{what}: {type(err).__name__}: {err}")
        with self._wakeup:  # from now on nothing is queued, and what was queued is answered here
            self.error = err
            waiting, self._commands = [c.accepted for c in self._commands if isinstance(c, _Add)], []
        for future in waiting:
            self._loop.call_soon_threadsafe(_settle, future, dead)
        for mailbox in {mailbox for mailbox, _ in self._mailboxes.values()}:
            self._loop.call_soon_threadsafe(mailbox.interrupt, dead)
        self._loop.call_soon_threadsafe(self._on_fatal)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the API call went away while waiting; it has queued an abort for its requests
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(items: list[tuple[OutputMailbox, bool, RequestOutput]]) -> None:
    for mailbox, delta, output in items:
        mailbox.put(output, delta)
