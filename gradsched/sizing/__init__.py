"""Sizing a plan before the GPUs are rented: what the dry run (gradsched.dryrun) needs beyond a training step.

device_attention (attention on meta tensors priced as a device's kernel) and plot (a plan's memory per stage
against the device's). May import every room below it: gradsched.training, gradsched.sync, gradsched.cp,
gradsched.passes and the foundation modules; never the public API modules.
"""
