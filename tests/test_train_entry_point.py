"""`torchrun -m gradsched.train`: an HF causal LM from a token file, with save, and resume at another layout."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest


def torchrun(*args, timeout=300):
    """Run gradsched.train on 4 CPU processes; every process is gone when this returns."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "gradsched.train", "--model", "llama-tiny", "--batch", "8", "--microbatches", "2", "--seq", "32",
           "--compiler", "eager", "--log-every", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    return out


def metrics(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 5000, dtype=np.uint16).tofile(path)
    return path


def test_a_run_saved_mid_way_resumes_at_another_layout_with_the_same_losses(token_file, tmp_path):
    out = torchrun("--data", str(token_file), "--pp", "2", "--steps", "4", "--save-every", "2",
                   "--ckpt", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "first.jsonl"))
    assert "step 4/4" in out and "tok/s" in out and "pp=2 dp=2" in out
    first = metrics(tmp_path / "first.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in first)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000002", "step-00000004"]

    out = torchrun("--data", str(token_file), "--pp", "1", "--steps", "4", "--resume",
                   str(tmp_path / "ckpt" / "step-00000002"), "--metrics", str(tmp_path / "resumed.jsonl"))
    assert "pp=1 dp=4" in out and "steps 3..4" in out
    resumed = metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, first[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["lr"] == want["lr"]
