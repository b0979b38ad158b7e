"""A tiny OpenAI-compatible chat server on loopback for tests of the LLM stage (a helper module, not
collected as tests): it speaks the wire format real servers speak (a completion object, or
server-sent events when `stream` is asked), refuses the `response_format` types it is told to refuse
the way vLLM and llama.cpp do (HTTP 400 with an error object), and answers whatever the test scripts,
like a real server that may say anything."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

VALID = {"category": "infrastructure", "failure_type": "ecc_error", "action": "cordon_and_restart",
         "confidence": 0.93, "root_line_no": 1, "explanation": "Uncorrectable ECC error on the GPU of rank 3."}


class ChatServer:
    """A tiny OpenAI-compatible /v1/chat/completions server on 127.0.0.1, run by uvicorn in a
    thread. Each request takes the next scripted behaviour:

    - ("reply", text): answer `text` (streamed in pieces when the request streams);
    - ("sleep", seconds): answer VALID after that long without a byte (a cold server);
    - ("slow", (text, seconds)): stream `text` a few characters at a time, `seconds` between pieces;
    - ("whole", text): answer a plain completion object even when the request streams;
    - ("status", code): an error answer; ("raw", object): that JSON object as the body.

    `refuse` lists response_format types answered with 400 (not consuming the script)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host  # another of this machine's addresses: a server "off this host" as far as URLs tell
        self.script: list[tuple[str, object]] = []
        self.requests: list[dict] = []
        self.refuse: set[str] = set()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append({"headers": dict(request.headers), "body": body})
            kind = (body.get("response_format") or {}).get("type")
            if kind in self.refuse:
                return JSONResponse({"error": {"code": 400, "type": "invalid_request_error",
                                               "message": f"response_format type {kind!r} is not supported"}},
                                    status_code=400)
            kind, arg = self.script.pop(0) if self.script else ("reply", json.dumps(VALID))
            if kind == "status":
                return JSONResponse({"error": {"message": "internal error"}}, status_code=int(arg))
            if kind == "raw":
                return JSONResponse(arg)
            delay, pause = 0.0, 0.0
            if kind == "sleep":
                delay, kind, arg = float(arg), "reply", json.dumps(VALID)
            if kind == "slow":
                (arg, pause), kind = arg, "reply"
            if kind == "whole" or not body.get("stream"):
                await asyncio.sleep(delay)
                return _completion(body, str(arg))
            return StreamingResponse(_events(body, str(arg), delay, pause), media_type="text/event-stream")

        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def __enter__(self) -> ChatServer:
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _completion(body: dict, content: str) -> dict:
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}


async def _events(body: dict, content: str, delay: float, pause: float):
    """The chunks a streaming server sends: a role delta, content deltas, a finish, [DONE]."""
    await asyncio.sleep(delay)
    head = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": int(time.time()), "model": body["model"]}

    def event(delta: dict, finish: str | None = None) -> str:
        return "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    yield event({"role": "assistant", "content": ""})
    for i in range(0, len(content), 7):
        if pause:
            await asyncio.sleep(pause)
        yield event({"content": content[i:i + 7]})
    yield event({}, "stop")
    yield "data: [DONE]\n\n"
