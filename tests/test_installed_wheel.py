"""Installed as a user installs it: the sdist built from the checkout, the wheel built from that sdist, the wheel
installed into a fresh environment and used from a directory outside the checkout.

The editable install the rest of the suite runs on maps the whole source tree, so a module left out of the
package list would still import there; here nothing of the checkout is on the path. The fresh environment's
dependencies (torch, networkx, transformers) come from the running one, through a folder of links to its
site-packages that leaves out gradsched's own editable install.
"""
import os
import pathlib
import shutil
import site
import subprocess
import sys
import json
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".gradsched-dump")


def source_modules() -> list[str]:
    """Every module of the source tree, as an installed copy names it (passes/ is gradsched.passes)."""
    names = []
    for top, prefix in (("gradsched", "gradsched"), ("passes", "gradsched.passes")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join([prefix, *parts]))
    return names


def _build(hook: str, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """PEP 517's hook run in `source` with the running environment's setuptools (no network)."""
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout}\n{done.stderr}"
    return out / done.stdout.strip().splitlines()[-1]


def _dependencies_without_gradsched(where: pathlib.Path) -> pathlib.Path:
    """A folder of links to the running environment's site-packages, less anything of gradsched's (its
    editable finder, its .pth, its dist-info): a .pth naming it adds it to the path without running the
    .pth files inside it."""
    where.mkdir()
    for packages in site.getsitepackages():
        for entry in pathlib.Path(packages).iterdir():
            if entry.name.startswith(("gradsched", "__editable__")) or entry.suffix == ".pth":
                continue
            if not (where / entry.name).exists():
                (where / entry.name).symlink_to(entry)
    return where


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh environment holding only the wheel, a directory outside the checkout, the wheel)."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "checkout"
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE, symlinks=True)
    dist = tmp / "dist"
    sdist = _build("build_sdist", source, dist)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    wheel = _build("build_wheel", tmp / "unpacked" / sdist.name.removesuffix(".tar.gz"), dist)

    env_dir = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = _dependencies_without_gradsched(tmp / "dependencies")
    pathlib.Path(purelib, "running_environment.pth").write_text(f"{deps}\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, f"pip install of {wheel.name} failed:\n{done.stdout}\n{done.stderr}"
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return python, elsewhere, wheel


def run_installed(installed, *argv, timeout_s=300) -> subprocess.CompletedProcess:
    python, elsewhere, _ = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [str(python), *argv] if argv[0] in ("-c", "-m") else [str(python.parent / argv[0]), *argv[1:]]
    return subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_the_wheel_holds_every_module_of_the_source_tree(installed):
    with zipfile.ZipFile(installed[2]) as whl:
        shipped = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                   for n in whl.namelist() if n.endswith(".py")}
    missing = sorted(set(source_modules()) - shipped)
    assert not missing, f"modules of the source tree missing from {installed[2].name}: {missing}"


def test_every_module_of_the_source_tree_imports_from_the_installed_wheel(installed):
    code = ("import importlib, os, sys, traceback\n"
            "import gradsched\n"
            "assert os.path.realpath(gradsched.__file__).startswith(os.path.realpath(sys.prefix)), gradsched.__file__\n"
            "bad = []\n"
            f"for name in {source_modules()!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as e:\n"
            "        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad) or 'all imported')\n")
    done = run_installed(installed, "-c", code)
    assert done.returncode == 0 and done.stdout.strip() == "all imported", done.stdout + done.stderr


def test_the_dry_run_runs_from_the_installed_wheel(installed):
    done = run_installed(installed, "-m", "gradsched.dryrun", "--model", "llama-tiny", "--pp", "2", "--dp", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("verifier:")]
    assert len(verdicts) == 2 and all(": ok" in v for v in verdicts), done.stdout  # one a stage


def test_the_backend_is_registered_by_name_from_the_installed_wheel(installed):
    code = ("import os, sys, torch._dynamo as d\n"
            "assert 'gradsched' in d.list_backends()\n"
            "fn = d.lookup_backend('gradsched')\n"
            "mod = sys.modules[fn.__module__]\n"
            "print(fn.__module__, os.path.realpath(mod.__file__).startswith(os.path.realpath(sys.prefix)))\n")
    done = run_installed(installed, "-c", code)
    assert done.returncode == 0 and done.stdout.split() == ["gradsched.backend", "True"], done.stdout + done.stderr


def test_the_verifier_command_is_installed(installed):
    done = run_installed(installed, "gradsched-verify", "--help")
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stdout + done.stderr


def test_tensor_parallel_training_runs_from_the_installed_wheel_with_the_losses_of_one_process(installed, tmp_path):
    """The Llama's layers split over tp 2 in each of 2 pipeline stages, started by gradsched.train's own launcher:
    its losses and gradient norms are one process's (float32: both round alike only to ~1e-6)."""
    args = ["-m", "gradsched.train", "--model", "llama-tiny", "--steps", "3", "--seq", "32", "--batch", "8",
            "--microbatches", "2", "--compiler", "eager"]
    runs, said = {}, {}
    for name, layout in (("tp2_pp2", ["--nproc-per-node", "4", "--tp", "2", "--pp", "2"]), ("one_process", [])):
        done = run_installed(installed, *args, *layout, "--metrics", str(tmp_path / f"{name}.jsonl"))
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        runs[name], said[name] = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")], done.stdout
    assert "pp=2 dp=1 cp=1 tp=2" in said["tp2_pp2"], said["tp2_pp2"]
    assert [r["step"] for r in runs["tp2_pp2"]] == [1, 2, 3]
    for got, want in zip(runs["tp2_pp2"], runs["one_process"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got, want)
