"""
A run's records: out_dir/metrics.jsonl, one JSON object a line, and the same records in Weights & Biases and
TensorBoard where the run asks for them. Only the master process records anything.

    log, close = open_log("out", {"learning_rate": 6e-4}, master=True)
    log({"iter": 10, "loss": 2.5})
"""

import json
import os


def open_log(out_dir, config, master, wandb_log=False, wandb_project="gpt", wandb_run_name="run",
             tensorboard_log=False):
    """(log, close): log(record) writes a record (a dict with the step as "iter") everywhere asked; close()
    writes out what TensorBoard buffers. Both do nothing outside the master."""
    if not master:
        return (lambda record: None), (lambda: None)
    if wandb_log:  # optional: imported only when asked for
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
    tensorboard = None
    if tensorboard_log:
        from torch.utils.tensorboard import SummaryWriter
        tensorboard = SummaryWriter(os.path.join(out_dir, "tb"))
    failed = False

    def log(record):
        nonlocal failed
        try:
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a record lost is no reason to lose the run: said once
            if not failed:
                print(f"warning: cannot write {out_dir}/metrics.jsonl ({e.strerror}); training goes on without it")
            failed = True
        if wandb_log:
            wandb.log(record, step=record["iter"])
        if tensorboard:
            for key, value in record.items():  # the numbers: not the step itself, a None or the skipped flag
                if key != "iter" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    tensorboard.add_scalar(key, value, record["iter"])

    def close():
        if tensorboard:
            tensorboard.close()

    return log, close
