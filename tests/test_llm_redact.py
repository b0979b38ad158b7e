"""What a hosted model is sent (logdx/diagnose/llm/redact.py): the log's machines, addresses, users,
e-mail addresses and secrets masked, consistently, and its answer read back with the names in place."""

from __future__ import annotations

import json
import socket

import pytest

from llm_server import ChatServer
from logdx.config import load_settings
from logdx.diagnose.llm import make_llm
from logdx.diagnose.llm.redact import Redactor, is_loopback_url, redacts
from logdx.incidents import Incident
from logdx.model import Action, Category
from logdx.pipeline import Engine

# A past incident near the job's stale mount (retrieval off: handed to the LLM as its example): the evidence
# that proposes the label the server answers (an answer nothing proposed would be an abstention).
STALE = Incident("inc-stale", "OSError: [Errno 116] Stale file handle: '/mnt/lustre/data/shard-0007'",
                 "OSError: [Errno <*>] Stale file handle: <*>", [], Category.INFRASTRUCTURE, "storage_error",
                 Action.RESTART)

HOSTS = ("gpu-node-07", "gpu-node-12")
SECRET = "hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
JOB = [
    *[f"{h}: [rank{r}]: step {s} | loss 2.{s} | lr 1e-4" for s in range(3) for r, h in enumerate(HOSTS)],
    "gpu-node-07:14400:14407 [0] NCCL INFO Bootstrap : Using ib0:10.31.4.17<0>",
    "gpu-node-12:14500:14507 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.31.4.22<0>",
    f"gpu-node-07: [rank0]: HF_TOKEN={SECRET} set from /home/jdoe/.cache/huggingface/token",
    "gpu-node-07: [rank0]: Traceback (most recent call last):",
    'gpu-node-07: [rank0]:   File "/home/jdoe/llm-pretrain/train.py", line 212, in <module>',
    "gpu-node-07: [rank0]:     batch = next(stream)",
    'gpu-node-07: [rank0]:   File "/opt/conda/lib/python3.10/site-packages/weka_io/reader.py", line 88, in __next__',
    "gpu-node-07: [rank0]:     raise WekaStaleMountError(self.mount)",
    "gpu-node-07: [rank0]: weka_io.errors.WekaStaleMountError: mount /mnt/weka on weka-01.storage.internal "
    "(10.31.9.5) went stale: backend lost quorum; mail jdoe@example.com",
]
NAMES = ("gpu-node-07", "gpu-node-12", "10.31.4.17", "10.31.4.22", "10.31.9.5", "jdoe", "jdoe@example.com",
         "weka-01.storage.internal", SECRET)


def test_the_same_name_gets_the_same_placeholder_and_reads_back():
    r = Redactor(HOSTS)
    masked = r.mask("rank 3 on gpu-node-07 (10.31.4.17) lost gpu-node-12; gpu-node-07 again, /home/jdoe/x.py by jdoe")
    assert masked == "rank 3 on <host-1> (<ip-1>) lost <host-2>; <host-1> again, /home/<user-1>/x.py by <user-1>"
    assert r.unmask("look at <host-1> and <ip-1>, not <host-9>") == "look at gpu-node-07 and 10.31.4.17, not <host-9>"
    assert "<secret>" in r.mask(f"token: {SECRET}") and SECRET not in r.unmask(r.mask(f"token: {SECRET}"))


@pytest.mark.parametrize("line", [
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "NCCL version 2.21.5+cuda12.4; torch 2.13.0; driver 550.54.15",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    'File "/opt/conda/lib/python3.10/site-packages/torch/nn/modules/module.py", line 1532, in _wrapped_call_impl',
])
def test_what_a_model_needs_to_read_the_failure_is_left_alone(line):
    assert Redactor(HOSTS).mask(line) == line


def test_only_an_endpoint_off_this_host_is_masked_by_default():
    assert is_loopback_url("http://127.0.0.1:8000/v1") and is_loopback_url("http://localhost:8080/v1")
    assert is_loopback_url("http://[::1]:8000/v1") and not is_loopback_url("https://api.openai.com/v1")
    assert redacts("auto", "https://api.example.com/v1") and not redacts("auto", "http://127.0.0.1:8000/v1")
    assert redacts("always", "http://127.0.0.1:8000/v1") and not redacts("never", "https://api.example.com/v1")


def _own_address() -> str | None:
    """One of this machine's addresses that is not loopback (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _engine(server: ChatServer, redact: str = "auto") -> Engine:
    s = load_settings(env={})
    s.retrieval.enabled = False
    s.llm.enabled = False
    engine = Engine.create(s)
    engine.diagnoser.llm = make_llm(s.llm.model_copy(update={
        "enabled": True, "backend": "openai", "base_url": server.base_url, "model": "test", "timeout_s": 5.0,
        "redact": redact}), examples=lambda ctx, exclude: [STALE])
    return engine


def _diagnose(engine: Engine):
    session = engine.new_session()
    session.feed_lines(JOB)
    return session.report(exit_code=1)


def _reply(explanation: str) -> str:
    return json.dumps({"category": "infrastructure", "failure_type": "storage_error", "action": "restart",
                       "confidence": 0.9, "root_line_no": 1, "explanation": explanation})


@pytest.mark.slow
def test_a_hosted_endpoint_receives_no_name_of_the_log_and_its_answer_reads_back():
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    with ChatServer(host=address) as server:
        server.script[:] = [("reply", _reply("The mount on <host-1> went stale (storage at <ip-1>); check <host-2>."))]
        report = _diagnose(_engine(server))
        assert len(server.requests) == 1
        sent = json.dumps(server.requests[0]["body"])
    assert "WekaStaleMountError" in sent and "went stale" in sent  # the failure is still there to read
    assert [n for n in NAMES if n in sent] == []
    assert "<host-1>" in sent and "<ip-1>" in sent and "/home/<user-1>/" in sent and "<email-1>" in sent
    # The answer names the machines again, as the log does.
    assert report.decided_by == "llm" and report.explanation is not None
    assert "<host-" not in report.explanation and "<ip-" not in report.explanation
    assert any(n in report.explanation for n in NAMES)


def test_a_loopback_server_is_sent_the_log_as_it_is():
    with ChatServer() as server:
        server.script[:] = [("reply", _reply("Storage went stale."))]
        _diagnose(_engine(server))
        sent = json.dumps(server.requests[0]["body"])
    assert "gpu-node-07" in sent and "10.31.9.5" in sent
