"""Remote rewards: the reference server (`python common.py serve-reward`) started as a real process on loopback
gives the in-process scores; a dead server, and a server whose answer is wrong, stop the run with one clear
line instead of a zero reward."""
import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import common
import flow_grpo
from helpers import ROOT, SMALL, read_metrics, run, tiny_argv, torchrun_cmd


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
    total, parts = common.build_reward(f"remote:{server}:0.5,jpeg")(images(), prompts)
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
])
def test_a_wrong_answer_is_an_error_never_a_zero(reply, what):
    with fake_server(reply) as url:
        with pytest.raises(common.TrainingStopped, match=f"reward server {url} sent .* expected .*2 finite numbers"):
            common.RemoteReward(url, timeout=5, retries=0)(images(2), ["a", "b"])


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
    per = common.build_reward("toy,jpeg:0.5", norm="per-reward").advantages(parts, fn)
    expected = [x + 0.5 * y for x, y in zip(by_hand(toy), by_hand(jpeg))]
    assert per.tolist() == pytest.approx(expected, abs=1e-5)
    summed = common.build_reward("toy,jpeg:0.5", norm="sum").advantages(parts, fn)
    assert summed.tolist() == pytest.approx(by_hand([t + 0.5 * j for t, j in zip(toy, jpeg)]), abs=1e-5)


def test_a_run_with_two_rewards_logs_each_one(tmp_path):
    run(flow_grpo, ["--reward", "toy,jpeg:0.5", "--reward-norm", "per-reward", *SMALL, "--iterations", "1",
                    "--output-dir", str(tmp_path / "r")])
    first = read_metrics(tmp_path / "r")[0]
    assert first["reward_mean"] == pytest.approx(first["reward_toy"] + 0.5 * first["reward_jpeg"], abs=1e-5)
    assert first["eval_reward"] == pytest.approx(first["eval_toy"] + 0.5 * first["eval_jpeg"], abs=1e-5)
    assert first["reward_jpeg"] < 0 and first["eval_reward_se"] > 0


def test_bad_remote_specs_name_the_syntax():
    for spec in ["remote:127.0.0.1:8000/jpeg", "remote:http://127.0.0.1:8000/", "remote:http://h:1/x:heavy"]:
        with pytest.raises(common.UsageError, match="remote:http://HOST:PORT/NAME|bad weight"):
            common.parse_reward_spec(spec)


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


class fake_server:
    """An HTTP server in a thread that keeps every request's JSON body (`bodies`) and answers each POST with
    `reply`: JSON unless it is a string, or reply(body) when it is a function."""

    def __init__(self, reply):
        self.bodies = bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer = reply
                if callable(reply):
                    bodies.append(json.loads(raw))
                    answer = reply(bodies[-1])
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(200)
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
    assert text.count("the reward failed on rank 1: RuntimeError: the scorer ran out of memory") == 1  # rank 0 says it
    failures = text[text.index("Failures:"):]                       # torchrun's summary: both ranks exited with 1
    assert "[1]:" in failures and "[0]:" in failures and "exitcode: 1" in text
    assert [m["iteration"] for m in read_metrics(tmp_path / "r")] == [0]  # iteration 0 logged; 1 stopped both
