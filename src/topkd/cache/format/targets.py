"""The kinds of teacher target a cache can hold (`cache build --targets NAME`), and what each one means.

    kind = TARGET_KINDS["sampled"]
    kind.row_width(cfg)                          # entries per cached row for these build settings
    kind.training_problem("reverse_kl", 1.0, 0)  # why it cannot train so, or None
    kind.export_refusal                          # why the Axolotl format cannot hold it, or ""

One entry per kind, as ENGINES (topkd/cache/building/engines.py) and CODECS (topkd/cache/format/shard_codecs.py):
the build, `cache inspect`, `cache export`, `topkd train` and KDTrainer ask this table what a kind stores and
allows, never which kind it is (tests/cache/test_targets.py checks that no other module compares a kind's
name). A new kind (on-policy rows, cross-tokenizer rows) is a new entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from topkd.cache.format.adaptive import adaptive_rows

MAX_COUNT = 255  # the most draws a plain sampled row stores: counts are one byte each
# divergences whose estimate from count / N rows (zero off the drawn ids) is unbiased at T = 1
UNBIASED_FROM_DRAWS = ("kl", "jsd", "tvd")


@dataclass(frozen=True)
class TargetKind:
    name: str
    help: str  # what a row holds, for `cache build --help`
    # rows of variable width (cache format 5, ragged; -inf entries are padding)
    variable_k: bool
    # drawn from the teacher's full softmax at T = 1: needs an engine that sees every logit, stores no c_T,
    # and trains only a forward divergence at T = 1 (count / N is unbiased for nothing else)
    draws: bool
    # the rows hold all the teacher's mass (no tail bucket): a kept-mass histogram would say nothing
    holds_all_mass: bool
    width_label: str  # what `cache inspect` calls the ids of a row
    export_refusal: str  # why the Axolotl format cannot hold these rows ("": it can)
    row_width: Callable  # (build settings) -> entries per cached row
    # (build settings) -> the flags that set the row width, as the user typed them: "--k 100"
    width_flags: Callable
    settings: Callable  # (build settings) -> the kind's part of the build hash, or None (none: top-K's old hash)
    describe: Callable  # (the manifest's build["targets"], K) -> one line for `cache inspect`
    check: Callable  # (build settings) -> None, or ValueError naming the setting and the remedy
    label: Callable  # (build settings) -> a short name for reports: "top-100", "sampled N=50"
    # the `cache build` settings only this kind reads (another kind's build refuses them rather than ignore them)
    flags: tuple[str, ...] = ()
    # (build settings, the engine's EngineRows) -> the rows this kind stores
    adapt: Callable = lambda cfg, rows: rows

    def training_problem(self, divergence: str, temperature: float, top_k: int) -> str | None:
        """Why a student cannot train on these rows with this divergence, temperature and top_k, or None."""
        if not self.draws:
            return None
        if divergence in UNBIASED_FROM_DRAWS and float(temperature) == 1.0 and not top_k:
            return None
        return (
            f"{self.name} targets (an unbiased estimate of the teacher at T = 1, zero off the drawn ids) "
            f"expected divergence {'|'.join(UNBIASED_FROM_DRAWS)}, temperature 1 and no top_k, got "
            f"divergence={divergence} temperature={temperature} top_k={top_k}"
        )

    def counts_of(self, cfg) -> int | None:
        """N when every stored value is count / N exactly (stored as counts), else None."""
        return cfg.samples if self.draws and not cfg.head else None


def _check_sampled(cfg) -> None:
    # plain draws are stored as counts, one byte each (cache/format/ragged.py); a hybrid's as log-prob codes
    if not cfg.head and cfg.samples > MAX_COUNT:
        raise ValueError(
            f"--samples: expected at most {MAX_COUNT} draws per token (each id's count is stored in one byte), "
            f"got {cfg.samples}; pass --samples {MAX_COUNT} or fewer (100 is the default)"
        )


def _check_topp(cfg) -> None:
    if not (0 < cfg.top_p <= 1 and isinstance(cfg.min_k, int) and 1 <= cfg.min_k <= cfg.k):
        raise ValueError(
            f"--targets topp: expected 0 < --top-p <= 1 and 1 <= --min-k <= --k, got top_p={cfg.top_p} "
            f"min_k={cfg.min_k} k={cfg.k}"
        )


def _sampled_settings(cfg) -> dict:
    # no head: the hash of builds made before --head existed
    head = {"head": cfg.head} if cfg.head else {}
    return {"kind": "sampled", "samples": cfg.samples, "temperature": 1.0, **head}


def _describe_sampled(targets: dict, k: int) -> str:
    head = targets.get("head", 0)
    exact = f"the {head} most likely ids exact, then " if head else ""
    return (
        f"sampled    {exact}{targets.get('samples')} draws per token from the full softmax (T = 1), kept "
        "as the distinct ids with count / N: every row sums to 1, unbiased for full-vocabulary KD"
    )


def _describe_topp(targets: dict, k: int) -> str:
    return (
        f"top-p      the fewest ids holding p >= {targets.get('top_p')} (at least {targets.get('min_k')}, "
        f"at most K = {k}); the rest of the mass in the tail"
    )


TOPK = TargetKind(
    name="topk",
    help="topk (the teacher's K most likely ids, exact, the rest one tail bucket; the paper's method, and what "
    "temperatures and reverse KL need)",
    variable_k=False,
    draws=False,
    holds_all_mass=False,
    width_label="ids stored",
    export_refusal="",
    row_width=lambda cfg: cfg.k,
    width_flags=lambda cfg: f"--k {cfg.k}",
    settings=lambda cfg: (
        None
    ),  # no part: top-K caches keep the hash they had before other kinds existed
    describe=lambda targets, k: (
        f"top-K      the teacher's {k} most likely ids; the rest of the mass in the tail"
    ),
    check=lambda cfg: None,
    label=lambda cfg: f"top-{cfg.k}",
    flags=("k",),
)
SAMPLED = TargetKind(
    name="sampled",
    help="sampled (--samples N draws per token from the teacher's softmax: the distinct ids with count / N, "
    "an unbiased estimate of the full distribution; --head H keeps the H most likely exact)",
    variable_k=True,
    draws=True,
    holds_all_mass=True,
    width_label="distinct ids drawn",
    export_refusal="rows of variable K, which its collator cannot pair",
    row_width=lambda cfg: cfg.samples + cfg.head,  # the most distinct ids a row can hold
    width_flags=lambda cfg: (
        f"--head {cfg.head} + --samples {cfg.samples}" if cfg.head else f"--samples {cfg.samples}"
    ),
    settings=_sampled_settings,
    describe=_describe_sampled,
    check=_check_sampled,
    label=lambda cfg: (
        f"sampled head {cfg.head} + N={cfg.samples}" if cfg.head else f"sampled N={cfg.samples}"
    ),
    flags=("samples", "head"),
)
TOPP = TargetKind(
    name="topp",
    help="topp (adaptive top-K: per token the fewest of the top --k reaching --top-p, at least --min-k)",
    variable_k=True,
    draws=False,
    holds_all_mass=False,
    width_label="ids stored",
    export_refusal="rows of variable K, which its collator cannot pair",
    row_width=lambda cfg: cfg.k,
    width_flags=lambda cfg: f"--k {cfg.k}",
    settings=lambda cfg: {"kind": "topp", "top_p": cfg.top_p, "min_k": cfg.min_k},
    describe=_describe_topp,
    check=_check_topp,
    label=lambda cfg: f"top-p {cfg.top_p}",
    flags=("k", "top_p", "min_k"),
    adapt=lambda cfg, rows: adaptive_rows(rows, cfg.top_p, cfg.min_k, tuple(cfg.temperatures)),
)
TARGET_KINDS = {kind.name: kind for kind in (TOPK, SAMPLED, TOPP)}


def target_kind(name: str) -> TargetKind:
    """The kind called name, or ValueError listing the kinds."""
    if name not in TARGET_KINDS:
        raise ValueError(f"targets: expected one of {tuple(TARGET_KINDS)}, got {name!r}")
    return TARGET_KINDS[name]


def kind_of_manifest(build: dict) -> TargetKind:
    """The kind a cache's manifest records (builds before other kinds existed record none: top-K)."""
    targets = build.get("targets")
    return target_kind(targets.get("kind", TOPK.name) if isinstance(targets, dict) else TOPK.name)
