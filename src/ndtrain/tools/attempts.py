"""How each attempt of a run began and ended, from its metrics rows: a restart that torchrun
began (after a failure, or re-forming the group) or a resume that a user's new `ndtrain train`
began, and how the attempt before it ended. Torch-free, for the report."""

from __future__ import annotations

from ndtrain.train.resilience import new_launch  # the rule, shared with the trainer's membership row


def classify_attempts(rows: list[dict]) -> None:
    """Marks each start row after the first with `kind`: "resume" (a new launch: the user ran
    `ndtrain train` again) or "restart" (torchrun began it: after a failure, or re-forming the
    group), and `after`: how the attempt before it ended ("finished", "stopped" by a signal,
    "interrupted", "left" the group; None: no end recorded, a crash or an older ndtrain). A
    `membership` row before a resume is marked too: the user changed the world, no self-healing did.
    Runs whose start rows do not record their launch count a start after a finished attempt
    as a resume (nothing restarts a finished run) and any other as a restart."""
    previous, ended, membership, last_time = None, None, None, None
    for row in rows:
        event = row.get("event")
        if event not in ("start", "restart", "membership") and isinstance(row.get("time"), (int, float)):
            last_time = row["time"]
        if "loss" in row and row.get("last"):
            ended = ended or "finished"
        elif event == "end":
            ended = str(row.get("how") or "stopped")
        elif event == "membership":
            membership = row
        elif event in ("start", "restart"):
            if previous is not None:
                resume = bool(new_launch(previous, row)) or ended == "finished"
                row["kind"], row["after"] = ("resume" if resume else "restart"), ended
                if isinstance(row.get("time"), (int, float)) and last_time is not None:
                    row["since_previous_s"] = row["time"] - last_time
                if membership is not None and resume:
                    membership["resume"] = True
            previous, ended, membership = row, None, None
