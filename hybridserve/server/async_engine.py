"""AsyncEngine: the server's handle on the LLMEngine running in its own process (server/engine_process.py).

The event loop never waits on the engine. Commands (add a group of requests, abort requests, stop) go to the
engine's process through a sender thread, so a large prompt never blocks the loop on a full pipe; a receiver thread
reads what the engine sends back and hands each message to the loop in one `call_soon_threadsafe` call, which
leaves every output in the mailbox of the API call that owns it. The two processes share nothing: a long prefill
never blocks accepting or streaming other requests, and streaming thousands of chunks never delays a step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from transformers import PreTrainedTokenizerBase

from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.outputs import RequestOutput, RequestOutputKind
from hybridserve.sampling import SamplingParams
from hybridserve.server import engine_process
from hybridserve.server.engine_process import EngineDescription
from hybridserve.structured import StructuredOutputParams
from hybridserve.structured.compiler import GrammarCompiler, shared_compiler
from hybridserve.tokenizer import load_tokenizer

PIPE_BYTES = 1 << 20
SHIPPED_GRAMMARS = 4096  # grammars remembered as sent to the engine's process (it keeps them in its own cache)


@dataclass(frozen=True)
class EngineInfo(EngineDescription):
    """What the API layer needs to know about the loaded model: the engine's description and the tokenizer."""

    tokenizer: PreTrainedTokenizerBase  # the server process's own, used only on the event-loop thread


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class EngineDead(RuntimeError):
    """Raised to every open API call when the engine fails or its process dies."""


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


class AsyncEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None,
                 engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine):
        self.config = config
        self.chat_template = chat_template  # replaces the model's, for the HTTP side's tokenizer
        self.engine_factory = engine_factory  # what the engine's process runs (a test double in some tests)
        self.info: EngineInfo | None = None  # set once the model is loaded
        self.error: BaseException | None = None  # set if loading or a step failed; the server then stops
        self._grammars: GrammarCompiler | None = None
        self._stats: dict[str, int] = {}
        self._stopping = False
        # Event-loop side only: request id -> its API call's mailbox, whether its outputs are deltas, and its prompt
        # (the engine's process leaves prompts out of what it sends: hundreds of KiB a step at 256 streams); groups
        # waiting for the engine's answer; grammars the engine's process was sent already (most recent last).
        self._mailboxes: dict[str, tuple[OutputMailbox, bool, list[int]]] = {}
        self._groups: dict[int, tuple[asyncio.Future, list[str]]] = {}
        self._group_ids = itertools.count()
        self._flushes: dict[int, asyncio.Future] = {}  # prefix-cache flushes waiting for the engine's answer
        self._shipped: OrderedDict[tuple, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_fatal: Callable[[], None] = lambda: None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()

    # --- event-loop side -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[], None]) -> None:
        """Start the engine's process (it loads the model); `on_fatal` runs on the loop if loading or a step
        fails, or the process dies."""
        self._loop, self._on_fatal = loop, on_fatal
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        commands_in, commands_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        for pipe in (commands_in, events_in):
            _widen(pipe)
        # Not a daemon: it starts tensor-parallel workers of its own. It ends with this process all the same.
        self._process = context.Process(target=engine_process.serve, name="hybridserve-engine",
                                        args=(self.config, self.engine_factory, commands_in, events_out,
                                              logging.getLogger().getEffectiveLevel()))
        self._process.start()
        commands_in.close()
        events_out.close()
        threading.Thread(target=self._send_commands, args=(commands_out,), name="hybridserve-engine-send",
                         daemon=True).start()
        threading.Thread(target=self._receive_events, args=(events_in,), name="hybridserve-engine-receive",
                         daemon=True).start()

    def stop(self, wait_s: float = 30) -> None:
        """Stop after the current step; wait at most `wait_s` for it, then end the process."""
        self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        process = self._process
        if process is None:
            return
        process.join(timeout=wait_s)
        if process.is_alive():
            process.terminate()  # SIGTERM: it stops at its next Python instruction and stops its TP workers
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    def stats(self) -> dict[str, int]:
        """The engine's stats after its latest step or command ({} while loading)."""
        return self._stats

    @property
    def grammars(self) -> GrammarCompiler:
        """The server process's grammar compiler for the loaded model (thread-safe; shared by every engine of the
        process with this tokenizer), for compiling a request's grammar before it is queued."""
        return self._grammars

    async def add(self, requests: list[EngineRequest], mailbox: OutputMailbox) -> None:
        """Queue requests as one group: all are accepted, or none (the engine's ValueError is raised here).

        Their outputs (RequestOutputs of each request's output kind) arrive in `mailbox`.
        """
        self._check_alive()
        grammars = await self._grammars_to_ship(requests)
        self._check_alive()  # it may have failed while the grammars were serialized
        group, accepted = next(self._group_ids), self._loop.create_future()
        self._groups[group] = (accepted, [request.request_id for request in requests])
        self._mailboxes.update(
            (request.request_id, (mailbox, request.params.output_kind is RequestOutputKind.DELTA,
                                  request.prompt_token_ids))
            for request in requests)
        self._outbox.put(("add", group, requests, grammars))
        await accepted

    async def flush_cache(self) -> bool:
        """Empty the engine's prefix cache; False (nothing dropped) while requests are queued or running."""
        self._check_alive()
        token, done = next(self._group_ids), self._loop.create_future()
        self._flushes[token] = done
        self._outbox.put(("flush", token))
        return await done

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(f"the engine has failed ({self.error}); restart the server")

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are (pages and state are freed by the engine); no output follows."""
        for request_id in request_ids:
            self._mailboxes.pop(request_id, None)
        if self.error is None:
            self._outbox.put(("abort", request_ids))

    async def _grammars_to_ship(self, requests: list[EngineRequest]) -> dict[str, str]:
        """The serialized grammars (by the id of the first request using each) that the engine's process has not
        been sent yet: it adopts them instead of compiling them again between two steps."""
        if self._grammars is None:  # not loaded yet: the engine compiles what it gets
            return {}
        wanted: dict[tuple, tuple[str, StructuredOutputParams]] = {}
        for request in requests:
            spec = request.params.structured_output
            if spec is None:
                continue
            key = spec.cache_key()
            if key in self._shipped:
                self._shipped.move_to_end(key)
            else:
                wanted.setdefault(key, (request.request_id, spec))
        shipped = {}
        for key, (request_id, spec) in wanted.items():
            shipped[request_id] = await asyncio.to_thread(self._grammars.serialized, spec)
            self._shipped[key] = None
        while len(self._shipped) > SHIPPED_GRAMMARS:
            self._shipped.popitem(last=False)
        return shipped

    def _on_event(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, self._stats = message
            for output in outputs:
                pop = self._mailboxes.pop if output.finished else self._mailboxes.get
                target = pop(output.request_id, None)
                if target is not None:
                    mailbox, delta, output.prompt_token_ids = target
                    mailbox.put(output, delta)
        elif kind == "accepted":
            _, group, refusal, self._stats = message
            accepted, request_ids = self._groups.pop(group)
            if refusal is not None:
                for request_id in request_ids:
                    self._mailboxes.pop(request_id, None)
            _settle(accepted, refusal)
        elif kind == "flushed":
            _, token, done, self._stats = message
            future = self._flushes.pop(token)
            if not future.done():
                future.set_result(done)
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "ready":
            _, self.info, self._grammars, self._stats = message
        elif kind == "failed":
            self._fail(message[1])
        elif not self._stopping and self.error is None:  # "exited": the process ended without saying why
            self._fail(f"the engine's process exited unexpectedly (exit code {self._process.exitcode})")

    def _fail(self, what: str) -> None:
        self.error = dead = EngineDead(what)
        for waiting in [accepted for accepted, _ in self._groups.values()] + list(self._flushes.values()):
            _settle(waiting, dead)
        self._groups.clear()
        self._flushes.clear()
        for mailbox in {mailbox for mailbox, _, _ in self._mailboxes.values()}:
            mailbox.interrupt(dead)
        self._mailboxes.clear()
        self._outbox.put(None)
        self._on_fatal()

    # --- the pipe threads ----------------------------------------------------------------------------------------
    def _send_commands(self, pipe: Connection) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                pipe.send(command)
            except OSError:  # the engine's process is gone; the receiver reports it
                break
            except Exception as err:  # it does not pickle (nothing was written): only an added group can fail
                if command[0] != "add":
                    raise
                self._deliver(("accepted", command[1], RuntimeError(f"the request could not be sent to the engine "
                                                                    f"({type(err).__name__}: {err})"), self._stats))
        pipe.close()

    def _receive_events(self, pipe: Connection) -> None:
        while True:
            try:
                message = pipe.recv()
            except (EOFError, OSError):  # it has ended or is ending: give it a moment to report its exit code
                multiprocessing.connection.wait([self._process.sentinel], timeout=5)
                self._deliver(("exited",))
                return
            if message[0] == "ready":  # the tokenizer and grammar compiler load here, off the event loop
                try:
                    message = ("ready", *self._server_side(message[1]), message[2])
                except Exception as err:
                    message = ("failed", f"the server could not load the tokenizer: {type(err).__name__}: {err}")
            if not self._deliver(message):
                return

    def _deliver(self, message: tuple) -> bool:
        """Hand `message` to the event loop; False once the loop is closed (the server has ended)."""
        try:
            self._loop.call_soon_threadsafe(self._on_event, message)
        except RuntimeError:
            return False
        return True

    def _server_side(self, description: EngineDescription) -> tuple[EngineInfo, GrammarCompiler]:
        tokenizer = load_tokenizer(description.tokenizer_path)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        info = EngineInfo(**{f.name: getattr(description, f.name) for f in dataclasses.fields(description)},
                          tokenizer=tokenizer)
        grammars = shared_compiler(description.tokenizer_path, description.vocab_size,
                                   list(description.eos_token_ids))
        return info, grammars


def _widen(pipe: Connection) -> None:
    """Give the pipe a 1 MiB buffer where the OS allows (Linux; 64 KiB by default): a step's outputs for hundreds
    of streams then go out without waiting for the server's receiver thread to get the interpreter lock."""
    try:
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or above the system's pipe-max-size: keep the default
        pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the API call went away while waiting; it has queued an abort for its requests
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
