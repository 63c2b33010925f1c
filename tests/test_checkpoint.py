"""Checkpoints: independent of the layout, atomic, and refused by name when they do not fit.

The reference for resuming is the same parallel run, never stopped; both end in a
checkpoint, read back whole in this process by DCP itself, and compared tensor by tensor
(parameters, fp32 master weights and the optimizer's moments). The runs share one set of
processes (start-up dominates); each builds its model, plan and optimizer anew, and only the
checkpoint carries over. benchmarks/resume_parity.py stops every process between the halves."""
import os
import shutil

import pytest
import torch

from gradsched.training.checkpoint import CheckpointError, checkpoint_dir
from gradsched.launch import RankFailed, run_ranks
from rank_fns import (damaged_load_messages, load_after_training_started, load_messages, resume_runs,
                      save_right_after_load, save_then_die_mid_save)
from tied_training import Job, checkpoint_contents, max_state_diff
from tiny_gpt import GPTConfig


def job(pp, dp, schedule="auto", split_points=("blocks.1",), **options):
    return Job(pp=pp, dp=dp, schedule=schedule, optimizer="adamw", config=GPTConfig(vocab=97),
               param_groups="decay_matrices", split_points=split_points,
               options={"compiler": "eager", "microbatches": 2, **options})


RESUMED_AT = {  # name -> (the second half's layout, tolerance)
    "same_layout": (job(2, 2), 1e-6),
    "pp1_dp4": (job(1, 4), 1e-5),  # other reduction groups: fp32 sums in another order
    # and under the zero-bubble schedule (the first half's 1F1B): B and W graphs, the same sums
    "zb1p_other_bucket_mb": (job(2, 2, "zb1p", bucket_mb=0.004), 1e-6),
    # parameters as shards (shard="params"): loaded into the shards, saved gathered whole
    "params_sharded": (job(2, 2, shard="params"), 1e-6),
    "params_sharded_pp1_dp4": (job(1, 4, shard="params"), 1e-5),
    # in a V, two stages a rank, each its own buckets of shards: the tie's copies one Parameter on rank 0
    "params_sharded_zbv": (job(2, 2, "zbv", ("blocks.0", "blocks.1", "ln_f"), shard="params", microbatches=4), 1e-6),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    plan = [(job(2, 2), str(d / "uninterrupted"), None, 4), (job(2, 2), str(d / "first_half"), None, 2)]
    plan += [(layout, str(d / name), str(d / "first_half"), 4) for name, (layout, _) in RESUMED_AT.items()]
    # and back: a first half with sharded parameters under zero bubble, resumed with shard=True under 1F1B
    plan += [(job(2, 2, "zb1p", shard="params"), str(d / "params_first_half"), None, 2),
             (job(2, 2), str(d / "back_from_params"), str(d / "params_first_half"), 4)]
    per_rank = run_ranks(resume_runs, 4, plan, timeout_s=600)
    return d, [r["start"] for r in per_rank[0]]


@pytest.mark.parametrize("name", list(RESUMED_AT))
def test_a_run_resumed_at_any_layout_continues_as_if_never_stopped(name, runs):
    d, starts = runs
    assert starts[2 + list(RESUMED_AT).index(name)] == 2  # it read the data position back
    resumed = checkpoint_contents(str(d / name))
    assert any(k.endswith("/exp_avg_sq") for k in resumed)  # the moments are compared, not only weights
    assert max_state_diff(checkpoint_contents(str(d / "uninterrupted")), resumed) <= RESUMED_AT[name][1]


def test_sharded_parameters_saved_under_zero_bubble_resume_with_shard_true_under_1f1b_as_if_never_stopped(runs):
    d, starts = runs
    assert starts[-1] == 2
    assert max_state_diff(checkpoint_contents(str(d / "uninterrupted")), checkpoint_contents(str(d / "back_from_params"))) \
        <= 1e-6


def test_a_crash_mid_save_leaves_the_last_checkpoint_loadable_and_the_partial_one_refused(tmp_path, runs):
    with pytest.raises(RankFailed):
        run_ranks(save_then_die_mid_save, 2, str(tmp_path), timeout_s=120, collective_timeout_s=20)
    assert os.path.isdir(tmp_path / "step-00000002.partial")
    d, _ = runs
    last, partial, other_model = run_ranks(load_messages, 1, [
        (str(tmp_path), 64), (str(tmp_path / "step-00000002.partial"), 64), (str(d / "first_half"), 96)])[0]
    assert last["ok"]["step"] == 1
    assert "is a partial save: its save did not finish" in partial["error"]
    # a checkpoint of another model is refused, naming what differs
    assert "is not of this model" in other_model["error"]
    assert "wte.weight: saved (97, 32), model (96, 32)" in other_model["error"]


@pytest.mark.parametrize("shard,world", [(True, 2), ("params", 4)], ids=["shard_true_pp2", "params_pp2_dp2"])
def test_a_checkpoint_loaded_into_running_stages_reaches_every_copy_and_saves_again_unchanged(runs, tmp_path, shard,
                                                                                               world):
    # shard="params": loaded into each rank's shards after the first step laid them out, read back gathered
    d, _ = runs
    saved = checkpoint_contents(str(d / "first_half"))
    for params in run_ranks(load_after_training_started, world, str(d / "first_half"), str(tmp_path), shard):
        for name, p in params.items():  # stage 1's head is the embedding's copy, saved under its first name
            assert p.equal(saved[f"model/{'wte.weight' if name == 'lm_head.weight' else name}"]), name
    # saved again before any step (at pp2 x dp1, from a pp2 x dp2 checkpoint): the same state
    assert max_state_diff(saved, checkpoint_contents(str(tmp_path))) == 0.0


def test_saving_a_loaded_checkpoint_before_the_layout_is_known_is_refused_not_written_without_state(runs, tmp_path):
    d, _ = runs
    [message] = run_ranks(save_right_after_load, 1, str(d / "first_half"), str(tmp_path))
    assert message.startswith("CheckpointError: gradsched.save after gradsched.load, before the model's first step")
    assert not (tmp_path / "latest").exists()


# ---- damaged checkpoints and the states of a directory ------------------------------------------

def damaged_copy(src, to, name, how):
    """A copy of the checkpoint directory `src` at `to` with one file damaged: 'flip' one byte in its
    middle (same size), 'cut' it to `how`'s length, or 'drop' it."""
    shutil.copytree(src, to)
    path = os.path.join(to, name)
    if how == "drop":
        os.remove(path)
        return str(to)
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[:how]
    open(path, "wb").write(bytes(data))
    return str(to)


def inside_last_optimizer_record(ckpt):
    """(file, a length) that cuts a data file inside its last record, an optimizer record: the model's
    records before it stay whole (what DCP alone loaded without a word)."""
    import torch.distributed.checkpoint as dcp
    ends = {}
    for index, info in dcp.FileSystemReader(ckpt).read_metadata().storage_data.items():
        ends[info.relative_path] = max(ends.get(info.relative_path, (0, 0, "")),
                                       (info.offset + info.length, info.offset, index.fqn))
    name, (end, start, fqn) = next((n, e) for n, e in sorted(ends.items()) if e[2].startswith("optim/"))
    return name, (start + end) // 2


def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file_with_nothing_loaded(runs, tmp_path):
    d, _ = runs
    ckpt = str(d / "first_half" / open(d / "first_half" / "latest").read())
    files = sorted(os.listdir(ckpt))
    assert "gradsched.manifest" in files and ".metadata" in files and len(files) >= 6  # 4 ranks' data files
    cases = {f"flip {n}": (damaged_copy(ckpt, tmp_path / f"flip{i}", n, "flip"), n) for i, n in enumerate(files)}
    opt_file, cut = inside_last_optimizer_record(ckpt)
    cases["optimizer record cut"] = (damaged_copy(ckpt, tmp_path / "cut", opt_file, cut), opt_file)
    cases["metadata cut"] = (damaged_copy(ckpt, tmp_path / "cutmeta", ".metadata", 100), ".metadata")
    data_file = next(n for n in files if n.endswith(".distcp"))
    cases["data file missing"] = (damaged_copy(ckpt, tmp_path / "drop", data_file, "drop"), data_file)
    unverified = damaged_copy(ckpt, tmp_path / "unverified", opt_file, cut)
    os.remove(os.path.join(unverified, "gradsched.manifest"))
    runs_ = [(path, 97, True) for path, _ in cases.values()] + [(unverified, 97, False), (ckpt, 97, True)]
    per_rank = run_ranks(damaged_load_messages, 2, runs_, timeout_s=300)
    assert per_rank[0][:-1] == per_rank[1][:-1]  # every rank raised the same error
    said = dict(zip(list(cases) + ["unverified", "intact"], per_rank[0]))
    for case, (_, name) in cases.items():
        assert "is damaged, and nothing was loaded" in said[case]["error"], case
        assert said[case]["untouched"], case
        assert name in said[case]["error"], case
    for case, (_, name) in cases.items():
        if case.startswith("flip") and name != "gradsched.manifest":
            assert "other bytes than were saved" in said[case]["error"], case
    assert "gradsched.manifest (the file sizes and checksums) is not as written" in said["flip gradsched.manifest"]["error"]
    assert f"{opt_file} is {cut} bytes" in said["optimizer record cut"]["error"]
    assert "(truncated)" in said["metadata cut"]["error"]
    assert f"{data_file} is missing" in said["data file missing"]["error"]
    # without the manifest (verify=False), the sizes in .metadata still find the cut optimizer record
    assert f"its record optim/" in said["unverified"]["error"] and "(truncated)" in said["unverified"]["error"]
    assert said["intact"]["ok"]["step"] == 2 and said["intact"]["ok"]["path"] == ckpt


def refusal(path) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint_dir(str(path))
    return str(e.value)


def test_each_state_of_a_directory_that_holds_no_loadable_checkpoint_has_its_own_message(runs, tmp_path):
    d, _ = runs
    parent = d / "first_half"
    ckpt = str(parent / open(parent / "latest").read())
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    shutil.copytree(parent, tmp_path / "no_latest")
    os.remove(tmp_path / "no_latest" / "latest")
    shutil.copytree(parent, tmp_path / "bad_latest")
    (tmp_path / "bad_latest" / "latest").write_text("step-00000007")
    shutil.copytree(ckpt, tmp_path / "only_partial" / "step-00000003.partial")
    no_manifest = shutil.copytree(ckpt, tmp_path / "no_manifest")
    os.remove(no_manifest / "gradsched.manifest")
    cases = {"missing": tmp_path / "nothing", "empty": tmp_path / "empty", "foreign": tmp_path / "foreign",
             "no latest": tmp_path / "no_latest", "bad latest": tmp_path / "bad_latest",
             "only partial": tmp_path / "only_partial", "no manifest": no_manifest}
    said = {case: refusal(p) for case, p in cases.items()}  # the filesystem decides: no process needed
    assert "there is nothing at that path" in said["missing"]
    assert "is empty: no checkpoint was saved there yet" in said["empty"]
    assert "is not a gradsched checkpoint" in said["foreign"] and "notes.txt" in said["foreign"]
    assert "but no 'latest' naming the newest" in said["no latest"]
    assert os.path.basename(ckpt) in said["no latest"]
    assert "names 'step-00000007', which is not a checkpoint there" in said["bad latest"]
    assert "only partial saves (step-00000003.partial)" in said["only partial"]
    assert "has no gradsched.manifest" in said["no manifest"] and "verify=False" in said["no manifest"]


def test_torchs_checkpoint_exception_leaves_as_a_checkpoint_error_naming_the_checkpoint():
    """DCP's CheckpointException is a BaseException: `except Exception` (and `except CheckpointError`) miss it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from gradsched.training.checkpoint_state import dcp_call

    def fails():
        raise CheckpointException("load failed", {1: (EOFError("Ran out of input"), None)})
    with pytest.raises(CheckpointError, match=r"loading the checkpoint at 'ckpt/step-1' failed: rank 1: EOFError: "
                                              r"Ran out of input\."):
        dcp_call("loading", "ckpt/step-1", fails)


def test_a_ranks_tp_shard_and_bucket_piece_are_the_chunks_of_the_whole_tensor_they_hold():
    """checkpoint_chunks.chunks against take_chunk (the TP pass's own cut): for random shapes, partitions (with
    fused segments), TP ranks and flat ranges, each chunk's view of the piece is the whole tensor's box, and the
    chunks hold every element of the piece once."""
    import random

    from gradsched.passes.tp_layouts import Partition, take_chunk
    from gradsched.training.checkpoint_chunks import chunks
    rng = random.Random(0)
    for _ in range(500):
        nd, tp, segments = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        dim = rng.randrange(nd)
        shape = [rng.randint(1, 4) for _ in range(nd)]
        shape[dim] = segments * tp * rng.randint(1, 3)
        whole = torch.randn(shape, dtype=torch.float64)
        partition = Partition("column", dim, segments) if rng.random() < 0.8 else None
        rank = rng.randrange(tp)
        part = take_chunk(whole, dim, segments, tp, rank) if partition else whole
        lo = rng.randrange(part.numel())
        hi = rng.randint(lo + 1, part.numel())
        piece = part.reshape(-1)[lo:hi].clone()
        found = chunks(tuple(part.shape), lo, hi, partition, tp, rank)
        assert sum(c.view(piece).numel() for c in found) == hi - lo
        for c in found:
            box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))
            assert torch.equal(whole[box], c.view(piece)), (shape, partition, tp, rank, lo, hi, c)
