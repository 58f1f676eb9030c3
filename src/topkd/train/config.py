"""TrainConfig: every `topkd train` flag, one field each, with its help text."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from topkd.base import dist
from topkd.base.checks import require_device, require_ints, require_path
from topkd.base.files import write_json_atomic
from topkd.data.chat import check_train_on
from topkd.data.samples import PACKINGS
from topkd.loss.options import LossOptions
from topkd.train.cross import check_cross_config
from topkd.train.report import require_reporter


@dataclass
class TrainConfig:
    cache: str = ""
    teacher: str = ""
    teacher_url: str = ""
    teacher_timeout: float = 120.0
    data: list[str] = field(default_factory=list)
    online_k: int = 0
    online_samples: int = 0
    max_sequences: int = 0
    text_field: str = "text"
    messages_field: str = "messages"
    train_on: str = "assistant"
    out: str = ""
    student: str = ""
    init_from_teacher: bool = False
    layers: int = 0
    seq_len: int = 0
    packing: str = "documents"
    batch_size: int = 4
    grad_accum: int = 1
    steps: int = 100
    lr: float = 3e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    divergence: str = "kl"
    tail: str = "bucket"
    temperature: float = 1.0
    beta: float = 0.5
    ce_weight: float = 0.0
    top_k: int = 0
    objective: str = "kd"
    impl: str = "fused"
    autocast_bf16: bool = False
    activation_checkpointing: bool = False
    checkpoint_every: int = 50
    loader_workers: int = 1
    seed: int = 0
    device: str = "cpu"
    skip_nonfinite: bool = False
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: list[str] = field(default_factory=list)
    merge: bool = False
    report_to: str = "none"
    fold_beyond_vocab: bool = False
    cross_tokenizer: str = ""
    on_policy: bool = False
    on_policy_fraction: float = 1.0
    max_new_tokens: int = 64
    sampling_temperature: float = 1.0
    sampling_top_p: float = 1.0


TRAIN_HELP = {
    "cache": "top-K cache directory (from `topkd cache build`)",
    "teacher": "online mode instead of --cache: run this teacher (HF dir or .gguf) in memory on --data every step",
    "teacher_url": "online mode with the teacher served elsewhere: an OpenAI-compatible completions server (vLLM, "
    "llama-cpp-python) at this base URL scores the student's tokens (topkd/cache/building/served.py); needs "
    "--student (its tokenizer must be the server's) and --online-k within the server's cap",
    "teacher_timeout": "--teacher-url: seconds to wait for one answer before the run stops (its last checkpoint kept)",
    "data": "online mode: text files (.txt, .jsonl, .npy), packed as `topkd cache build` packs them",
    "online_k": "online mode: top-K taken on the fly (0: full-vocabulary KD)",
    "online_samples": "online mode (and --on-policy): N draws a token from the in-memory teacher's softmax instead "
    "of its top-K (sampled targets, as `cache build --targets sampled`; forward KL at T = 1)",
    "max_sequences": "online mode: use only the first this many packed sequences (as `cache build --max-sequences`)",
    "text_field": "online mode: JSONL field holding the text",
    "messages_field": "online mode: JSONL field holding a conversation (rendered with the teacher's chat template)",
    "train_on": "online mode, chat data: assistant (only assistant turns count, as `cache build`) | all",
    "out": "run directory: checkpoints/, metrics.jsonl, loss.png, final/ (a rerun resumes from the last checkpoint)",
    "student": "student: a local Hugging Face model directory (or use --init-from-teacher)",
    "init_from_teacher": "derive the student from the cache's teacher: keep --layers evenly spaced layers",
    "layers": "layers kept with --init-from-teacher (first and last always kept)",
    "seq_len": "tokens per training sample (0: the cache's; other values re-slice the cached sequences)",
    "packing": "documents (rows laid end to end, attention restarts at each document) | cross (the same, attending "
    "across documents) | none (one document per sample, padded to the batch's longest; ablations)",
    "batch_size": "samples per micro-batch",
    "grad_accum": "micro-batches per optimizer step; the loss is normalised by the step's counted tokens",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW)",
    "warmup_steps": "linear warmup steps, then cosine decay to lr * min_lr_ratio",
    "min_lr_ratio": "final learning rate as a fraction of --lr",
    "weight_decay": "AdamW weight decay (not applied to norms and biases)",
    "clip": "gradient-norm clipping threshold (0: off)",
    "divergence": "kl | reverse_kl | jsd | tvd",
    "tail": "bucket | renorm",
    "temperature": "distillation temperature (tempered bucket KD needs c_T stored in the cache)",
    "beta": "JSD mixing weight",
    "ce_weight": "weight of hard-label cross entropy on the next tokens",
    "top_k": "distil from only the first N of the cache's top-K (its N most likely tokens; 0: all K)",
    "objective": "kd (distil from the teacher rows, + ce_weight x CE) | ce (hard-label CE only on the same tokens: "
    "the no-teacher baseline)",
    "impl": "loss implementation: fused (Triton passes on a GPU where they apply) | triton (Triton required; CUDA) "
    "| chunked | dense (comparisons)",
    "autocast_bf16": "bf16 mixed precision: the body under bf16 autocast (under torchrun, FSDP2 gathers bf16 "
    "parameters and reduces fp32 gradients), the loss's head GEMMs in bf16 with fp32 "
    "accumulation; master weights and optimizer state stay fp32",
    "activation_checkpointing": "recompute each block's activations in backward (less memory)",
    "loader_workers": "processes decoding the cache ahead of training (0: decode in the training process; "
    "online mode always computes teacher rows in the training process)",
    "checkpoint_every": "steps between checkpoints (0: only at the end)",
    "seed": "seed for the data order and initialisation",
    "device": "cpu | cuda (under torchrun: cuda:LOCAL_RANK, one GPU per process)",
    "skip_nonfinite": "skip (do not apply) a step whose loss or gradient norm is NaN/inf, instead of stopping the run",
    "lora_rank": "train LoRA adapters of this rank instead of every weight (peft; lm_head frozen: no dW GEMM)",
    "lora_alpha": "LoRA scaling alpha (0: twice the rank)",
    "lora_targets": "comma-separated module names that get adapters (empty: every Linear layer but lm_head)",
    "merge": "with --lora-rank: also fold the adapters into the weights and write that model to final/",
    "fold_beyond_vocab": "a student head smaller than the cache's teacher ids: fold the teacher's mass on ids "
    "beyond it into the tail bucket (exact in the bucket loss) instead of refusing the student",
    "cross_tokenizer": "uld | align: a --student whose tokenizer is not the teacher's, from a --cache with text "
    "(topkd/train/cross.py): uld trains every aligned row with ULD's sorted L1, align exact KD where the next "
    "tokens map one to one and ULD elsewhere",
    "on_policy": "online mode on chat --data: the student writes each assistant turn, the teacher scores it in "
    "memory, and only the written tokens train (topkd/train/on_policy.py); --divergence reverse_kl is the "
    "on-policy distillation recipe, kl / jsd GKD's",
    "on_policy_fraction": "--on-policy: the share of steps that are on-policy (seeded per step); the rest train "
    "on the data's own replies (read from --cache when given), as GKD's lmbda (0: offline training exactly)",
    "max_new_tokens": "--on-policy: tokens the student may write per turn (prompts longer than --seq-len minus "
    "this are left out)",
    "sampling_temperature": "--on-policy: the student's sampling temperature (0: greedy)",
    "sampling_top_p": "--on-policy: nucleus sampling of the student's completions (1: off)",
    "report_to": "none | tensorboard (event files in OUT/tensorboard) | wandb (offline unless WANDB_MODE says "
    "otherwise), beside metrics.jsonl",
}

# Flags that change nothing in the loss trajectory: a resumed run may change them. --batch-size is replaced by
# the global batch (batch x processes), which is what the trajectory depends on (processes may change on resume).
NOT_TRAJECTORY = (
    "out",
    "steps",
    "checkpoint_every",
    "loader_workers",
    "device",
    "activation_checkpointing",
    "batch_size",
    "skip_nonfinite",
    "merge",
    "report_to",
    # a served teacher may move (another host, a restarted server): its tokenizer is probed at every start
    "teacher_url",
    "teacher_timeout",
)
RUN_FILE = "run.json"


def trajectory(cfg: TrainConfig, world: int) -> dict:
    """Every setting that decides the run's loss trajectory, as stored in OUT/run.json."""
    flags = {k: v for k, v in asdict(cfg).items() if k not in NOT_TRAJECTORY}
    return {**flags, "global_batch_size": cfg.batch_size * world}


def check_resume(out: str, cfg: TrainConfig, world: int, resuming: bool) -> None:
    """Refuse to continue a run (one with a checkpoint) in --out under other flags; else record this run's."""
    path, now = os.path.join(out, RUN_FILE), trajectory(cfg, world)
    if resuming and os.path.exists(path):
        with open(path) as f:
            before = json.load(f)
        # a setting added after that run was recorded had its default then
        defaults = asdict(TrainConfig())
        before = {**{k: defaults[k] for k in now if k in defaults}, **before}
        changed = sorted(
            k
            for k in set(before) | set(now)
            if _same_input(k, before.get(k)) != _same_input(k, now.get(k))
        )
        if changed:
            diffs = ", ".join(
                f"--{k.replace('_', '-')} {before.get(k)!r} -> {now.get(k)!r}" for k in changed
            )
            raise ValueError(
                f"{out} holds a run with other settings ({diffs}); rerun with that run's flags to "
                "resume it (only --steps and speed/memory flags may change), or use a new --out"
            )
    elif dist.rank() == 0:
        write_json_atomic(path, now)


def _same_input(key: str, value):
    """A setting as resuming compares it: inputs by what they are, not how they were spelled (./caches/A, an
    absolute path, a symlink): a cache by its build hash, other paths by their real path."""
    if key == "cache" and value and os.path.isdir(value):
        from topkd.cache.format import manifest as mf

        try:
            return "cache build " + mf.load_manifest(value)["build_hash"]
        except mf.CacheError:
            return os.path.realpath(value)
    if key in ("student", "teacher") and value:
        return os.path.realpath(value)
    if key == "data" and isinstance(value, list):
        return [os.path.realpath(v) for v in value]
    return value


def check_paths(cfg: TrainConfig, teacher_dir: str | None = None) -> None:
    """--out must not be (or lie inside) the student, the cache or the teacher: saving would overwrite them."""
    out = os.path.realpath(cfg.out)
    for flag, path in (
        ("--student", cfg.student),
        ("--cache", cfg.cache),
        ("--teacher", cfg.teacher or teacher_dir),
    ):
        if path and os.path.exists(path):
            inside = os.path.realpath(path)
            if out == inside or out.startswith(inside + os.sep):
                raise ValueError(
                    f"--out {cfg.out!r} is inside {flag} {path!r}: the run would overwrite it (final/, "
                    "config.json); choose a separate --out directory"
                )


def check_config(cfg: TrainConfig) -> None:
    _check_modes(cfg)
    if cfg.objective not in ("kd", "ce"):
        raise ValueError(f"objective: expected kd | ce, got {cfg.objective!r}")
    if cfg.packing not in PACKINGS:
        raise ValueError(f"packing: expected one of {PACKINGS}, got {cfg.packing!r}")
    require_device(cfg.device)
    loss_options(cfg)  # the loss's own checks, before any model loads
    for flag, path, kind in (
        ("--cache", cfg.cache, "dir"),
        ("--teacher", cfg.teacher, "any"),
        ("--student", cfg.student, "dir"),
    ):
        if path:
            require_path(flag, path, kind)
    require_ints(cfg, ("batch_size", "grad_accum", "steps"), 1)
    counts = ("seq_len", "warmup_steps", "checkpoint_every", "layers", "seed", "online_k", "top_k")
    require_ints(cfg, ("online_samples",), 0)
    require_ints(cfg, (*counts, "max_sequences", "loader_workers"), 0)
    check_lora_and_reporting(cfg)
    check_on_policy(cfg)
    check_cross_config(cfg)
    if not (cfg.lr > 0 and 0 <= cfg.min_lr_ratio <= 1 and cfg.clip >= 0 and cfg.weight_decay >= 0):
        raise ValueError(
            f"expected lr > 0, 0 <= min_lr_ratio <= 1, clip >= 0, weight_decay >= 0; got lr={cfg.lr}, "
            f"min_lr_ratio={cfg.min_lr_ratio}, clip={cfg.clip}, weight_decay={cfg.weight_decay}"
        )


def teacher_of(cfg: TrainConfig) -> str:
    """The online teacher, in memory (--teacher) or served (--teacher-url); '' offline."""
    return cfg.teacher or cfg.teacher_url


def _check_modes(cfg: TrainConfig) -> None:
    """Offline (--cache) or online (--teacher, --data), and a student from --student or the teacher's layers."""
    teacher = teacher_of(cfg)
    both = (
        cfg.on_policy and cfg.cache and teacher
    )  # offline steps from the cache, the teacher scores
    if cfg.teacher_url:
        _check_served(cfg)
    if (bool(cfg.cache) == bool(teacher) and not both) or not cfg.out:
        raise ValueError(
            f"expected --out and exactly one of --cache (offline) or --teacher (online), or both with "
            f"--on-policy, got cache={cfg.cache!r} teacher={teacher!r} out={cfg.out!r}"
        )
    if teacher and (not cfg.data or (cfg.seq_len < 2 and not cfg.cache)):
        raise ValueError(
            f"online mode (--teacher) needs --data files and --seq-len >= 2, got data={cfg.data} "
            f"seq_len={cfg.seq_len}"
        )
    check_train_on(cfg.train_on)
    if cfg.online_samples and (not cfg.teacher or cfg.online_k):
        raise ValueError(
            f"--online-samples: expected the in-memory --teacher and no --online-k (draws replace the top-K), got "
            f"teacher={cfg.teacher!r} teacher_url={cfg.teacher_url!r} online_k={cfg.online_k}; pass --teacher "
            "and drop --online-k (a served teacher returns its top-K only)"
        )
    if cfg.cache and (((cfg.data or cfg.online_k) and not both) or cfg.max_sequences):
        raise ValueError(
            f"--data, --online-k and --max-sequences belong to online mode (--teacher); with --cache "
            f"the data is the cache's, got data={cfg.data} online_k={cfg.online_k} "
            f"max_sequences={cfg.max_sequences}; with --on-policy --teacher T, --data holds the prompts"
        )
    if bool(cfg.student) == cfg.init_from_teacher:
        raise ValueError(
            "expected exactly one of --student DIR or --init-from-teacher, got "
            f"student={cfg.student!r} init_from_teacher={cfg.init_from_teacher}"
        )
    if cfg.init_from_teacher and cfg.layers < 1:
        raise ValueError(f"--init-from-teacher needs --layers >= 1, got {cfg.layers}")


def _check_served(cfg: TrainConfig) -> None:
    """--teacher-url: what a server can give (its top-K at T = 1) and what it cannot (layers to copy)."""
    if cfg.teacher or cfg.init_from_teacher or cfg.online_k < 1 or not cfg.teacher_timeout > 0:
        raise ValueError(
            f"--teacher-url {cfg.teacher_url}: expected no --teacher, no --init-from-teacher (a server has no "
            f"layers to copy: pass --student), --online-k >= 1 and --teacher-timeout > 0, got teacher="
            f"{cfg.teacher!r} init_from_teacher={cfg.init_from_teacher} online_k={cfg.online_k} "
            f"teacher_timeout={cfg.teacher_timeout}; pass --student DIR --online-k 20 (vLLM's default cap)"
        )
    if not cfg.teacher_url.startswith(("http://", "https://")):
        raise ValueError(
            f"--teacher-url: expected an http(s):// base URL such as http://localhost:8000/v1, got "
            f"{cfg.teacher_url!r}"
        )


ON_POLICY_FLAGS = ("on_policy_fraction", "max_new_tokens", "sampling_temperature", "sampling_top_p")


def check_on_policy(cfg: TrainConfig) -> None:
    """--on-policy's own flags: refused without it (they would be ignored); with it, the mode they need."""
    defaults = TrainConfig()
    if not cfg.on_policy:
        for name in ON_POLICY_FLAGS:
            if getattr(cfg, name) != getattr(defaults, name):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag}: expected only with --on-policy, got {flag} {getattr(cfg, name)} without it, "
                    f"which would ignore it; drop {flag}, or add --on-policy"
                )
        return
    if not teacher_of(cfg) or not cfg.data or cfg.objective != "kd":
        raise ValueError(
            f"--on-policy: expected --teacher or --teacher-url (which scores the student's completions), --data "
            f"(chat JSONL: the prompts) and --objective kd, got teacher={teacher_of(cfg)!r} data={cfg.data} "
            f"objective={cfg.objective!r}; pass --teacher and --data (and --cache for its offline steps)"
        )
    require_ints(cfg, ("max_new_tokens",), 1)
    if not (
        0 <= cfg.on_policy_fraction <= 1
        and cfg.sampling_temperature >= 0
        and 0 < cfg.sampling_top_p <= 1
        and (cfg.max_new_tokens < cfg.seq_len or (cfg.cache and not cfg.seq_len))  # 0: the cache's
    ):
        raise ValueError(
            f"--on-policy: expected 0 <= --on-policy-fraction <= 1, --sampling-temperature >= 0, "
            f"0 < --sampling-top-p <= 1 and --max-new-tokens below --seq-len, got {cfg.on_policy_fraction}, "
            f"{cfg.sampling_temperature}, {cfg.sampling_top_p}, {cfg.max_new_tokens} and --seq-len {cfg.seq_len}"
        )


def check_lora_and_reporting(cfg: TrainConfig) -> None:
    require_ints(cfg, ("lora_rank",), 0)
    if (cfg.lora_alpha or cfg.lora_targets or cfg.merge) and not cfg.lora_rank:
        raise ValueError(
            f"--lora-alpha, --lora-targets and --merge go with --lora-rank R, got lora_rank=0 with "
            f"alpha={cfg.lora_alpha} targets={cfg.lora_targets} merge={cfg.merge}; add --lora-rank"
        )
    if not (isinstance(cfg.lora_alpha, (int, float)) and cfg.lora_alpha >= 0):
        raise ValueError(
            f"--lora-alpha: expected a number >= 0 (0: twice --lora-rank), got {cfg.lora_alpha!r}"
        )
    head = [t for t in cfg.lora_targets if t in ("lm_head", "embed_out", "output")]
    if head:
        raise ValueError(
            f"--lora-targets: expected modules of the body, got {head}: the fused KD loss reads the "
            "lm_head weight directly, so it stays frozen (adapters on it would get no gradient); "
            "drop it from --lora-targets, or train the full model without --lora-rank"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))  # checked before the process group exists
    if cfg.lora_rank and world > 1:
        raise ValueError(
            f"--lora-rank: expected one process, got {world} under torchrun (LoRA is not wired "
            "into FSDP2 here); run one process, or use topkd.hf.KDTrainer with accelerate"
        )
    if cfg.lora_rank:
        from topkd.train.lora import require_peft

        require_peft()
    require_reporter(cfg.report_to)


def loss_options(cfg: TrainConfig) -> LossOptions:
    """The loss this run trains with (validated: the loss's own rules and messages)."""
    return LossOptions(
        divergence=cfg.divergence,
        tail=cfg.tail,
        temperature=cfg.temperature,
        beta=cfg.beta,
        ce_weight=cfg.ce_weight,
        reduction="sum",
        impl=cfg.impl,
    )
