"""`torchrun -m gradsched.train`: an HF causal LM from a token file, with save, and resume at another layout;
a user's mistakes end in one line and exit code 2."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


TRAIN = ["-m", "gradsched.train", "--model", "llama-tiny", "--batch", "8", "--microbatches", "2", "--seq", "32",
         "--compiler", "eager"]


def run(cmd, timeout=300):
    """(exit code, stdout and stderr) of a command; every process it started is gone when this returns."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def torchrun(*args, timeout=300):
    """Run gradsched.train on 4 CPU processes under torchrun (as a user would start it on a cluster)."""
    code, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                     *TRAIN, *args], timeout)
    assert code == 0, out[-3000:]
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
    """Started by gradsched.train's own launcher (--nproc-per-node) under the V zero-bubble schedule (the Llama's
    4 layers in 4 stages, two a rank, the loss on rank 0, split where the ranks' work is balanced) with its
    parameters sharded (ZeRO-3), resumed under torchrun without a pipeline, each layer split over tp=2 and each
    sequence over cp=2 (shard=True, eager): its losses are the pipeline's."""
    (tmp_path / "first.jsonl").write_text('{"step": 9, "loss": 1.0}\n')  # an older run's: started anew
    code, out = run([sys.executable, *TRAIN, "--nproc-per-node", "4", "--data", str(token_file), "--pp", "2",
                     "--schedule", "zbv", "--split", "balanced", "--microbatches", "4", "--shard", "params",
                     "--steps", "4", "--save-every", "2",
                     "--ckpt", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "first.jsonl")])
    assert code == 0, out[-3000:]
    assert "pp=2 dp=2 cp=1 (zbv schedule), shard=params, stages begin at ['model.model.layers." in out  # balanced
    assert all(f"step {s}/4 [" in out for s in (1, 2, 3, 4))  # a progress line per step
    assert out.count("--warmup 10 is longer than the run (--steps 4)") == 1  # the default warmup, said once
    assert "Warning" not in out  # pipelining's FutureWarning silenced
    # rank 0 hosts the job's store: a rank still calling it (its watchdog) after rank 0 had exited logged
    # TCPStore's C++ error and stack; the ranks now leave together, rank 0 last
    for noise in ("frame #", "recvValue failed", "Broken pipe", "Connection reset", "Traceback"):
        assert noise not in out, out[-3000:]
    first = metrics(tmp_path / "first.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in first)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000002", "step-00000004"]

    shutil.copy(tmp_path / "first.jsonl", tmp_path / "resumed.jsonl")  # resuming at step 2 keeps steps 1, 2
    out = torchrun("--data", str(token_file), "--pp", "1", "--tp", "2", "--cp", "2", "--compiler", "eager", "--steps",
                   "4", "--resume", str(tmp_path / "ckpt" / "step-00000002"), "--metrics", str(tmp_path / "resumed.jsonl"))
    assert "pp=1 dp=1 cp=2 tp=2" in out and "steps 3..4" in out
    resumed = metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[:2] == first[:2]
    for got, want in zip(resumed[2:], first[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["lr"] == want["lr"]


# ---- mistakes: one line from rank 0, exit code 2, no traceback ----------------------------------

@pytest.fixture
def one_process(monkeypatch):
    """main() in this process, as rank 0 of a world of one (the environment restored afterwards)."""
    from gradsched.launch import free_port
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def said(capsys, *args) -> tuple[int, list[str]]:
    """(exit code, lines on stdout and stderr) of gradsched.train's main on these arguments."""
    from gradsched.train import main
    code = main([*TRAIN[2:], *args])
    out = capsys.readouterr()
    return code, (out.out + out.err).splitlines()


def test_each_mistake_is_one_line_and_exit_code_2(one_process, capsys, token_file, tmp_path):
    short = tmp_path / "short.bin"
    np.arange(8 * 16, dtype=np.uint16).tofile(short)  # 7 windows of 16 + 1 tokens: fewer than --batch 8
    (tmp_path / "empty").mkdir()
    cases = {  # arguments -> what the one line says
        ("--data", str(tmp_path / "nope.bin")): f"--data {tmp_path / 'nope.bin'}: no such file.",
        ("--data", str(short), "--seq", "16"): "7 windows of --seq 16 + 1, fewer than one global batch of --batch 8",
        ("--pp", "3"): "pp=3 x cp=1 does not divide the world size 1",
        ("--model", "no-such-model"): "--model 'no-such-model': not a built-in",
        ("--tp", "2", "--cp", "2"): "pp=1 x cp=2 x tp=2 does not divide the world size 1: start a multiple of 4",
        ("--resume", str(tmp_path / "empty")): "is empty: no checkpoint was saved there yet",
        ("--resume", str(tmp_path / "nothing")): "there is nothing at that path",
    }
    for args, message in cases.items():
        code, lines = said(capsys, "--steps", "20", *args)
        assert code == 2, args
        assert len(lines) == 1 and lines[0].startswith("gradsched.train: error: ") and message in lines[0], lines


def test_debug_keeps_the_traceback(one_process, tmp_path):
    from gradsched.train import Mistake, main
    with pytest.raises(Mistake, match="no such file"):
        main([*TRAIN[2:], "--data", str(tmp_path / "nope.bin"), "--debug"])


def test_help_shows_every_default(capsys):
    from gradsched.train import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: llama-tiny)", "--warmup WARMUP steps of linear warmup (default: 10)",
                    "--warmup (default: 0.0003)", "not on a terminal (default: 1)", "--batch BATCH global batch, "
                    "in sequences (default: 8)"):
        assert default in out, default


def test_a_mistake_on_several_processes_is_said_once(tmp_path):
    """The issue's `--pp 3` on more processes than one: rank 0 alone says it, in one line."""
    code, out = run([sys.executable, *TRAIN, "--nproc-per-node", "2", "--pp", "3"], timeout=120)
    assert code == 2
    assert out.strip().splitlines() == [
        "gradsched.train: error: pp=3 x cp=1 does not divide the world size 2: start a multiple of 3 processes, "
        "or change pp/cp."]


# ---- on 4 processes: the same one line every time, and a quiet end ---------------------------------

def mistakes_bench():
    """benchmarks/mistakes.py: its mistakes, and its runs of 4 processes started with torchrun's variables."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "mistakes.py"
    spec = importlib.util.spec_from_file_location("mistakes_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mistake, said", [  # (every other mistake a rank finds alone: the test after this one)
    ("data_ids_beyond_vocab", "holds token id 300, but the model's vocabulary has 256"),
])
def test_a_mistake_on_4_processes_is_the_same_one_line_every_time(mistake, said, tmp_path):
    """Found by every rank before any connection: rank 0 says it, alone, and every rank exits with code 2.
    (Once found after connecting, a rank leaving first failed its peers' connections: a gloo traceback,
    and sometimes no line at all.)"""
    bench = mistakes_bench()
    bench.prepare(tmp_path, [mistake])
    args = bench.BASE + [a.format(d=tmp_path) for a in bench.MISTAKES[mistake][1]]
    lines = set()
    for _ in range(2):
        codes, outputs, _ = bench.run_once(args, nproc=4, timeout_s=240)
        assert codes == [2, 2, 2, 2] and bench.one_line(outputs), (codes, [out[-1500:] for out in outputs])
        lines.add(bench.one_line(outputs))
    assert len(lines) == 1 and said in lines.pop()


def test_every_mistake_a_rank_can_find_alone_is_found_before_connecting(monkeypatch, capsys, tmp_path):
    """Rank 0 of a world of 4, alone (no peer started, no connection allowed): each of the benchmark's mistakes
    but the one that needs the checkpoint's collective check ends in its one line and exit code 2."""
    import torch.distributed as dist
    from gradsched.launch import free_port
    from gradsched.train import main

    def connect(*args, **kwargs):
        raise AssertionError("init_process_group: connecting before every rank-local check was done")
    monkeypatch.setattr(dist, "init_process_group", connect)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    bench = mistakes_bench()
    names = [n for n in bench.MISTAKES if n != "resume_other_model"]
    bench.prepare(tmp_path, names)
    for name in names:
        try:
            code = main(bench.BASE + [a.format(d=tmp_path) for a in bench.MISTAKES[name][1]])
        except SystemExit as e:  # argparse's
            code = e.code
        out = capsys.readouterr()
        lines = (out.out + out.err).splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("gradsched.train: error: "), (name, lines)


LATE_RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from gradsched.launch import leave
from gradsched.sync.watchdog import JOURNAL
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
with JOURNAL.entry("an all-reduce", "collective", group=dist.group.WORLD, op="all_reduce"):
    dist.all_reduce(torch.ones(1))  # the watchdog runs from here on
time.sleep(1.0 + 2.0 * dist.get_rank())  # rank 1 ends 2 s after rank 0; its watchdog calls the store meanwhile
t = time.monotonic()
leave()
print(f"rank {os.environ['RANK']} left after {time.monotonic() - t:.1f} s", flush=True)
"""


def test_rank_0_the_stores_host_leaves_last():
    """leave(): rank 0 waits for the others before its process (and the store in it) ends, and the watchdog is
    stopped first. With destroy_process_group in its place, rank 1's watchdog logged TCPStore's 'Broken pipe'
    and its C++ stack at every beat of its last 2 s."""
    codes, outputs, _ = mistakes_bench().run_once([], nproc=2, timeout_s=120, command=("-c", LATE_RANK))
    assert codes == [0, 0], outputs
    assert not any("frame #" in out or "Broken pipe" in out or "failed" in out for out in outputs), outputs
    waited = float(outputs[0].split("left after ")[1].split()[0])
    assert waited >= 1.5, outputs  # rank 0 waited for rank 1


def rank_process(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's child process that runs `rank` (its RANK variable)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} under {launcher_pid}")


def test_a_rank_killed_mid_run_ends_every_survivor_with_one_line_naming_it(tmp_path):
    log = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, *TRAIN, "--nproc-per-node", "2", "--steps", "100000",
                             "--metrics", str(log)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):  # training, past compiling
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        os.kill(rank_process(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=90)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("gradsched.train: rank 0: ")]
    assert proc.returncode != 0 and len(lines) == 1, out[-3000:]
    assert "rank 1" in lines[0] and "gone" in lines[0] and "Traceback" not in out, out[-3000:]
    assert ended < 30  # the survivor named the dead rank within seconds, not gloo's 30 minutes


def test_a_model_tensor_parallelism_cannot_split_ends_every_rank_with_one_line_naming_its_source(tmp_path):
    """6 heads over tp=4: found as the graph compiles on every TP rank alike, said once, exit code 2."""
    config = tmp_path / "six_heads.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 48,
                                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
                                  "num_key_value_heads": 6, "tie_word_embeddings": True}))
    code, out = run([sys.executable, *TRAIN, "--nproc-per-node", "4", "--tp", "4", "--steps", "2",
                     "--model", str(config)])
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1 and "modeling_llama.py" in errors[0] and "split over tp=4" in errors[0], errors
