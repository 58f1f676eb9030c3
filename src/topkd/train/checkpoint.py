"""Training checkpoints: torch distributed checkpoints (DCP), written whole or not at all.

    OUT/checkpoints/step-000050/{.metadata, __0_0.distcp, ..., train_state.pt}

Model and optimizer go through torch.distributed.checkpoint, so each rank writes only its own
shards and a run may resume with a different number of processes (DCP reshards on load); one
plain process uses the same format. Everything is written into `step-NNNNNN.tmp` and rank 0
renames it when every rank has finished; the two newest are kept. train_state.pt holds the
scheduler and the training position (steps taken, samples consumed), which is all the data
order needs to continue. Random state is not saved: each step reseeds from (seed, step, rank).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from topkd import dist

KEEP = 2
STATE_FILE = "train_state.pt"


def _dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def save(out: str, module, optimizer, scheduler, state: dict) -> str:
    """A collective: every rank calls it."""
    final = os.path.join(_dir(out), f"step-{state['step']:06d}")
    if os.path.isdir(final):
        return final
    tmp = f"{final}.tmp"
    model_state, optim_state = get_state_dict(module, optimizer)
    with _one_process_is_intended():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp, no_dist=not dist.active())
    if dist.rank() == 0:
        torch.save({"scheduler": scheduler.state_dict(), "state": dict(state)}, os.path.join(tmp, STATE_FILE))
        os.replace(tmp, final)
        for old in sorted(_complete(out))[:-KEEP]:
            shutil.rmtree(old)
    dist.barrier()
    return final


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it assumes one process when torch.distributed is not initialised: here that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _complete(out: str) -> list[str]:
    return [d for d in glob.glob(os.path.join(_dir(out), "step-*"))
            if not d.endswith(".tmp") and os.path.exists(os.path.join(d, STATE_FILE))]


def load_latest(out: str, module, optimizer, scheduler, state: dict) -> bool:
    """Restore the newest complete checkpoint into the given objects; False when there is none."""
    if dist.rank() == 0:
        for stale in glob.glob(os.path.join(_dir(out), "step-*.tmp")):
            shutil.rmtree(stale, ignore_errors=True)  # a checkpoint cut short by a crash
    dist.barrier()
    found = sorted(_complete(out))
    if not found:
        return False
    path = found[-1]
    model_state, optim_state = get_state_dict(module, optimizer)
    try:
        with _one_process_is_intended():
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=not dist.active())
    except Exception as e:  # DCP reports a mismatch as a CheckpointException wrapping each rank's error
        raise ValueError(f"{path}: checkpoint does not fit this student and optimizer ({str(e).splitlines()[0][:300]})"
                         "; use a new --out, or the student it was trained with") from e
    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    saved = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
    scheduler.load_state_dict(saved["scheduler"])
    state.update(saved["state"])
    return True


def truncate_metrics(path: str, step: int) -> None:
    """Keep only metric rows up to the resumed step (rows after it were lost with the process)."""
    if dist.rank() != 0 or not os.path.exists(path):
        return
    rows = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)
