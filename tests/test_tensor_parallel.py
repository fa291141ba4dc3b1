"""Tensor parallel: two ranks over MLX's ring backend on loopback, served over HTTP.

``vlm-serve --tensor-parallel 2`` is started as a real command (a launcher, rank 0
serving HTTP, rank 1 following), and its greedy answers to concurrent text and image
requests are compared with one-process serving of the same float32 tiny model: every
request must get the same text. Sampled, constrained and cancelled requests must leave
the ranks in step (a rank that took another step would hang the next all-reduce), and
a rank that dies or stops must end the server with an error naming it, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import data_url, free_port, make_image, wait_until

SETTINGS = ["--prefill-step-size", "32", "--prefill-token-budget", "32", "--max-num-seqs", "8"]
SETTINGS_KW = dict(prefill_step_size=32, prefill_token_budget=32, max_num_seqs=8)
LONG = " ".join(f"Line {i} says the {w} crossed the river." for i, w in enumerate(["fox", "heron", "kite"] * 5))


class GroupServer:
    """``vlm-serve --tensor-parallel 2`` in a subprocess, its output in a log file."""

    def __init__(self, model: Path, log: Path, *extra: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlm_serve.cli", "--model", str(model), "--port", str(self.port),
             "--tensor-parallel", "2", "--served-model-name", "tp", "--log-level", "warning",
             *SETTINGS, *extra],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the group exited ({self.proc.returncode}):\n{self.log}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the group did not start:\n{self.log}")

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(self.base_url + "/health", timeout=5).json()

    def follower_pid(self) -> int:
        return self.health()["tensor_parallel"]["followers"][0]["pid"]

    def leader_pid(self) -> int:
        """Rank 0: the launcher's child that is not rank 1."""
        follower = self.follower_pid()
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return next(int(pid) for pid in children if int(pid) != follower)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=120)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the group did not end within {timeout} s:\n{self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def requests_for(arch: str) -> list[dict]:
    """Chat requests of every kind: short and long text, one and two images of
    different sizes, different lengths of answer (rows leave at different steps)."""
    size = {"gemma3": (28, 28), "qwen2_5_vl": (56, 84), "qwen2_vl": (56, 84)}[arch]
    big = {"gemma3": (40, 30), "qwen2_5_vl": (112, 112), "qwen2_vl": (112, 112)}[arch]
    image = lambda s, seed: {"type": "image_url", "image_url": {"url": data_url(make_image(*s, seed=seed))}}
    out = []
    for i, text in enumerate(["Hello there.", "Write about a ship.", LONG, "What is two plus two?"]):
        out.append({"messages": [{"role": "user", "content": text}], "max_tokens": 6 + 3 * i})
    out.append({"messages": [{"role": "user", "content": [image(size, 1), {"type": "text", "text": "Describe it."}]}],
                "max_tokens": 10})
    out.append({"messages": [{"role": "user", "content": [
        image(big, 2), image(size, 3), {"type": "text", "text": "Compare the two pictures. " + LONG[:200]}]}],
        "max_tokens": 14})
    out.append({"messages": [
        {"role": "user", "content": [image(size, 4), {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Tell me more."}], "max_tokens": 8})
    return out


def answer(client, model: str, request: dict) -> tuple:
    out = client.chat.completions.create(model=model, temperature=0, **request)
    choice = out.choices[0]
    return choice.message.content, choice.finish_reason, out.usage.completion_tokens


def concurrently(fn, items: list) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


class Groups:
    """One two-rank server per architecture, started on first use and shared by the
    module's tests; the tests that break a group take it last (``take``)."""

    def __init__(self, model_path, tmp_dir: Path):
        self.model_path, self.tmp_dir = model_path, tmp_dir
        self.started: dict[str, GroupServer] = {}

    def __call__(self, arch: str) -> GroupServer:
        if arch not in self.started:
            # A timeout short enough to test a hang, long enough for a loaded machine;
            # Gemma's group also stops requests after 8 s (rank 0 decides, in its plan).
            extra = ["--request-timeout", "8"] if arch == "gemma3" else []
            self.started[arch] = GroupServer(self.model_path(arch), self.tmp_dir / f"{arch}.log",
                                             "--tensor-parallel-timeout", "10", *extra)
        return self.started[arch]

    def take(self, arch: str) -> GroupServer:
        group = self(arch)
        del self.started[arch]
        return group


@pytest.fixture(scope="module")
def groups(model_path, tmp_path_factory):
    groups = Groups(model_path, tmp_path_factory.mktemp("tp"))
    yield groups
    for server in groups.started.values():
        server.stop()


SLOW = pytest.mark.skipif(not os.environ.get("VLM_SERVE_SLOW_TESTS"), reason="VLM_SERVE_SLOW_TESTS=1")


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl", pytest.param("qwen2_vl", marks=SLOW)])
def test_two_ranks_answer_as_one_process(arch, groups, start_server):
    """Greedy answers to concurrent text and image requests, TP=2 against TP=1."""
    group = groups(arch)
    single = start_server(arch, **SETTINGS_KW)
    requests = requests_for(arch)
    tp_client, one_client = group.client(), single.client()
    # Both servers at once: each batches the requests as they arrive.
    with ThreadPoolExecutor(2) as pool:
        tp = pool.submit(concurrently, lambda r: answer(tp_client, "tp", r), requests)
        one = pool.submit(concurrently, lambda r: answer(one_client, f"tiny-{arch}", r), requests)
        tp, one = tp.result(), one.result()
    assert len({text for text, _, _ in one}) == len(requests)  # a test that can tell them apart
    for request, mine, reference in zip(requests, tp, one):
        assert mine == reference, request["messages"][-1]
    completion = dict(prompt="Once upon a time", max_tokens=9, temperature=0)
    assert (tp_client.completions.create(model="tp", **completion).choices[0].text
            == one_client.completions.create(model=f"tiny-{arch}", **completion).choices[0].text)
    assert group.health()["status"] == "ok"
    # The follower's state as its next heartbeat (one a second) tells it.
    follower = lambda: group.health()["tensor_parallel"]["followers"][0]
    wait_until(lambda: follower()["state"] == "serving" and follower()["turn"] > 0)
    # Both ranks decoded through the engine's fused step, not the model-code fallback.
    assert "no engine decode step" not in group.log
    assert "Traceback" not in group.log


def test_ranks_stay_in_step_through_sampling_grammar_cancels_and_timeouts(groups):
    """Sampled (seeded and not), n > 1, JSON-constrained, cancelled and timed-out
    requests run on both ranks alike; greedy answers afterwards equal those before."""
    from openai import APIStatusError

    group = groups("gemma3")
    client = group.client()
    probe = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    before = answer(client, "tp", probe)
    chat = lambda **kw: client.chat.completions.create(
        model="tp", messages=[{"role": "user", "content": "Say something."}], **kw)

    def cancelled():
        # Read two chunks, then hang up: the request leaves the batch mid-decode.
        with httpx.stream("POST", group.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tp", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Go on and on."}],
        }) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 2:
                    break
        return "cancelled"

    def timed_out():
        # Runs until --request-timeout: rank 0's clock ends it, the followers its plan.
        with pytest.raises(APIStatusError) as failure:
            chat(temperature=0, max_tokens=100000, extra_body={"ignore_eos": True})
        return failure.value.status_code

    jobs = [
        lambda: chat(temperature=1.0, max_tokens=12),
        lambda: chat(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
        lambda: chat(temperature=1.0, n=2, max_tokens=10, frequency_penalty=0.5),
        lambda: chat(temperature=0.7, max_tokens=30, response_format={"type": "json_object"}),
        cancelled,
        lambda: chat(temperature=0, max_tokens=10, logprobs=True, top_logprobs=3),
        timed_out,
    ]
    results = concurrently(lambda job: job(), jobs)
    assert all(results) and results[-1] == 504
    seeded = chat(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    assert seeded.choices[0].message.content == results[1].choices[0].message.content
    assert answer(client, "tp", probe) == before
    assert group.health()["status"] == "ok"


def _ends_with_error(group: GroupServer, act, *expect: str, timeout: float = 60) -> None:
    """Start a long stream, ``act`` on a rank, and expect the stream to end (an error
    event, or the connection closing as the server exits), the whole group to exit
    with a failure status and the log to say one of ``expect``."""
    from openai import APIError

    stream = group.client().chat.completions.create(
        model="tp", messages=[{"role": "user", "content": "Talk."}], max_tokens=100000,
        stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    act()
    with pytest.raises((APIError, httpx.HTTPError)) as failure:
        for _ in stream:
            pass
    if isinstance(failure.value, APIError) and failure.value.message:
        assert "tensor-parallel group failed" in failure.value.message
    assert group.wait_exit(timeout) != 0
    assert any(reason in group.log for reason in expect), group.log


def test_a_follower_that_dies_ends_the_server(groups):
    group = groups.take("qwen2_5_vl")
    try:
        _ends_with_error(group, lambda: os.kill(group.follower_pid(), signal.SIGKILL),
                         "tensor-parallel group failed: rank 1 disconnected")
    finally:
        group.stop()


def test_a_follower_that_hangs_ends_the_server(groups):
    group = groups.take("gemma3")
    pid = group.follower_pid()
    try:
        # Whichever notices first: its heartbeats stopped, or rank 0's turn waits on it.
        _ends_with_error(group, lambda: os.kill(pid, signal.SIGSTOP), "rank 1 sent nothing",
                         "a rank is stuck in a collective")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        group.stop()


@SLOW
def test_followers_end_when_rank_0_dies(model_path, tmp_path):
    group = GroupServer(model_path("gemma3"), tmp_path / "log", "--tensor-parallel-timeout", "20")
    try:
        os.kill(group.leader_pid(), signal.SIGKILL)
        assert group.wait_exit(30) != 0
        assert "rank 1: lost rank 0" in group.log, group.log
    finally:
        group.stop()


# -- the control channel itself, on real sockets -------------------------------------------

def _leader_and_follower(timeout: float = 5.0):
    """A leader channel and a follower channel joined by a real loopback connection."""
    import socket
    import threading

    from vlm_serve.distributed import control

    token = b"0123456789abcdef"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    failures: list[str] = []
    accepted = {}
    thread = threading.Thread(target=lambda: accepted.update(
        control.accept_followers(listener, 2, token, timeout)))
    thread.start()
    sock = control.connect_leader("127.0.0.1", port, 1, token, timeout)
    thread.join()
    leader = control.LeaderChannel(accepted, timeout, failures.append)
    follower = control.FollowerChannel(sock, 1, timeout, failures.append)
    return leader, follower, failures


def test_control_channel_carries_plans_and_catches_a_follower_that_went_its_own_way():
    import numpy as np

    from vlm_serve.distributed.replica import Remove
    from vlm_serve.engine.scheduler import Submit
    from vlm_serve.engine.types import FinishReason, PreparedRequest, SamplingParams

    leader, follower, failures = _leader_and_follower()
    try:
        request = PreparedRequest("r1", np.arange(5, dtype=np.int32), SamplingParams(seed=3),
                                  {"pixel_values": np.ones((1, 3, 4, 4), np.uint8)}, num_images=1,
                                  pixel_table=np.linspace(-1, 1, 3 * 256, dtype=np.float32).reshape(3, 256))
        plan = [Submit(request), Remove("r0", FinishReason.TIMEOUT, "request timed out")]
        leader.broadcast(plan)
        got = follower.receive(5)
        assert got[1] == plan[1] and got[0].request.sampling == request.sampling
        assert np.array_equal(got[0].request.model_inputs["pixel_values"], request.model_inputs["pixel_values"])
        assert np.array_equal(got[0].request.pixel_table, request.pixel_table)
        # Same tokens before turn 1: heartbeats agree.
        leader.begin_turn(digest=11)
        follower.mark = (1, 11)
        wait_until(lambda: leader.seen[1].get("turn") == 1)
        assert not failures
        # Other tokens before turn 2: rank 0 says so.
        leader.begin_turn(digest=12)
        follower.mark = (2, 99)
        wait_until(lambda: failures)
        assert "rank 1 sampled other tokens than rank 0 before turn 2" in failures[0]
    finally:
        follower.close()
        leader.close()


def test_control_channel_admits_only_the_group_and_only_plan_types():
    import pickle
    import socket
    import threading

    from vlm_serve.distributed import control

    token = b"0123456789abcdef"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = {}
    thread = threading.Thread(target=lambda: accepted.update(
        control.accept_followers(listener, 2, token, 10)))
    thread.start()
    # A stranger without the token is turned away; the rank with it gets in.
    with pytest.raises(control.GroupFailed):
        control.connect_leader("127.0.0.1", port, 1, b"not-the-token!!!", 5)
    sock = control.connect_leader("127.0.0.1", port, 1, token, 5)
    thread.join()
    assert list(accepted) == [1]
    # A frame that would call anything but plan types does not unpickle.
    data = pickle.dumps(os.system)
    accepted[1].sendall(control._HEADER.pack(len(data)) + data)
    with pytest.raises(pickle.UnpicklingError):
        control.recv(sock)
    sock.close()
    accepted[1].close()


def test_models_that_cannot_be_split_evenly_are_refused_before_loading_a_shard(model_path):
    """An unverified family, or quantization groups that do not divide among the ranks,
    is a one-line startup error, not a wrong answer."""
    from mlx_vlm import load

    from vlm_serve.distributed.shard import CannotShard, check
    from vlm_serve.fixtures.build import cached_model

    model, _ = load(str(model_path("gemma3")), lazy=True)
    check(model, 2)
    with pytest.raises(CannotShard, match="n_kv_heads=2 does not divide into 4 ranks"):
        check(model, 4)
    quantized, _ = load(str(cached_model("gemma3", bits=4)), lazy=True)  # 64-wide groups
    with pytest.raises(CannotShard, match="o_proj has 1 quantization groups per row"):
        check(quantized, 2)
    other, _ = load(str(model_path("llava")), lazy=True)
    with pytest.raises(CannotShard, match="not verified for model type 'llava'"):
        check(other, 2)


def test_two_ranks_answer_as_one_process_quantized(model_path, tmp_path, start_server):
    """4-bit (32-wide groups, so o/down split evenly): TP=2 against TP=1, greedy."""
    from vlm_serve.fixtures.build import quantize_model

    quantized = quantize_model(model_path("gemma3"), tmp_path / "q4", bits=4, group_size=32)
    group = GroupServer(quantized, tmp_path / "log")
    try:
        from vlm_serve.config import ServerConfig
        from conftest import RunningServer

        single = RunningServer(ServerConfig(model=str(quantized), served_model_name="one",
                                            port=free_port(), log_level="warning", **SETTINGS_KW))
        try:
            requests = requests_for("gemma3")
            tp = concurrently(lambda r: answer(group.client(), "tp", r), requests)
            one = concurrently(lambda r: answer(single.client(), "one", r), requests)
            assert tp == one
        finally:
            single.stop()
    finally:
        group.stop()
