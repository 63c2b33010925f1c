"""Sizing a plan before the GPUs are rented: what the dry run (gradsched.dryrun) needs beyond a training step.

device_attention (attention on meta tensors priced as a device's kernel), accounting (what one role holds and
moves, and the verifier's verdict), report (what the dry run prints), plot (a plan's memory per stage against the
device's) and fit (every layout of a GPU count priced from a few probes the dry run measures). May import every
room below it: gradsched.training, gradsched.sync, gradsched.cp, gradsched.passes and the foundation modules;
never the public API modules (fit is handed the dry run as a function).
"""
