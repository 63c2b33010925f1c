"""Run a function on N local processes with gloo: tests, benchmarks and the demo use it.

Each rank gets one thread (several threads per rank on a small machine run
10-70x slower), a finite collective timeout (a mismatched collective becomes
an error, not a hang), and is killed if it outlives the deadline, so no test
leaves a process behind.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, out_dir, collective_timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      # ranks compiling one graph take turns, the others read Inductor's cache (gradsched.sync.compile)
                      GRADSCHED_COMPILE_LOCKS=os.path.join(out_dir, "compile-locks"))
    torch.set_num_threads(1)
    import torch.distributed as dist
    result = None
    def report(message):  # a rank the watchdog ends (stalled, or blocked on a silent peer) still reports why, and when
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(("error", f"CollectiveFault: {message}", time.time()), f)
    from gradsched.sync.watchdog import JOURNAL
    JOURNAL.on_fault.append(report)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report every failure to the parent, with its traceback
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


# Modules a rank needs, imported once by the fork server (import torch + Inductor + gradsched takes ~5 s of
# CPU per rank; with 4 ranks on 2 cores that was ~10 s of every start). The server imports and starts
# nothing else (no threads, no process group), so forking it is safe; GRADSCHED_START_METHOD=spawn
# goes back to a fresh interpreter per rank. Names that fail to import are skipped by the server.
# torch's compiler stack imports most of itself lazily, at a rank's first compile (about 220 modules, 3 s of CPU
# per rank, each time ranks start): the server imports it once instead.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._dynamo.backends.common", "functorch.compile",
            "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "torch._inductor.lowering",
            "torch._inductor.decomposition", "torch._inductor.codegen.cpp", "torch._inductor.codegen.cpp_wrapper_cpu",
            "torch._inductor.kernel.mm", "torch._inductor.comms", "torch._inductor.fx_passes.post_grad",
            "torch._inductor.async_compile", "torch.ao.quantization", "torch._export", "torch.distributed.pipelining",
            "torch.distributed.tensor", "torch.distributed._functional_collectives", "sympy.combinatorics",
            "gradsched.parallel", "gradsched.cp.ring_attention", "gradsched.hf",
            "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.mistral.modeling_mistral", "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.gemma3.modeling_gemma3"]


def _context():
    method = os.environ.get("GRADSCHED_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world: int, *args, timeout_s: float = 300.0, collective_timeout_s: float = 60.0,
              raise_on_error: bool = True) -> list:
    """Run fn(rank, world, *args) on `world` processes; return the per-rank results.

    fn must be importable (a module-level function). With raise_on_error=False
    a failed rank's entry is ("error", text) instead of raising; ("error", text, time) for a rank the
    watchdog ended (gradsched.sync.watchdog: stalled, or blocked on a silent peer).
    """
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        os.mkdir(os.path.join(out_dir, "compile-locks"))
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out_dir, collective_timeout_s),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = timeout_s
        import time
        t0 = time.monotonic()
        for p in procs:
            p.join(max(0.0, deadline - (time.monotonic() - t0)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                why = "timed out" if r in hung else f"exited with code {procs[r].exitcode}"
                results.append(("error", f"rank {r} {why} without a result"))
    errors = [(r, res[1]) for r, res in enumerate(results) if res[0] != "ok"]
    if errors and raise_on_error:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors)
        raise RankFailed(f"{len(errors)} of {world} ranks failed:\n{text}")
    return [res[1] if res[0] == "ok" else res for res in results]


# ---- one node of a command line, as torchrun would start it -----------------------------------

def launch_command(nproc: int, argv: list[str]) -> int:
    """Start `python argv...` on `nproc` local processes (torchrun's variables, one thread each unless
    OMP_NUM_THREADS says otherwise) and wait for them. When one fails, the others are stopped (after a
    mistake, exit code 2, only if they do not end with it too), and the exit code is the first failure's:
    2 for a mistake, which rank 0 has named in one line."""
    env = {**os.environ, "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    try:
        return _wait_all(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


MISTAKE_GRACE_S = 120.0  # after a rank ended with a mistake (exit code 2), for the others to end with it too


def _wait_all(procs, grace_s: float = 5.0, mistake_grace_s: float = MISTAKE_GRACE_S) -> int:
    """0 when every process ends well; else the first failure's exit code. After a failure the others
    get `grace_s` to end by themselves, then are stopped; after a mistake (exit code 2), `mistake_grace_s`:
    every rank finds the same one (a slower rank, rank 0 maybe, is still starting) and rank 0 names it,
    so rank 0 is not stopped before its line."""
    first, deadline = None, None
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and first is None:
            first = failed[0]
            deadline = time.monotonic() + (mistake_grace_s if first == 2 else grace_s)
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = None
        time.sleep(0.1)
    if first is None:
        first = next((p.returncode for p in procs if p.returncode != 0), 0)
    return first if first > 0 else 1 if first else 0


# ---- the end of a rank's part in the job ---------------------------------------------------------

_LEAVES = [0]  # default process groups this process has left: each leave's store keys are its own


def leave(timeout_s: float = 60.0, left_timeout_s: float = 30.0) -> None:
    """End this rank's part in the job, every rank together: its watchdog stopped; a barrier on the store (every
    rank's collectives are over before any rank tears its connections down; at most `timeout_s`); the process
    group destroyed; and rank 0, whose process hosts the job's store (launched as torchrun's variables say,
    without torchrun's agent), returns last, once every rank has said it no longer needs the store (at most
    `left_timeout_s`). A rank that calls a store whose host has exited logs TCPStore's C++ error and stack
    ('sendBytes failed ... Broken pipe', 'frame #0: ...'), and one still connecting or in a collective with a
    rank that has gone fails in gloo ('Connection closed by peer'). Every rank calls it; a world of one only
    destroys its group."""
    import torch.distributed as dist

    from gradsched.sync.watchdog import stop
    if not dist.is_initialized():
        return
    stop()
    world, rank = dist.get_world_size(), dist.get_rank()
    store = None
    if world > 1:
        _LEAVES[0] += 1
        with contextlib.suppress(Exception):
            store = dist.distributed_c10d._get_default_store()  # held: rank 0's store outlives its process group
    key = f"gradsched/leave/{_LEAVES[0]}"
    if store is not None:
        _meet(store, f"{key}/done", world, timeout_s, wait=True)
    dist.destroy_process_group()
    if store is not None:
        _meet(store, f"{key}/left", world, left_timeout_s, wait=rank == 0)


def _meet(store, key: str, world: int, timeout_s: float, wait: bool) -> bool:
    """Count this rank in at `key`; with `wait`, wait (at most timeout_s) until all `world` ranks have. Polled,
    not store.wait: a wait that times out logs C++ warnings. False if the store failed or the wait timed out."""
    deadline = time.monotonic() + timeout_s
    try:
        n = store.add(key, 1)
        while wait and n < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
            n = store.add(key, 0)
        return True
    except Exception:  # noqa: BLE001 - a rank gone or too slow: leave anyway
        return False
