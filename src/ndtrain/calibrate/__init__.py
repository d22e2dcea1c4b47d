"""Measuring this machine, with torch: what the planner's hardware model and the runtime's MFU
divide by come from here, and only the measuring does.

    host_probe   the short per-host CPU probe, cached (the runtime's CPU defaults, the MFU peak)
    peak_flops   the peak FLOP/s a run's MFU divides by (a GPU's from the catalog, else measured)
    cpu          `ndtrain calibrate` on CPU ranks: matmul, attention, copy, collectives, host costs
    host_costs   the host time of eager training steps (plain, tensor- and data-parallel)
    gpu          `ndtrain calibrate` on a GPU node: GEMMs, attention, HBM, memory, NCCL
    measure      what the CPU and GPU calibrations share: one timing, attention, the collectives
    links        `ndtrain calibrate --links`: the link between nodes, under torchrun

What reads it is torch-free and stays in the planner (planner/profile.py reads a GPU profile,
profile_fit.py fits it, host_cache.py keeps the probe's cache, run_fit.py fits recorded runs), so a
profile measured on a cluster plans on a laptop; the command is tools/calibrate_command.py.
"""
