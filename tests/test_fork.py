"""A method the machinery has never seen: tests/likelihood_free.py, a likelihood-free fork of flow_grpo.py (ODE
rollouts, no ratio, no KL, an old policy of its own). It learns nothing in particular here; what is checked is that
common.py serves it unchanged: --preflight passes with the rows it cannot fill n/a, and --resume continues it bitwise,
its old policy (extra state) included."""
import json
import shutil

import pytest
import torch

import common
import likelihood_free
from helpers import run, straight_and_resumed, training_state


def test_the_fork_passes_the_preflight_with_what_it_does_not_log_not_applicable(tmp_path):
    with pytest.raises(common.TrainingStopped) as stop:
        run(likelihood_free, ["--output-dir", str(tmp_path / "run"), "--preflight"])
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert stop.value.exit_code == 0 and report["passed"], report["rows"]
    assert rows["first update on-policy"]["status"] == "n/a" and not any("ratio" in check for check in rows)
    assert rows["gradients finite"]["status"] == rows["step size, change / weights (L2)"]["status"] == "PASS"
    assert "ratio_dev" not in report["metrics"] and "kl" not in report["metrics"]


def test_the_fork_resumes_bitwise_with_its_old_policy(tmp_path):
    argv = ["--eval-every", "1", "--save-every", "1"]
    straight, resumed = straight_and_resumed(likelihood_free, argv, split=1, total=3, tmp_path=tmp_path)
    assert straight == resumed and [m["iteration"] for m in straight] == [0, 1, 2, 3]
    a, b = (training_state(tmp_path / name / "checkpoints" / "iter_000003") for name in ("straight", "split"))
    old_a, old_b = (s["extra"]["old_policy"] for s in (a, b))
    assert len(old_a) == len(a["params"]) and all(torch.equal(x, y) for x, y in zip(old_a, old_b))
    # the old policy is a state of its own: a soft copy that lags the weights, not the weights again
    assert not all(torch.equal(old_a[i], a["params"][str(i)]) for i in range(len(old_a)))


def test_a_checkpoint_without_the_old_policy_is_refused(tmp_path):
    """A state/ without the fork's old policy (saved again without it) is the one refusal of a damaged checkpoint."""
    out = tmp_path / "run"
    run(likelihood_free, ["--iterations", "1", "--output-dir", str(out)])
    ckpt = out / "checkpoints" / "iter_000001"
    state = training_state(ckpt)
    del state["extra"]
    import torch.distributed.checkpoint as dcp
    shutil.rmtree(ckpt / "state")
    common.single_process(dcp.save, state, ckpt / "state")
    with pytest.raises(common.UsageError, match=f"{ckpt} is not a checkpoint this code wrote: "):
        run(likelihood_free, ["--iterations", "2", "--resume", str(out), "--output-dir", str(tmp_path / "b")])
