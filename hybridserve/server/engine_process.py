"""The engine's own process: the single-threaded LLMEngine loop behind the server, talking to it over two pipes.

The HTTP process (uvicorn, request parsing, chat templates, streaming JSON) and the engine (scheduling, the
forward's host work, detokenization) used to share one interpreter lock, so at high concurrency every SSE chunk
written delayed the next step. Here the engine runs alone: between steps it drains the commands the server sent
(add a group of requests, abort requests, stop), then steps while there is work and sends each step's outputs
back as one message, with the engine's stats. It ignores Ctrl+C (the server drains first and then stops it) and
ends when the server's pipe closes or the server's process is gone, so it never outlives the server.

Once the engine is built, everything the process holds so far (torch, Triton, transformers, the model, the CUDA
graphs) is moved out of the garbage collector's reach (`gc.freeze`): it lives as long as the process, and a full
collection would otherwise walk all of it (about 80 ms for the 214k objects of a CPU process) in the middle of a
step. Later collections walk only what serving creates.

Messages, server -> engine: ("add", group, [EngineRequest], {request_id: serialized grammar}), ("abort", [id]),
("flush", token), ("stop",). Engine -> server: ("ready", EngineDescription, stats), ("accepted", group, None | the
refusal's exception, stats), ("outputs", [RequestOutput without its prompt ids], stats), ("flushed", token, done,
stats), ("stats", stats), ("failed", message).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PARENT_CHECK_S = 1.0  # how often an idle engine looks whether the server's process still exists


@dataclass(frozen=True)
class EngineDescription:
    """What the server needs to know about the loaded model (it loads its own tokenizer from `tokenizer_path`)."""

    model_dir: str
    model_type: str  # config.json's (picks the default tool-call parser)
    max_model_len: int
    vocab_size: int
    tokenizer_path: str
    eos_token_ids: tuple[int, ...]
    max_logprobs: int  # the most logprobs per token a request may ask for
    # SamplingParams field -> default for requests that leave it unset (the generation config, --generation-config)
    sampling_defaults: dict[str, Any]


class _Stop(BaseException):
    """The server asked the engine to stop (or sent SIGTERM): not an error, whatever the engine was doing."""


def serve(config: EngineConfig, factory: Callable[[EngineConfig], LLMEngine], commands: Connection,
          events: Connection, log_level: int) -> None:
    """The engine process's main: load, report ready (or why not), then serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_stop)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        start = time.monotonic()
        try:
            engine = factory(config)
        except Exception as err:  # a bad model directory or engine option: report it and stop the server
            _report(events, err, "the engine could not start")
            return
        gc.collect()
        gc.freeze()
        try:
            events.send(("ready", describe(engine, config), engine.stats()))
            runner = engine.runner
            logger.info("model ready in %.1f s: %s (%s), device %s, dtype %s, max_model_len %d",
                        time.monotonic() - start, engine.model_dir, type(runner.model).__name__, runner.device,
                        str(runner.dtype).removeprefix("torch."), engine.max_model_len)
            _loop(engine, commands, events)
        except (EOFError, BrokenPipeError):  # the server went away
            pass
        except Exception as err:  # an engine bug: its state can no longer be trusted
            _report(events, err, "the engine failed")
        finally:
            engine.shutdown()  # tensor-parallel workers
    except _Stop:
        pass


def describe(engine: LLMEngine, config: EngineConfig) -> EngineDescription:
    return EngineDescription(engine.model_dir, engine.model_type, engine.max_model_len, engine.vocab_size,
                             config.tokenizer or engine.model_dir, tuple(sorted(engine.eos_token_ids)),
                             config.max_logprobs, dict(engine.generation_config.sampling_defaults))


def _loop(engine: LLMEngine, commands: Connection, events: Connection) -> None:
    parent = multiprocessing.parent_process()
    while True:
        if not engine.has_unfinished_requests():  # idle: sleep until a command comes
            while not commands.poll(_PARENT_CHECK_S):
                if parent is not None and not parent.is_alive():
                    return
        applied = False
        while commands.poll():
            _apply(engine, commands.recv(), events)
            applied = True
        if engine.has_unfinished_requests():
            outputs = engine.step()
            for output in outputs:  # the server has every request's prompt: only what is new crosses the pipe
                output.prompt_token_ids = []
            events.send(("outputs", outputs, engine.stats()))
        elif applied:  # the last requests were aborted: no step will report the freed pages and slots
            events.send(("stats", engine.stats()))


def _apply(engine: LLMEngine, message: tuple, events: Connection) -> None:
    kind = message[0]
    if kind == "stop":
        raise _Stop
    if kind == "abort":
        for request_id in message[1]:
            engine.abort_request(request_id)
        return
    if kind == "flush":
        events.send(("flushed", message[1], engine.flush_prefix_cache(), engine.stats()))
        return
    _, group, requests, grammars = message
    added = []
    try:
        for request in requests:  # all first: the server counts them as sent even if the group is refused
            if request.request_id in grammars:
                engine.grammars.adopt(request.params.structured_output, grammars[request.request_id])
        for request in requests:
            engine.add_request(request.request_id, request.prompt_token_ids, request.params)
            added.append(request.request_id)
    except Exception as err:  # ValueError: a bad request (400); anything else: this group failed alone (500)
        if not isinstance(err, ValueError):
            logger.error("adding request group %s failed", [r.request_id for r in requests], exc_info=err)
        for request_id in added:
            engine.abort_request(request_id)
        events.send(("accepted", group, _refusal(err), engine.stats()))
        return
    events.send(("accepted", group, None, engine.stats()))


def _refusal(err: Exception) -> Exception:
    """The error to raise in the server for a refused group: a ValueError as it is where it pickles (its type and
    fields name the request's field), else its text."""
    if isinstance(err, ValueError):
        try:
            pickle.loads(pickle.dumps(err))
            return err
        except Exception:
            return ValueError(str(err))
    return RuntimeError(f"{type(err).__name__}: {err}")


def _report(events: Connection, err: Exception, what: str) -> None:
    if isinstance(err, (ValueError, FileNotFoundError)):
        logger.error("%s: %s", what, err)
    else:
        logger.exception(what)
    try:
        events.send(("failed", f"{what}: {type(err).__name__}: {err}"))
    except (BrokenPipeError, OSError):  # the server is gone already
        pass


def _raise_stop(*_) -> None:
    raise _Stop
