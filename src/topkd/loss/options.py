"""The loss's options in one validated object: every rule about them lives here, once.

    options = LossOptions(divergence="kl", tail="bucket", temperature=2.0)   # refused here if inconsistent
    options.needs_logz        # True: tempered teacher buckets need c_T from the cache
    fused_linear_kd(hidden, weight, ids, logprobs, teacher_logz=c_T, **options.kwargs())

fused_linear_kd builds one from its keyword arguments; KDLoss holds one; `topkd train` builds one from
its flags (train.config.loss_options) and asks it which cache columns and labels the loss needs. The chunk
math's LossSpec (topkd/loss/chunk.py) is these options plus what the call's tensors decide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from topkd.loss import validate


@dataclass(frozen=True)
class LossOptions:
    divergence: str = "kl"
    tail: str = "bucket"
    temperature: float = 1.0
    beta: float = 0.5
    ce_weight: float = 0.0
    reduction: str = "mean"
    impl: str = "fused"
    chunk_size: int | None = None
    # student logits are c tanh(z / c) (Gemma-2 style final_logit_softcapping)
    softcap: float | None = None

    def __post_init__(self) -> None:
        validate.check_names(self.divergence, self.tail, self.impl, self.reduction)
        validate.check_numbers(
            self.temperature, self.beta, self.ce_weight, self.divergence, self.chunk_size
        )
        validate.check_softcap(self.softcap)
        for name in ("temperature", "beta", "ce_weight") + (
            ("softcap",) if self.softcap is not None else ()
        ):
            # ints and numpy scalars: plain floats
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def needs_logz(self) -> bool:
        """Tempered bucket KD needs the teacher's c_T = log sum_v exp(a_v / T) (stored in the cache)."""
        return self.temperature != 1.0 and self.tail == "bucket"

    @property
    def logz_temperature(self) -> float | None:
        """The T whose c_T the loss reads from the teacher rows (None: it needs none)."""
        return self.temperature if self.needs_logz else None

    @property
    def needs_labels(self) -> bool:
        return self.ce_weight > 0

    @property
    def untempered_softmax(self) -> bool:
        """Hard-label CE at T != 1 needs the untempered softmax too: a second [C, V] buffer per chunk."""
        return self.ce_weight > 0 and self.temperature != 1.0

    def check_inputs(self, has_logz: bool, has_labels: bool) -> None:
        """The tensors this call passed, against what these options need."""
        validate.check_temperature_tail(self.tail, float(self.temperature), has_logz)
        if self.needs_labels and not has_labels:
            raise ValueError(
                f"ce_weight={self.ce_weight} needs labels (next-token ids, -100 ignored), got None; "
                "pass labels or set ce_weight=0"
            )

    def kwargs(self) -> dict:
        return asdict(self)
