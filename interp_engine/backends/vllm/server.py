"""`interp-engine serve`: vLLM's own OpenAI-compatible server (its app, routes, API-key check, health, shutdown),
started with our worker extension and engine settings (`engine.settings`, as offline), with `serving.py`'s
request handling added as the innermost ASGI middleware and around the engine client's `generate`."""

import asyncio
import json
import os
from typing import Any

from interp_engine.backends.vllm import compat, engine, server_watch, serving, shm, wire
from interp_engine.errors import BackendError, InterpEngineError, fix


def engine_args(handle, vllm_argv: list[str]):
    """vLLM's own server arguments for `handle`'s checkpoint: the user's vLLM flags, and where they left a
    default, the offline engine settings (the worker extension, eager mode, dtype, seed). The tokenizer is kept:
    the server tokenizes and detokenizes."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="interp-engine serve"))
    args = parser.parse_args(["--model", str(handle.runtime.source), *vllm_argv])
    kwargs, env = engine.settings(handle.runtime)
    for name in ("model", "tokenizer", "skip_tokenizer_init"):
        kwargs.pop(name)
    for name, value in kwargs.items():
        if name == "additional_config":  # vllm-static's taps, which key its compile cache, join the user's
            value = compat.joined_additional_config(args, value)
        if name in ("worker_extension_cls", "worker_cls", "enforce_eager", "additional_config") or \
                getattr(args, name, None) == parser.get_default(name):
            setattr(args, name, value)
    validate_parsed_serve_args(args)
    return args, env


async def run(handle, args, service: serving.Service) -> None:
    """Serve until SIGINT/SIGTERM (vLLM's handlers: the engine's processes are shut down before we return)."""
    import psutil
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from starlette.middleware import Middleware

    compat.check_version()
    listen_address, sock = setup_server(args, reuse_port=False)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    async with build_async_engine_client(args) as client:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        shm.unlink_joined(procs)  # its queues: the resource tracker unlinks them when the server exits
        wire.sweep_orphans()  # what killed drivers and engines left in /dev/shm
        shm.sweep_orphans()
        watching = asyncio.get_running_loop().create_task(server_watch.watch(client, procs))
        hosts = await client.collective_rpc(serving.wire.ATTACH)  # once per engine, as offline
        service.local = serving.wire.same_host(hosts[0])
        serving.wrap_generate(client)
        app = build_app(args, await client.get_supported_tasks(), compat.client_model_config(client))
        # Innermost: vLLM's own middleware (the API-key check first) sees a request before we parse its body.
        app.user_middleware.append(Middleware(Interp, service=service, n_layers=handle.n_layers))
        app.middleware_stack = app.build_middleware_stack()  # build_app has built it already
        await init_app_state(client, app.state, args, await client.get_supported_tasks())
        shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log)
        watching.cancel()
    try:
        await shutdown
    finally:
        sock.close()


class Interp:
    """The ASGI middleware: a completion's `interp` object checked into a job before vLLM sees the request, and
    the job's captures added to its response (a bad request: HTTP 400 with the Python API's message)."""

    def __init__(self, app, *, service: serving.Service, n_layers: int):
        self.app, self.service, self.n_layers = app, service, n_layers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in serving.ROUTES:
            return await self.app(scope, receive, send)
        body, limit = b"", self.service.limits.spec_bytes
        while True:
            message = await receive()
            body += message.get("body", b"")
            if limit and len(body) > limit:
                return await _error(send, 400, fix(f"this request is over the server's {limit} bytes.",
                                                   "send a smaller spec (fewer or smaller vectors), or start the "
                                                   "server with a larger --max-spec-bytes."))
            if not message.get("more_body"):
                break
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        job = None
        if isinstance(payload, dict):
            try:
                job = self.service.job(payload, chat=scope["path"].endswith("chat/completions"))
            except InterpEngineError as e:
                return await _error(send, 400, str(e))
            if "interp" in payload:
                body = json.dumps({k: v for k, v in payload.items() if k != "interp"}).encode()
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        if job is None:
            return await self.app(scope, replay, send)
        token = serving.JOB.set(job)
        try:
            await self.app(scope, replay, self._responder(job, send))
        finally:
            serving.JOB.reset(token)

    def _responder(self, job: serving.Job, send):
        """Hold a JSON response until its body is whole, then add the job's `interp` field (or its error); in a
        stream that captures, send a last chunk with the field before `data: [DONE]`."""
        held: dict[str, Any] = {}

        async def respond(message):
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                kind = headers.get(b"content-type", b"")
                if message["status"] == 200 and kind.startswith(b"text/event-stream") and job.asked.plan.reads:
                    held["stream"] = b""
                if message["status"] != 200 or not kind.startswith(b"application/json"):
                    return await send(message)  # vLLM's own error, or a stream: as it is
                held.update(start=message, body=b"")
                return None
            if "stream" in held and message["type"] == "http.response.body":
                return await send(self._streamed(job, message, held))
            if message["type"] != "http.response.body" or "start" not in held:
                return await send(message)
            held["body"] += message.get("body", b"")
            if message.get("more_body"):
                return None
            try:
                extra = self._extra(job)
            except InterpEngineError as e:
                return await _error(send, 400, str(e))
            response = json.loads(held["body"])
            response["interp"] = extra
            await _send_json(send, held["start"]["status"], response)

        return respond

    def _extra(self, job: serving.Job) -> dict:
        """The response's `interp` field, or the job's error."""
        if job.error is not None:
            raise job.error
        return serving.encode_captures(job, self.n_layers, self.service.limits.capture_bytes) \
            if job.asked.plan.reads else {}

    def _streamed(self, job: serving.Job, message: dict, held: dict) -> dict:
        """A stream's body message; the one holding `data: [DONE]` gets the captures' chunk before it (the job's
        requests have all ended by then: vLLM's serving code sends [DONE] after its generators are exhausted).
        The chunk repeats the last one's id, object, created and model, with no choices; a failure is the error
        chunk the openai client raises from."""
        body = message.get("body", b"")
        done = body.find(b"data: [DONE]")
        if done < 0:
            held["stream"] = body or held["stream"]
            return message
        try:
            last = json.loads(held["stream"].rsplit(b"data: ", 1)[-1].strip() or b"{}")
        except ValueError:
            last = {}
        try:
            chunk = {k: last[k] for k in ("id", "object", "created", "model") if k in last} | \
                {"choices": [], "interp": self._extra(job)}
        except InterpEngineError as e:
            chunk = {"error": {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}}
        return {**message, "body": body[:done] + b"data: " + json.dumps(chunk).encode() + b"\n\n" + body[done:]}


async def _error(send, status: int, message: str) -> None:
    """vLLM's own error body (`ErrorResponse`), which the openai client reads."""
    await _send_json(send, status, {"error": {"message": message, "type": "BadRequestError", "param": None,
                                              "code": status}})


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def serve(handle, vllm_argv: list[str], service_options: dict) -> None:
    """Run the server in this process until it is told to stop."""
    import uvloop

    if handle.backend not in ("vllm", "vllm-static"):  # refused before vLLM's import (seconds)
        raise BackendError(fix(f"interp-engine serve runs backend=\"vllm\" or \"vllm-static\", not "
                               f"{handle.backend!r}.", "use --backend vllm (per-request specs and captures at any "
                               "point), or vllm-static with --static-points/--static-writes."))
    service = serving.Service(handle, **service_options)  # a bad --default-spec: refused before anything starts
    # This process's first import of vLLM, as a load's (`engine.imported`): its frames, `handle` among their
    # locals, are not kept by what vLLM's modules keep; the later imports find those modules loaded.
    cli_env_setup = engine.imported(_cli_env_setup)
    args, env = engine_args(handle, vllm_argv)
    cli_env_setup()
    os.environ.update(env)  # this process is the server's: its engine's processes inherit these
    try:
        uvloop.run(run(handle, args, service))
    finally:
        engine.remove_sockets(env.get(engine.SOCKETS))  # the engine's processes are gone (see `run`)


def _cli_env_setup():
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    return cli_env_setup
