"""The dry run's command line checked before anything is built: each mistake one line naming the flag and what
to give instead (a wrong value found after a minutes-long dry run, or as a traceback, costs the user both)."""
from __future__ import annotations

import argparse
import json
import os

from gradsched.sizing.dryrun_text import parse_bytes

POSITIVE = ("pp", "dp", "cp", "tp", "max_tp", "seq", "batch", "microbatches", "gpus", "global_batch", "top", "jobs")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, but not None (the help says what happens then)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def check(ap: argparse.ArgumentParser, args) -> None:
    """ap.error (a usage line and the message, exit 2) at the first mistake in `args`."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} {value}: give a positive number.")
    for flag, text in (("--device-memory", args.device_memory), ("--fit", args.fit)):
        if text is not None:
            try:
                if parse_bytes(text) <= 0:
                    raise ValueError
            except ValueError:
                ap.error(f"{flag} {text}: give a size such as 80GiB, 141GiB, 24GB or 512MiB.")
    m = args.microbatches or args.pp
    if args.batch is not None and not args.fit and args.batch % m:
        ap.error(f"--batch {args.batch} does not split into {m} micro-batches (--microbatches, default --pp): "
                 f"give a multiple of {m}.")
    if args.module is not None and (args.tie or args.checkpointing):
        ap.error(f"--module with {'--tie' if args.tie else '--checkpointing'}: they act on the built-in and --config "
                 "models; tie weights or checkpoint layers in your factory instead.")
    if args.config is not None:
        check_config(ap, args.config)


def check_config(ap: argparse.ArgumentParser, path: str) -> None:
    """A local config.json (or a directory holding one) that parses, with a model_type: never a download."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        ap.error(f"--config {path}: no such file{' in that directory' if os.path.isdir(path) else ''}; give a "
                 "Hugging Face config.json or the directory holding one.")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"--config {path}: not readable as JSON ({e}).")
    if not isinstance(config, dict) or "model_type" not in config:
        ap.error(f"--config {path}: no \"model_type\" in it; a Hugging Face config.json names its model type.")
