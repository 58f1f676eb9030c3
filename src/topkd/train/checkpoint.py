"""Training checkpoints: written whole or not at all, newest one resumed.

    OUT/checkpoints/step-000050/{model.safetensors, state.pt}

A checkpoint is written into `step-NNNNNN.tmp-PID` and renamed when complete; the two newest
are kept. state.pt holds the optimizer, scheduler, torch RNG and the training position
(steps taken, samples consumed), which is all the data order needs to continue.
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

KEEP = 2


def _dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def save(out: str, model, optimizer, scheduler, state: dict) -> str:
    final = os.path.join(_dir(out), f"step-{state['step']:06d}")
    if os.path.isdir(final):
        return final
    tmp = f"{final}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(_untied(tensors), os.path.join(tmp, "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), "state": dict(state)}, os.path.join(tmp, "state.pt"))
    os.replace(tmp, final)
    for old in sorted(_complete(out))[:-KEEP]:
        shutil.rmtree(old)
    return final


def _untied(tensors: dict) -> dict:
    """safetensors refuses shared storage (tied embeddings): store such entries as their own copies."""
    seen, out = set(), {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _complete(out: str) -> list[str]:
    return [d for d in glob.glob(os.path.join(_dir(out), "step-*")) if ".tmp-" not in d]


def load_latest(out: str, model, optimizer, scheduler, state: dict) -> bool:
    """Restore the newest complete checkpoint into the given objects; False when there is none."""
    for stale in glob.glob(os.path.join(_dir(out), "step-*.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)  # a checkpoint cut short by a crash
    found = sorted(_complete(out))
    if not found:
        return False
    path = found[-1]
    missing, unexpected = model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit this student (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); use a new --out, or the student it was trained with")
    saved = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    state.update(saved["state"])
    return True


def truncate_metrics(path: str, step: int) -> None:
    """Keep only metric rows up to the resumed step (rows after it were lost with the process)."""
    if not os.path.exists(path):
        return
    rows = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)
