"""Remote rewards: the reference server (`python common.py serve-reward`) started as a real process on loopback
gives the in-process scores; a dead server, and a server whose answer is wrong, stop the run with one clear
line instead of a zero reward."""
import base64
import contextlib
import http.client
import importlib
import io
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import flow_grpo
import helpers
from helpers import ROOT, SMALL, read_metrics, run, tiny_argv, torchrun_cmd, trained_params


@pytest.fixture(scope="module")
def server():
    """`python common.py serve-reward --reward jpeg --port 0` in its own process; yields its URL."""
    cmd = [sys.executable, str(ROOT / "common.py"), "serve-reward", "--reward", "jpeg", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = proc.stdout.readline()
    assert line.startswith("serving jpeg at http://127.0.0.1:"), line + proc.stdout.read()
    yield line.split()[-1]
    proc.kill()
    proc.wait()


def images(n=5, seed=0) -> torch.Tensor:
    """8-bit images as floats: what travels over the wire, so in-process and remote scores can be equal."""
    x = torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return (x * 255).round() / 255


def test_the_reference_server_gives_the_in_process_scores(server):
    prompts = [f"prompt {i}" for i in range(5)]
    remote = common.RemoteReward(server)(images(), prompts)
    torch.testing.assert_close(remote, common.JpegCompressibility()(images(), prompts), rtol=0, atol=1e-6)
    # through --reward: a weight after the name, and a sum with an in-process scorer
    assert common.parse_reward_spec(f"remote:{server}:0.5,jpeg") == [(f"remote:{server}", 0.5), ("jpeg", 1.0)]
    total, parts = common.WeightedReward(common.parse_reward_spec(f"remote:{server}:0.5,jpeg"))(images(), prompts)
    torch.testing.assert_close(total, 1.5 * parts["jpeg"], rtol=1e-6, atol=1e-5)
    with pytest.raises(common.TrainingStopped, match="answered HTTP 404: .*this server scores 'jpeg'"):
        common.RemoteReward(server.replace("/jpeg", "/pickscore"))(images(), prompts)


def test_a_trainer_trains_with_a_remote_reward(server, tmp_path):
    run(flow_grpo, [*tiny_argv("flow_grpo", "flux"), "--reward", f"remote:{server}", "--eval-every", "1",
                    "--output-dir", str(tmp_path / "r")])
    lines = read_metrics(tmp_path / "r")
    assert all(math.isfinite(m["reward_mean"]) and m["reward_calls"] == 4 for m in lines[:-1])
    assert math.isfinite(lines[-1]["eval_reward"])


def test_a_dead_server_stops_the_run_within_the_retries():
    with socket_port() as port:
        pass                                               # a port nobody listens on
    reward = common.RemoteReward(f"http://127.0.0.1:{port}/jpeg", timeout=1.0, retries=2, backoff=0.1)
    tic = time.time()
    with pytest.raises(common.TrainingStopped, match=f"reward server http://127.0.0.1:{port}/jpeg did not answer"):
        reward(images(2), ["a", "b"])
    assert time.time() - tic < 5


@pytest.mark.parametrize("reply,what", [
    ({"scores": [1.0]}, "wrong count"),
    ({"scores": [1.0, float("nan")]}, "NaN"),
    ({"scores": [1.0, "high"]}, "not a number"),
    ({"result": [1.0, 2.0]}, "no scores"),
    ("<html>busy</html>", "not JSON"),
    ({"scores": [1.0, 1e39]}, "finite in Python, inf in float32"),
    ({"scores": ["0.5", 1.0]}, "a string"),
    ({"scores": [True, 1.0]}, "a boolean"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep for json (a RecursionError)"),
])
def test_a_wrong_answer_is_an_error_never_a_zero(reply, what):
    with fake_server(reply) as url:
        with pytest.raises(common.TrainingStopped, match=f"reward server {url} sent .* expected .*2 finite numbers"):
            common.RemoteReward(url, timeout=5, retries=0)(images(2), ["a", "b"])


def http_reply(status: int, body) -> bytes:
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    return f"HTTP/1.0 {status} X\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


OK = http_reply(200, {"scores": [1.0, 2.0]})
CUT_SHORT = b'HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{"sco'       # 5 of the 100 bytes promised


@pytest.mark.parametrize("first,what", [
    (http_reply(503, "overloaded"), "HTTP 503"),
    (http_reply(502, "bad gateway"), "HTTP 502"),
    (CUT_SHORT, "a reply cut short"),
    (http_reply(200, "<html>proxy error</html>"), "not JSON"),
    (b"", "no reply at all"),
])
def test_a_failed_request_is_retried(first, what):
    with raw_server([first, OK]) as server:
        scores = common.RemoteReward(server.url, timeout=5, retries=2, backoff=0.01)(images(2), ["a", "b"])
    assert scores.tolist() == [1.0, 2.0] and server.requests == 2, what


def test_a_request_the_server_refuses_stops_at_once_and_failures_stop_after_the_retries():
    with raw_server([http_reply(400, "bad image")]) as server:
        with pytest.raises(common.TrainingStopped, match="answered HTTP 400: bad image$"):
            common.RemoteReward(server.url, timeout=5, retries=3, backoff=0.01)(images(2), ["a", "b"])
    assert server.requests == 1
    with raw_server([http_reply(503, "overloaded")]) as server:
        with pytest.raises(common.TrainingStopped, match=r"answered HTTP 503: overloaded \(3 tries, a 5 s deadline"):
            common.RemoteReward(server.url, timeout=5, retries=2, backoff=0.01)(images(2), ["a", "b"])
    assert server.requests == 3


@pytest.mark.parametrize("in_the_body", [False, True])
def test_a_server_that_sends_a_byte_now_and_then_trips_the_deadline(in_the_body):
    """One byte every 0.2 s never trips a 1 s socket timeout, which restarts with each read: the deadline does, in
    the headers or in the body of an HTTP/1.0 reply (read after http.client hands the connection to the reply)."""
    with raw_server([DRIP_BODY if in_the_body else DRIP]) as server:
        tic = time.time()
        with pytest.raises(common.TrainingStopped, match=r"did not answer \(TimeoutError: no complete reply within "
                                                         r"1 s\) \(2 tries"):
            common.RemoteReward(server.url, timeout=1, retries=1, backoff=0.01)(images(2), ["a", "b"])
    assert time.time() - tic < 8 and server.requests == 2  # 2 s of deadlines; a drip read to its end takes longer


def test_a_failing_reward_server_stops_the_run_with_a_checkpoint_of_the_last_iteration(tmp_path, capsys, monkeypatch):
    """SMALL: 2 scoring requests per iteration. The 3rd request gets a 503 and its retry goes through (the run goes
    on); from the 6th on every request fails, so iteration 2's rewards never come: the run stops with exit status 1,
    after checkpointing the state after iterations 0 and 1, the same as a straight 2-iteration run's."""
    monkeypatch.setattr(common.RemoteReward.__init__, "__defaults__", ("cpu", 5.0, 2, 0.01))  # 3 tries, short waits

    def scores(body):
        return {"scores": [float(i % 3) for i in range(len(body["images"]))]}
    server = fake_server(lambda body: (503, "overloaded") if len(server.bodies) in (3, 6, 7, 8) else scores(body))
    r, straight = tmp_path / "r", tmp_path / "straight"
    argv = [*SMALL, "--eval-every", "0", "--iterations", "4"]
    with server as url, pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*argv, "--reward", f"remote:{url}", "--output-dir", str(r)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"{Path(sys.argv[0]).name}: the reward failed reward server {url} answered HTTP 503: overloaded "
        f"(3 tries, a 5 s deadline each); expected {{\"scores\": [4 finite numbers]}}: check that it runs (python "
        f"common.py serve-reward) at the URL in --reward; checkpoint iter_000002 saved: continue with --resume {r}")
    assert len(server.bodies) == 8 and [m["iteration"] for m in read_metrics(r)] == [0, 1]
    with fake_server(scores) as url:
        run(flow_grpo, [*argv, "--iterations", "2", "--reward", f"remote:{url}", "--output-dir", str(straight)])
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 2), trained_params(straight, 2)))


def npy(array) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def post(url: str, body: bytes, length: int | None = None) -> tuple[int, dict]:
    """POSTs raw bytes (with a Content-Length of `length` if given); returns the status and the JSON answer."""
    host, port = url.split("/")[2].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/jpeg")
    conn.putheader("Content-Length", str(len(body) if length is None else length))
    conn.endheaders(body)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


def test_the_server_answers_400_to_a_bad_request_413_to_a_huge_one_and_drops_stalled_clients(tmp_path):
    cmd = [sys.executable, str(ROOT / "common.py"), "serve-reward", "--reward", "jpeg", "--port", "0", "--timeout",
           "1", "--max-request-mb", "1"]
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        while "serving" not in (tmp_path / "server.log").read_text() and proc.poll() is None:
            time.sleep(0.1)
        url = (tmp_path / "server.log").read_text().split()[-1]
        port = int(url.split(":")[2].split("/")[0])
        good = np.zeros((8, 8, 3), np.uint8)

        def batch(ims, prompts=None):
            return json.dumps({"images": [npy(x) for x in ims], "prompts": prompts or ["p"] * len(ims)}).encode()
        bad = {
            "not JSON": b'{"images": [',
            "not an object": b"[1, 2]",
            "no images": batch([]),
            "float64": batch([good.astype(np.float64)]),
            "NaN": batch([np.full((8, 8, 3), np.nan, np.float32)]),
            "uint16": batch([good.astype(np.uint16)]),
            "complex": batch([good.astype(np.complex64)]),
            "2-D": batch([good[..., 0]]),
            "4 channels": batch([np.zeros((8, 8, 4), np.uint8)]),
            "two sizes": batch([good, np.zeros((4, 4, 3), np.uint8)]),
            "a pickle": batch([np.array([{"x": 1}], dtype=object)]),
            "fewer prompts": batch([good, good], ["p"]),
            "a prompt not a string": batch([good], [5]),
            "prompts not a list": json.dumps({"images": [npy(good)], "prompts": "p"}).encode(),
            "fewer metadata": json.dumps({"images": [npy(good)] * 2, "prompts": ["p"] * 2, "metadata": [{}]}).encode(),
            "not base64": json.dumps({"images": ["%%%"], "prompts": ["p"]}).encode(),
        }
        for what, body in bad.items():
            status, answer = post(url, body)
            assert status == 400 and answer["error"], what
        assert post(url, b"{}", length=2**21) == (413, {"error": f"{2**21} bytes is more than --max-request-mb 1"})
        for head in [b"POST /jpeg HTTP/1.0\r\n\r\n", b"POST /jpeg HTTP/1.0\r\nContent-Length: many\r\n\r\n"]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                client.sendall(head)
                assert client.makefile("rb").read().startswith(b"HTTP/1.0 400 "), head  # no Content-Length: a 400
        for head in [b"", b"POST /jpeg HTTP/1.0\r\nContent-Length: 100\r\n\r\nab"]:  # then nothing
            with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
                stalled.sendall(head)
                tic = time.time()
                assert stalled.recv(100) == b"" and 0.8 < time.time() - tic < 5, head  # dropped after --timeout 1
        status, answer = post(url, batch([good, good]))
        assert status == 200 and len(answer["scores"]) == 2                        # and still serving
    finally:
        proc.kill()
        proc.wait()
    out = (tmp_path / "server.log").read_text()
    assert "Traceback" not in out and out.count("Request timed out") == 2, out


def start_server(log_path, *flags) -> tuple[subprocess.Popen, str]:
    """`python common.py serve-reward --reward jpeg --port 0 FLAGS`, its output in log_path; (process, URL)."""
    cmd = [sys.executable, str(ROOT / "common.py"), "serve-reward", "--reward", "jpeg", "--port", "0", *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 120
    while "serving" not in Path(log_path).read_text():
        assert proc.poll() is None and time.time() < deadline, Path(log_path).read_text()
        time.sleep(0.1)
    return proc, Path(log_path).read_text().split()[-1]


def test_a_request_over_max_request_mb_stops_the_client_at_once_with_the_413(tmp_path, monkeypatch):
    """The server answers 413 before it reads the body (RemoteReward's request is far larger than the socket
    buffers, so the client's send fails first): the client reads the answer and stops at once with its reason."""
    proc, url = start_server(tmp_path / "server.log", "--max-request-mb", "1")
    tries, post_once = [], common._post
    monkeypatch.setattr(common, "_post", lambda *a: tries.append(1) or post_once(*a))
    try:
        for _ in range(3):
            tries.clear()
            with pytest.raises(common.TrainingStopped) as stop:
                common.RemoteReward(url, retries=3, backoff=0.01)(torch.rand(8, 3, 512, 512), ["p"] * 8)
            assert re.fullmatch(rf"reward server {url} answered HTTP 413: {{\"error\": \"\d+ bytes is more than "
                                rf"--max-request-mb 1\"}}", str(stop.value)), str(stop.value)
            assert len(tries) == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_malformed_content_length_is_a_400_and_a_client_that_resets_is_one_log_line(tmp_path):
    proc, url = start_server(tmp_path / "server.log", "--timeout", "5")
    port = int(url.split(":")[2].split("/")[0])
    try:
        for length in ["\u00b2", "1\u0661", "9" * 5000, "-1", "0x10"]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                client.sendall(f"POST /jpeg HTTP/1.0\r\nContent-Length: {length}\r\n\r\n{{}}".encode())
                assert client.makefile("rb").read().startswith(b"HTTP/1.0 400 "), length
        for head in [b"POST /jpeg HTTP/1.0\r\nContent-Le", b"POST /jpeg HTTP/1.0\r\nContent-Length: 100\r\n\r\nab"]:
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
            client.sendall(head)
            time.sleep(0.5)
            client.close()
        time.sleep(1)
        status, answer = post(url, json.dumps({"images": [npy(np.zeros((8, 8, 3), np.uint8))],
                                               "prompts": ["p"]}).encode())
        assert status == 200 and len(answer["scores"]) == 1                        # still serving
    finally:
        proc.kill()
        proc.wait()
    out = (tmp_path / "server.log").read_text()
    assert "Traceback" not in out and out.count("ConnectionResetError") == 2, out
    assert len(out.splitlines()) == 3, out                                          # serving, then a line each


@pytest.mark.parametrize("flags,message", [
    (["--timeout", "-1"], "error: --timeout -1.0 must be at least 0.001"),
    (["--max-request-mb", "nan"], "error: --max-request-mb nan must be at least 0.001 (it is not a number)"),
    (["--max-request-mb", "-1"], "error: --max-request-mb -1.0 must be at least 0.001"),
    (["--reward", "bogus"], "error: argument --reward: invalid choice: 'bogus'"),
    (["--host", "no-such-host.invalid"], "cannot serve at no-such-host.invalid:8000 ([Errno -2] Name or service not "
                                         "known): pass another --port or --host"),
    (["--port", "BUSY"], "Address already in use): pass another --port or --host"),
    (["--port", "70000"], "cannot serve at 127.0.0.1:70000 (bind(): port must be 0-65535.)"),
    (["--device", "bogus"], "error: --device bogus cannot be used (RuntimeError: Expected one of cpu"),
    (["--device", "cuda"], "error: --device cuda cannot be used ("),    # this machine has no GPU: every request a 500
    (["--device", "cpu:x"], "error: --device cpu:x cannot be used ("),
    (["--timeout", "1e10"], "error: --timeout 10000000000.0 must be at least 0.001 and at most 1000000000.0"),
])
def test_the_server_refuses_an_address_it_cannot_serve_in_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setitem(common.REWARDS, "jpeg", lambda device: pytest.fail("the scorer loaded"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        flags = [str(busy.getsockname()[1]) if f == "BUSY" else f for f in flags]
        with pytest.raises(SystemExit) as stop:
            common.serve_reward(["--reward", "jpeg", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("common.py serve-reward: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_prompt_metadata_reaches_the_remote_scorer_from_a_training_run(tmp_path):
    """GenEval-style records (prompt plus tags) in a .jsonl prompt file arrive at the server with their images, each
    image with its own prompt's record, in training and in evaluation."""
    records = [{"prompt": f"a {color} {shape}", "tag": "colors", "include": [{"class": shape, "color": color}]}
               for color, shape in [("red", "circle"), ("blue", "square"), ("green", "cross"), ("white", "circle")]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    server = fake_server(lambda body: {"scores": list(range(len(body["images"])))})  # image i of a batch scores i
    bodies = server.bodies
    with server as url:
        run(flow_grpo, ["--reward", f"remote:{url}", "--prompts", str(tmp_path / "p.jsonl"), *SMALL, "--iterations",
                        "1", "--output-dir", str(tmp_path / "r")])
    by_prompt = {r["prompt"]: r for r in records}
    assert bodies and sum(len(b["images"]) for b in bodies) >= 4
    for body in bodies:
        assert len(body["metadata"]) == len(body["prompts"]) == len(body["images"])
        assert all(m == by_prompt[p] for m, p in zip(body["metadata"], body["prompts"]))


def test_per_reward_normalisation_by_hand():
    """Two rewards, groups of 2: per-reward sums each reward's own group advantage with the weights; sum takes the
    advantage of the weighted sum (flow_grpo's group advantage: population std + 1e-4)."""
    toy, jpeg = [0.0, 1.0, 0.5, 0.5], [3.0, 1.0, 2.0, 6.0]
    parts = {"toy": torch.tensor(toy), "jpeg": torch.tensor(jpeg)}

    def by_hand(r):  # groups (r0, r1), (r2, r3): (r - mean) / (|a - b| / 2 + 1e-4)
        out = []
        for a, b in [(r[0], r[1]), (r[2], r[3])]:
            d = abs(a - b) / 2 + 1e-4
            out += [(a - (a + b) / 2) / d, (b - (a + b) / 2) / d]
        return out
    fn = lambda r: flow_grpo.group_advantages(r, 2, global_std=False)  # noqa: E731
    per = common.WeightedReward(common.parse_reward_spec("toy,jpeg:0.5"), norm="per-reward").advantages(parts, fn)
    expected = [x + 0.5 * y for x, y in zip(by_hand(toy), by_hand(jpeg))]
    assert per.tolist() == pytest.approx(expected, abs=1e-5)
    summed = common.WeightedReward(common.parse_reward_spec("toy,jpeg:0.5"), norm="sum").advantages(parts, fn)
    assert summed.tolist() == pytest.approx(by_hand([t + 0.5 * j for t, j in zip(toy, jpeg)]), abs=1e-5)


def test_a_run_with_two_rewards_logs_each_one(tmp_path):
    run(flow_grpo, ["--reward", "toy,jpeg:0.5", "--reward-norm", "per-reward", *SMALL, "--iterations", "1",
                    "--output-dir", str(tmp_path / "r")])
    first = read_metrics(tmp_path / "r")[0]
    assert first["reward_mean"] == pytest.approx(first["reward_toy"] + 0.5 * first["reward_jpeg"], abs=1e-5)
    assert first["eval_reward"] == pytest.approx(first["eval_toy"] + 0.5 * first["eval_jpeg"], abs=1e-5)
    assert first["reward_jpeg"] < 0 and first["eval_reward_se"] > 0


def test_a_reward_weight_beyond_float32_is_refused():
    big = torch.finfo(torch.float32).max
    assert common.parse_reward_spec(f"toy:{big!r},jpeg:-3e38") == [("toy", big), ("jpeg", -3e38)]
    for spec in ["toy:1e39", "jpeg:-3.5e38", "toy,remote:http://h:1/x:4e38"]:
        with pytest.raises(common.UsageError, match=r"weight \S+ for reward .* is beyond float32"):
            common.parse_reward_spec(spec)


def test_bad_remote_specs_name_the_syntax():
    for spec in ["remote:127.0.0.1:8000/jpeg", "remote:http://127.0.0.1:8000/", "remote:http://h:1/x:heavy",
                 "remote:http://[::1/x", "remote:http://127.0.0.1:99999/x", "remote:http://127.0.0.1:0/x",
                 "remote:http://127.0.0.1:port/x", "remote:http://:8000/x", "remote:http://[::1]:65536/x"]:
        with pytest.raises(common.UsageError, match="remote:http://HOST:PORT/NAME|bad weight"):
            common.parse_reward_spec(spec)
    assert common.parse_reward_spec("remote:http://[::1]:65535/x:2") == [("remote:http://[::1]:65535/x", 2.0)]


@pytest.mark.parametrize("url", ["http://[::1/x", "http://127.0.0.1:99999/x"])
def test_a_remote_url_that_does_not_parse_is_refused_before_anything_is_built(url, tmp_path, capsys, monkeypatch):
    """Before: it passed the start-up, the model loaded, and four tries failed as "not JSON" or as a traceback."""
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       ["--reward", f"remote:{url}", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"bad or repeated remote reward 'remote:{url}'" in err, err
    assert "(a PORT in 1-65535)" in err and len(err.splitlines()) == 1 and not (tmp_path / "r").exists()


# ---- helpers ----
class socket_port:
    """A free TCP port on loopback (bound, then released on exit)."""

    def __enter__(self):
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.sock.close()


DRIP = object()  # raw_server's reply: a status line and a header sent one byte every 0.2 s, for ever
DRIP_BODY = object()  # raw_server's reply: HTTP/1.0 headers promising 100 bytes, then a byte of them every 0.2 s


class raw_server:
    """A TCP server in a thread that reads each HTTP request whole and answers the n-th with replies[n] (the last one
    again after the list ends): raw bytes, sent as they are before the connection closes, or DRIP. Counts the
    requests (`requests`); its URL is `url`."""

    def __init__(self, replies: list):
        self.replies, self.requests, self.stop = replies, 0, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/judge"

    def __enter__(self):
        threading.Thread(target=self.serve, daemon=True).start()
        return self

    def serve(self):
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                reply = self.replies[min(self.requests, len(self.replies) - 1)]
                self.requests += 1
                threading.Thread(target=self.answer, args=(conn, reply), daemon=True).start()

    def answer(self, conn, reply):
        with conn, contextlib.suppress(OSError):
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            size = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))
            while len(body) < size:
                body += conn.recv(65536)
            if reply not in (DRIP, DRIP_BODY):
                return conn.sendall(reply)
            conn.sendall(b"HTTP/1.0 200 OK\r\nX-Slow: " if reply is DRIP else
                         b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n")
            while not self.stop.wait(0.2):
                conn.sendall(b"a")

    def __exit__(self, *exc):
        self.stop.set()
        self.sock.close()


class fake_server:
    """An HTTP server in a thread that keeps every request's JSON body (`bodies`) and answers each POST with
    `reply`: JSON unless it is a string, or reply(body) when it is a function, which may also return (HTTP status,
    answer)."""

    def __init__(self, reply):
        self.bodies = bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer, status = reply, 200
                if callable(reply):
                    bodies.append(json.loads(raw))
                    answer = reply(bodies[-1])
                    status, answer = answer if isinstance(answer, tuple) else (200, answer)
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/judge"

    def __exit__(self, *exc):
        self.server.shutdown()


def failing_reward(rank: str):
    """The toy reward, raising on its third call (iteration 1's first batch) in the process of the given rank."""
    class Failing(common.ToyReward):
        calls = 0

        def __call__(self, images, prompts, metadata=None):
            Failing.calls += 1
            if Failing.calls == 3 and os.environ.get("RANK") == rank:
                raise RuntimeError("the scorer ran out of memory")
            return super().__call__(images, prompts, metadata)
    return Failing


def test_a_reward_failure_on_one_rank_stops_both_with_its_message(tmp_path):
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "import common, flow_grpo\nfrom test_rewards import failing_reward\n"
                      "common.REWARDS['toy'] = failing_reward('1')\n"
                      "common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)\n")
    cmd = torchrun_cmd(script, ["--prompts-per-step", "4", "--group-size", "4", "--micro-batch", "4",
                                "--sample-steps", "4", "--iterations", "3", "--eval-every", "0", "--threads", "1",
                                "--output-dir", tmp_path / "r"])
    tic = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0 and time.time() - tic < 200
    text = out.stdout + out.stderr
    workers, summary = text.split("ChildFailedError", 1)             # what the ranks printed; torchrun's summary
    assert workers.count("the reward failed on rank 1: RuntimeError: the scorer ran out of memory") == 1  # rank 0
    failures = summary[summary.index("Failures:"):]                 # both ranks exited with 1, each with that line
    assert "[1]:" in failures and "[0]:" in failures and "exitcode: 1" in text and "<N/A>" not in summary
    assert "error_file" in summary and "the reward failed on rank 1" in summary.split("Root Cause")[1]
    assert [m["iteration"] for m in read_metrics(tmp_path / "r")] == [0]  # iteration 0 logged; 1 stopped both
    assert workers.count(f"checkpoint iter_000001 saved: continue with --resume {tmp_path / 'r'}") == 1  # rank 0
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "iter_000001"


def pil_resize_max_size(images: torch.Tensor, size: int) -> torch.Tensor:
    """open_clip's ResizeMaxSize as the hpsv2 package runs it, written with PIL: each channel resized as a float
    image (PIL bicubic, clipped to [0, 1] as an 8-bit image is), the longer side to `size`, then black borders,
    (left, top, right, bottom) = (pad_w // 2, pad_h // 2, the rest)."""
    from PIL import Image
    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    new_h, new_w = round(height * scale), round(width * scale)
    out = np.zeros((len(images), 3, size, size), np.float32)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    for n, image in enumerate(images.numpy()):
        for c, channel in enumerate(image):
            resized = np.asarray(Image.fromarray(channel, mode="F").resize((new_w, new_h), Image.BICUBIC))
            out[n, c, top:top + new_h, left:left + new_w] = np.clip(resized, 0, 1)
    return torch.from_numpy(out)


@pytest.mark.parametrize("height,width", [(512, 768), (768, 512), (512, 512)])
def test_hpsv2_feeds_its_vision_tower_the_hpsv2_packages_padded_pixels(height, width, tmp_path, monkeypatch):
    """What the vision tower receives: ResizeMaxSize's black-padded square, normalised (padding -mean/std), while
    CLIPScoreH squashes the whole image to the square."""
    from test_reward_models import IMAGE, OPENAI_MEAN, OPENAI_STD, _open_clip_state, _save_checkpoint, _save_processor
    tok = helpers.tokenizer()
    _save_processor(tmp_path / "clip-h", tok, tok.eos_token_id)
    _save_checkpoint(tmp_path / "hps", _open_clip_state(len(tok)))
    images = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(3))
    mean, std = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1), torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    for scorer, expected in [
        (common.HPSv2(model_id=str(tmp_path / "hps"), processor_id=str(tmp_path / "clip-h")),
         pil_resize_max_size(images, IMAGE)),
        (common.CLIPScoreH(model_id=str(tmp_path / "hps"), filename="HPS_v2.1_compressed.pt",
                           processor_id=str(tmp_path / "clip-h")),
         torch.nn.functional.interpolate(images, size=(IMAGE, IMAGE), mode="bicubic", antialias=True).clamp(0, 1))]:
        seen, features = [], scorer.model.get_image_features
        monkeypatch.setattr(scorer.model, "get_image_features", lambda pixel_values, seen=seen, features=features:
                            seen.append(pixel_values) or features(pixel_values=pixel_values))
        scorer(images, ["a cat", "a dog"])
        torch.testing.assert_close(seen[0], (expected - mean) / std, rtol=0, atol=2e-5)
    hps = (pil_resize_max_size(images, IMAGE) - mean) / std  # the two differ but on a square image
    assert torch.allclose(seen[0], hps, rtol=0, atol=2e-5) == (height == width)


# Each in-process scorer and the hub repositories it loads, its own first; the others need no files.
CLIP_H, CLIP_L = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "openai/clip-vit-large-patch14"
SCORER_REPOS = {"pickscore": ["yuvalkirstain/PickScore_v1", CLIP_H], "clipscore": [CLIP_L],
                "hpsv2": ["xswu/HPSv2", CLIP_H], "clipscore-h": ["apple/DFN5B-CLIP-ViT-H-14", CLIP_H],
                "aesthetic": ["camenduru/improved-aesthetic-predictor", CLIP_L], "ocr": ["stepfun-ai/GOT-OCR-2.0-hf"]}
NO_FILES = ["toy", "toy-soft", "jpeg", "imagereward"]  # imagereward's package keeps its own download folder


def cache_file(hub: Path, repo: str, filename: str):
    """A file in the hub cache's layout: models--OWNER--NAME/refs/main -> snapshots/COMMIT/filename."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text("0" * 40)
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True, exist_ok=True)
    (folder / "snapshots" / ("0" * 40) / filename).write_text("{}")


def test_every_registry_scorer_says_which_hub_files_it_needs():
    assert sorted(common.REWARDS) == sorted([*SCORER_REPOS, *NO_FILES])
    for name, repos in SCORER_REPOS.items():
        assert [repo for repo, _ in common.SCORER_FILES[common.REWARDS[name]]] == repos, name
    assert not any(common.REWARDS[name] in common.SCORER_FILES for name in NO_FILES)


@pytest.mark.parametrize("name", SCORER_REPOS)
def test_a_scorer_not_in_the_hub_cache_is_one_line_before_anything_is_written(name, empty_hub, tmp_path, capsys,
                                                                             monkeypatch):
    """In each trainer, `common.py evaluate` and `common.py serve-reward`; then each of its repositories is named in
    turn until all are cached, when it loads."""
    from helpers import TRAINERS
    monkeypatch.setattr(common.REWARDS[name], "__init__", lambda *a, **k: pytest.fail("the scorer loaded"))
    repo = SCORER_REPOS[name][0]
    calls = [lambda t=t: common.run_cli(importlib.import_module(t).main, importlib.import_module(t).Args,
                                        importlib.import_module(t).MODEL_DEFAULTS,
                                        ["--reward", name, "--output-dir", str(tmp_path / "run")]) for t in TRAINERS]
    calls += [lambda: common.evaluate_main(["--model", "toy", "--reward", name, "--output", str(tmp_path / "run")]),
              lambda: common.serve_reward(["--reward", name, "--port", "0"])]
    for call in calls:
        with pytest.raises(SystemExit) as stop:
            call()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"error: --reward {name} needs {repo} " in err and f"`hf download {repo}`" in err, err
        assert not (tmp_path / "run").exists()
    for repo, filename in common.SCORER_FILES[common.REWARDS[name]]:
        with pytest.raises(common.UsageError, match=re.escape(f"needs {repo} ({filename})")):
            common.check_scorer_files(["jpeg", name])
        cache_file(empty_hub, repo, filename)
    common.check_scorer_files([name, "toy", "remote:http://127.0.0.1:1/x"])


class silent_server:
    """A TCP server that accepts every connection and never answers; the connections it holds are `accepted`."""

    def __enter__(self):
        self.sock, self.accepted = socket.create_server(("127.0.0.1", 0)), []
        threading.Thread(target=self.accept, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/judge"
        return self

    def accept(self):
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.sock.accept()[0])

    def __exit__(self, *exc):
        self.sock.close()


@pytest.mark.parametrize("kind,requests,timeout", [("silent", 20, 0.2), ("drip", 10, 0.5), ("drip body", 10, 0.5)])
def test_requests_past_their_deadline_leave_no_thread_or_connection_behind(kind, requests, timeout):
    """Requests to a server that never answers, or sends a byte every 0.2 s: each is closed at its deadline, so
    the thread count is back where it was (the drip server's threads end when their client has gone)."""
    with silent_server() if kind == "silent" else raw_server([DRIP if kind == "drip" else DRIP_BODY]) as server:
        baseline = threading.active_count()
        reward = common.RemoteReward(server.url, timeout=timeout, retries=0)
        for _ in range(requests):
            with pytest.raises(common.TrainingStopped, match=f"no complete reply within {timeout:g} s"):
                reward(images(1), ["a"])
        tic = time.time()
        while threading.active_count() > baseline and time.time() - tic < 30:  # a guard: they end within 0.2 s
            time.sleep(0.05)
        assert threading.active_count() == baseline, threading.enumerate()
        for conn in getattr(server, "accepted", []):  # the request, then the end of the connection (else a timeout)
            conn.settimeout(2)
            while conn.recv(65536):
                pass
            conn.close()
        assert len(getattr(server, "accepted", range(requests))) == requests
