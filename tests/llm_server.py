"""A tiny OpenAI-compatible chat server on loopback for tests of the LLM stage (a helper module, not
collected as tests): it answers whatever the test scripts, like a real server that may say anything."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

VALID = {"category": "infrastructure", "failure_type": "ecc_error", "action": "cordon_and_restart",
         "confidence": 0.93, "root_line_no": 1, "explanation": "Uncorrectable ECC error on the GPU of rank 3."}


class ChatServer:
    """A tiny OpenAI-compatible /v1/chat/completions server on 127.0.0.1, run by uvicorn in a
    thread. Each request takes the next scripted behaviour: ("reply", text), ("sleep", seconds),
    ("status", code) or ("raw", body)."""

    def __init__(self) -> None:
        self.script: list[tuple[str, object]] = []
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append({"headers": dict(request.headers), "body": body})
            kind, arg = self.script.pop(0) if self.script else ("reply", json.dumps(VALID))
            if kind == "sleep":
                await asyncio.sleep(float(arg))
                arg, kind = json.dumps(VALID), "reply"
            if kind == "status":
                return JSONResponse({"error": {"message": "internal error"}}, status_code=int(arg))
            if kind == "raw":
                return JSONResponse(arg)
            return {
                "id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": arg}}],
            }

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

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


