"""The dry run beside the planner: the planner's prediction of the same figures for the same
layout (planner/api.predict: memory by category, FLOPs per rank), and the text `ndtrain dryrun`
prints. The planner's peak here leaves out what a fake run cannot see (its allowance for
allocator fragmentation and the runtime's fixed overhead: CUDA context, NCCL and cuBLAS
workspaces), so both sides count the same things."""

from __future__ import annotations

from ndtrain.planner.accelerator import GiB

# The planner's memory categories (planner/memory.memory_breakdown) under the dry run's names:
# its logits (kept for the loss's backward) are activations a forward made and holds.
PLANNER_CATEGORIES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer_state",
                      "buffers": "communication_buffers", "activations": "activations", "logits": "activations"}
UNSEEN = ("overhead", "fragmentation")  # what a fake run cannot see


def planner_figures(cfg, layout, world: int, hardware: str = "h100") -> dict:
    """The planner's prediction for this layout, in the dry run's terms."""
    from ndtrain.layout.flops import flops_per_token, recompute_flops_per_token
    from ndtrain.planner.api import predict, predict_collective_bytes

    lay = {k: v for k, v in layout.as_dict().items() if k != "layers_per_stage"}
    # The rows a micro-batch holds as the runtime splits them: a rank's rows evenly over its
    # micro-batches, fewer than train.micro_batch where the rank has fewer rows than that.
    rows, m = layout.rows(cfg.train.global_batch), layout.micro_batches(cfg.train.global_batch)
    lay["micro_batch"] = -(-rows // m)
    args = (cfg.model, lay, cfg.data.seq_len, cfg.train.global_batch, hardware)
    pred = predict(*args, world=world, precision=cfg.parallel.mixed_precision)
    traffic = predict_collective_bytes(*args, world=world, precision=cfg.parallel.mixed_precision)
    mem = pred.memory
    memory = dict.fromkeys(dict.fromkeys(PLANNER_CATEGORIES.values()), 0)
    for key, category in PLANNER_CATEGORIES.items():
        memory[category] += int(mem.get(key, 0))
    tokens = cfg.train.global_batch * cfg.data.seq_len
    # the attention a causal flash kernel computes, the half the dry run counts (compat/fake.py)
    per_token = flops_per_token(cfg.model, cfg.data.seq_len, "causal")
    per_token += recompute_flops_per_token(cfg.model, cfg.data.seq_len, layout.activation_checkpoint, "causal")
    return {"peak_memory_bytes": int(sum(memory.values())), "memory_bytes": memory,
            "left_out_bytes": {k: int(mem.get(k, 0)) for k in UNSEEN}, "device": mem.get("device"),
            "flops": per_token * tokens / world, "step_time_s": pred.step_time, "time_s": pred.time,
            "collective_bytes": {kind: {dim: int(b) for dim, b in dims.items()} for kind, dims in traffic.items()},
            "hardware": hardware}


def compare(result: dict) -> dict:
    """The dry run's result (tools/dryrun.run_rank) as the JSON object: its figures, the
    planner's, and their ratios."""
    from ndtrain.errors import NdtrainError

    cfg, layout = result.pop("config"), result.pop("layout_obj")
    try:
        planner = planner_figures(cfg, layout, result["world"])
    except NdtrainError as e:  # a layout the planner does not model: the dry run's figures alone
        return {**result, "planner": {"unavailable": str(e)}, "dry_run_over_planner": {}}
    ratios = {"peak_memory": _ratio(result["peak_memory_bytes"], planner["peak_memory_bytes"]),
              "flops": _ratio(result["flops"], planner["flops"])}
    for k, v in result["memory_bytes"].items():
        if k in planner["memory_bytes"]:
            ratios[k] = _ratio(v, planner["memory_bytes"][k])
    ratios["collective_bytes"] = {
        kind: {dim: _ratio(row["bytes"], planner["collective_bytes"].get(kind, {}).get(dim, 0)) for dim, row in dims.items()}
        for kind, dims in result["collective_bytes"].items()}
    return {**result, "planner": planner, "dry_run_over_planner": ratios}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def text(out: dict) -> str:
    lines = [f"dry run: rank {out['rank']} of {out['world']} ({out['layout']}; "
             f"{', '.join(f'{k}={v}' for k, v in out['mesh_coordinates'].items()) or 'no mesh'})"]
    planner = out["planner"]
    if "unavailable" in planner:
        lines.append(f"  the planner does not model this layout: {planner['unavailable']}")
        planner = {"memory_bytes": {}, "peak_memory_bytes": 0, "left_out_bytes": {}, "flops": 0}
    lines.append(f"  {'memory (GiB)':<24}{'dry run':>10}{'planner':>10}")
    for k, v in out["memory_bytes"].items():
        p = planner["memory_bytes"].get(k)
        lines.append(f"  {k:<24}{v / GiB:>10.2f}{'' if p is None else f'{p / GiB:10.2f}'}")
    lines.append(f"  {'peak':<24}{out['peak_memory_bytes'] / GiB:>10.2f}{planner['peak_memory_bytes'] / GiB:>10.2f}"
                 f"   (peak during {out['peak_phase']}; the planner's fragmentation and overhead, "
                 f"{sum(planner['left_out_bytes'].values()) / GiB:.2f} GiB, left out)")
    lines.append(f"  {'TFLOP per step':<24}{out['flops'] / 1e12:>10.2f}{planner['flops'] / 1e12:>10.2f}")
    lines.append(f"  operators launched: {sum(v for k, v in out['operators'].items() if k != 'build')} in the step "
                 f"({', '.join(f'{k} {v}' for k, v in out['operators'].items())})")
    predicted = planner.get("collective_bytes", {})
    lines.append(f"  {'collective (GiB a step)':<30}{'calls':>7}{'dry run':>10}{'planner':>10}")
    for kind in sorted(set(out["collective_bytes"]) | set(predicted)):
        seen, priced = out["collective_bytes"].get(kind, {}), predicted.get(kind, {})
        for dim in sorted(set(seen) | set(priced)):
            row, p = seen.get(dim), priced.get(dim)
            lines.append(f"  {kind + ' over ' + dim:<30}{row['calls'] if row else 0:>7}"
                         f"{(row['bytes'] if row else 0) / GiB:>10.3f}{'' if p is None else f'{p / GiB:10.3f}'}")
    if "routing" in out:
        lines.append(f"  expert routing assumed: {out['routing']}")
    reads = out["host_reads"]
    lines.append(f"  host reads of device values in the step: {len(reads)}")
    lines += [f"    {r}" for r in reads]
    from ndtrain.tools.dryrun_syncs import sync_lines

    lines += sync_lines(out)
    if "roles" in out:
        lines.append(f"  roles: {[r['rank'] for r in out['roles']]}; the worst is rank {out['worst_rank']}")
    return "\n".join(lines)
