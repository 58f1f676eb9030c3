"""Training checkpoints: torch distributed checkpoints (DCP), written whole or not at all, checksummed.

    OUT/checkpoints/step-000050/{.metadata, __0_0.distcp, ..., train_state.json, checksums.json}

Model and optimizer go through torch.distributed.checkpoint, so each rank writes only its own
shards and a run may resume with a different number of processes (DCP reshards on load); one
plain process uses the same format. Everything is written into `step-NNNNNN.tmp`; rank 0 then
writes train_state.json (scheduler, steps taken, samples consumed: all the data order needs) and
checksums.json (size and sha256 of every file), fsyncs every file and the directory, and renames
it. The two newest are kept. Loading verifies the checksums first: a damaged checkpoint is set
aside as `step-NNNNNN.damaged` with a warning and the newest intact one is used. Nothing is
unpickled freely: DCP's metadata goes through an allow-list unpickler, tensors through
torch.load(weights_only=True), the rest is JSON. Random state is not saved: each step reseeds
from (seed, step, rank).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import re
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from topkd.base import dist
from topkd.base.files import file_sha256, fsync_path, write_atomic

KEEP = 2
STATE_FILE = "train_state.json"
CHECKSUMS = "checksums.json"
STEP_DIR = re.compile(r"step-(\d{6})$")


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
        dcp.save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=tmp,
            no_dist=not dist.active(),
        )
    dist.barrier()
    if dist.rank() == 0:
        write_atomic(
            os.path.join(tmp, STATE_FILE),
            json.dumps({"scheduler": scheduler.state_dict(), "state": dict(state)}).encode(),
        )
        files = [name for name in sorted(os.listdir(tmp)) if not name.startswith(CHECKSUMS)]
        sums = {
            n: {
                "bytes": os.path.getsize(os.path.join(tmp, n)),
                "sha256": file_sha256(os.path.join(tmp, n)),
            }
            for n in files
        }
        for name in sums:  # DCP's own files: durable before the rename makes them trusted
            fsync_path(os.path.join(tmp, name))
        write_atomic(
            os.path.join(tmp, CHECKSUMS), json.dumps(sums, indent=1, sort_keys=True).encode()
        )
        os.replace(tmp, final)
        fsync_path(_dir(out), directory=True)
        for old in _complete(out)[:-KEEP]:
            shutil.rmtree(old)
    dist.barrier()
    return final


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it assumes one process when torch.distributed is not initialised: here that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _complete(out: str) -> list[str]:
    """Renamed (so finished) checkpoints, oldest first."""
    found = [d for d in glob.glob(os.path.join(_dir(out), "step-*")) if STEP_DIR.search(d)]
    return sorted(d for d in found if os.path.exists(os.path.join(d, CHECKSUMS)))


def latest_step(out: str) -> int | None:
    """Step of the newest finished checkpoint (not yet verified), None when there is none."""
    found = _complete(out)
    return int(STEP_DIR.search(found[-1]).group(1)) if found else None


def damage(path: str) -> str | None:
    """None when every file listed in checksums.json has its size and sha256 (and nothing is missing)."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            sums = json.load(f)
        if not isinstance(sums, dict) or STATE_FILE not in sums or ".metadata" not in sums:
            return f"{CHECKSUMS} lists no {STATE_FILE} or .metadata"
        for name, want in sums.items():
            file = os.path.join(path, os.path.basename(name))
            if not os.path.isfile(file):
                return f"{name}: missing"
            if os.path.getsize(file) != want["bytes"] or file_sha256(file) != want["sha256"]:
                return f"{name}: size or sha256 differs from {CHECKSUMS}"
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"{CHECKSUMS} unreadable ({type(e).__name__})"
    return None


def _newest_intact(out: str) -> str | None:
    """Rank 0 walks back from the newest checkpoint, setting damaged ones aside with a warning."""
    for path in reversed(_complete(out)):
        problem = damage(path)
        if problem is None:
            return path
        aside = path + ".damaged"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        print(
            f"topkd train: warning: checkpoint {path} is damaged ({problem}); set aside as {aside}, resuming from "
            "the newest intact one",
            file=sys.stderr,
            flush=True,
        )
    return None


def load_latest(out: str, module, optimizer, scheduler, state: dict) -> bool:
    """Restore the newest intact checkpoint into the given objects; False when there is none."""
    found_any = bool(_complete(out))
    if dist.rank() == 0:
        for stale in glob.glob(os.path.join(_dir(out), "step-*.tmp")):
            shutil.rmtree(stale, ignore_errors=True)  # a checkpoint cut short by a crash
        path = _newest_intact(out)
        step = -1.0 if path is None else float(STEP_DIR.search(path).group(1))
    else:
        step = -1.0
    step = int(dist.all_max(step))
    if step < 0:
        if found_any:
            raise ValueError(
                f"{_dir(out)}: every checkpoint is damaged (set aside as *.damaged); delete "
                f"{_dir(out)} to start this run over, or use a new --out"
            )
        return False
    path = os.path.join(_dir(out), f"step-{step:06d}")
    try:
        SafeReader(path).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
        raise ValueError(f"{path}: {e}; delete this checkpoint (or use a new --out)") from None
    model_state, optim_state = get_state_dict(module, optimizer)
    try:
        with _one_process_is_intended():
            dcp.load(
                {"model": model_state, "optim": optim_state},
                storage_reader=SafeReader(path),
                no_dist=not dist.active(),
            )
    # DCP reports a mismatch as a CheckpointException wrapping each rank's error
    except Exception as e:
        raise ValueError(
            f"{path}: checkpoint does not fit this student and optimizer ({str(e).splitlines()[0][:300]})"
            "; use a new --out, or the student it was trained with"
        ) from e
    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    with open(os.path.join(path, STATE_FILE)) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved["scheduler"])
    state.update(saved["state"])
    return True


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: only its own record types, torch sizes, dtypes and layouts may be built."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),  # where Python 3.13 moved it
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (
            module == "torch.distributed.checkpoint.metadata"
            or (module, name) in self.ALLOWED
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never "
            "holds; refusing to load it"
        )


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read with the allow-list unpickler instead of pickle.load."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metrics_row(path: str, step: int) -> dict:
    """The metrics row of a step (the last one written for it), or {} where none was."""
    row = {}
    for line in open(path) if os.path.exists(path) else []:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if (parsed := json.loads(line))["step"] == step:
                row = parsed
    return row


def truncate_metrics(path: str, step: int) -> None:
    """Keep only metric rows up to the resumed step (rows after it were lost with the process); atomic."""
    if dist.rank() != 0 or not os.path.exists(path):
        return
    rows = []
    for line in open(path):
        # a line cut short by a kill is dropped
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(line)["step"] <= step:
                rows.append(line if line.endswith("\n") else line + "\n")
    write_atomic(path, "".join(rows).encode())
