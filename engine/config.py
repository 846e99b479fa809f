"""One typed config per pruning run, saved as config.json beside its results."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .executors import EXECUTORS
from .fields import check_fields
from .loading import DEFAULT_MODEL, DTYPES
from .methods import METHODS, method_options
from .metrics import layer_metrics, unit_metrics
from .metrics.probability import PROB_MAPS
from .policy import LR_SCHEDULE_FNS
from .unit_types import UNIT_TYPES
from .units import SCOPES

# the choices of settings that name a registry entry come from the registry (validate() reads the registries
# themselves, so an entry registered later, e.g. by a user's script, is accepted too)
INITS = (*unit_metrics(), "random-progressive")  # random-progressive: random scores, the rate raised in stages
LAYER_INITS = layer_metrics()
LR_SCHEDULES = tuple(LR_SCHEDULE_FNS)
FINAL_MASKS = ("last", "best-val")
SAMPLE_FORWARDS = ("auto", *EXECUTORS)
WITHIN_LAYER_RANKINGS = ("scores", "init-metric")
# named settings a run can start from (`--preset NAME`; explicit flags override them)
PRESETS: dict[str, dict] = {
    # the paper's optimiser: lr 2e-3 cosine, N_s 2 masks per step, moving-average baseline over T = 5 steps
    # (baseline and baseline_window are options of method pg: a preset names them as their flags do)
    "paper": dict(steps=1000, lr=2e-3, num_mask_samples=2, baseline="moving-average", baseline_window=5),
    # the defaults: leave-one-out over N_s = 8 masks (one batched forward on a GPU), lr 0.02, 50 steps
    "fast": dict(steps=50, lr=0.02, num_mask_samples=8, baseline="leave-one-out"),
    # as fast, run to the plateau (300 steps: about a minute on an H100)
    "converged": dict(steps=300, lr=0.02, num_mask_samples=8, baseline="leave-one-out"),
}
SEED_MAX = 2**32 - 1  # torch's generators take 64 bits; the run adds small offsets to the seed
# settings that moved out of PruneConfig into a method's options: old field -> (method, option)
_MOVED_TO_METHOD_OPTIONS = {
    "gumbel_temperature": ("gumbel", "temperature"),
    "gumbel_final_temperature": ("gumbel", "final_temperature"),
    "gumbel_straight_through": ("gumbel", "straight_through"),
    # policy gradient's own knobs (top-level fields before methods owned their options)
    "baseline": ("pg", "baseline"),
    "baseline_window": ("pg", "baseline_window"),
    "estimator": ("pg", "estimator"),
    "estimator_clamp": ("pg", "estimator_clamp"),
    "mask_sampling": ("pg", "mask_sampling"),
    "control_variate": ("pg", "control_variate"),
}
_CLAMP_FOR = {"gumbel": "clamp"}  # the old estimator_clamp also clamped Gumbel's relaxation


def _migrate(data: dict) -> dict:
    """A config saved by an earlier version, in today's fields: the Gumbel settings lived at the top
    level (every run saved them); they become method options of a gumbel run and are dropped otherwise."""
    data = dict(data)
    if isinstance(data.get("method_options"), dict):
        data["method_options"] = dict(data["method_options"])
    run_method = data.get("method", PruneConfig.method)
    for old, (method, option) in _MOVED_TO_METHOD_OPTIONS.items():
        if old in data:
            value = data.pop(old)
            if old == "estimator_clamp" and run_method in _CLAMP_FOR:
                method, option = run_method, _CLAMP_FOR[run_method]
            if run_method == method:
                data.setdefault("method_options", {}).setdefault(option, value)
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


@dataclass
class PruneConfig:
    model: str = DEFAULT_MODEL
    units: list[str] = field(default_factory=lambda: ["heads", "channels"])
    prune_ratio: float = 0.3  # fraction of each unit pool removed
    scope: str = "global"  # global: one pool per unit type across layers; uniform: one per layer (layers: always one pool)
    # pg: policy gradient (forward only); gumbel: Gumbel-softmax relaxation trained by back-propagation
    # through the model (the paper's comparison); metric: no optimisation, the init metric's ranking is the mask
    method: str = "pg"
    init: str = "wanda-sp"  # for KV groups and channels; random-progressive also raises the rate in stages
    layer_init: str = "layerwise-ppl"  # for whole layers
    progressive_increment: float = 0.05  # random-progressive: prune-ratio step between stages
    prob_map: str = "sigmoid-norm"  # how metric scores become initial keep probabilities
    score_const: float = 0.8  # score-const: initial s of units the metric keeps (1 - it for the others)
    init_batches: int = 16  # calibration batches for the init metric (Wanda-sp, Taylor, Layerwise-PPL, SLEB)
    # defaults: the best quality per CPU minute measured on the default model (docs/pg-optimizer.md); the paper's
    # settings are the preset "paper"
    steps: int = 50
    lr: float = 0.02
    lr_schedule: str = "cosine"
    batch_size: int = 8
    seqlen: int = 128  # calibration segment length
    num_mask_samples: int = 8  # N_s masks drawn per step
    sample_forward: str = "auto"  # how the N_s masked forwards run: sequential, batched (one forward), sliced (kept units only), auto (by device)
    # FLAP's bias compensation: a removed unit's input is replaced by its mean on calibration data (in the
    # optimisation, the evaluation, and as a bias of the output projection in the export)
    bias_compensation: bool = False
    within_layer_ranking: str = "scores"  # final mask: per-layer counts from the scores, units in a layer ranked by scores or init-metric
    # final mask: every layer keeps a multiple of N units of these types, e.g. {"channels": 32}: whole Q8_0
    # blocks and GEMM tiles for llama.cpp (never over the budget; units.round_to_multiple)
    unit_multiple: dict = field(default_factory=dict)
    method_options: dict = field(default_factory=dict)  # the method's own settings (e.g. gumbel's temperatures)
    seed: int = 0
    calib: str | None = None  # calibration data file/folder; None: the default data dir or the hub
    eval_data: str | None = None  # evaluation text file/folder; None: the default data dir or the hub
    eval_seqlen: int = 128
    max_windows: int | None = None  # evaluate the first N windows only (None: all)
    eval_batch_size: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    checkpoint_every: int = 50
    checkpoint_minutes: float = 2.0  # also save state once this many minutes have passed since the last save (0: off)
    val_every: int = 0  # every N steps, perplexity of the current hard mask on held-out calibration text (0: off)
    val_batches: int = 4  # held-out batches for that check (every 10th calibration document is held out)
    final_mask: str = "last"  # last: from the final scores; best-val: from the scores whose hard mask validated best (step 0 too)

    @property
    def keep_ratio(self) -> float:
        return 1.0 - self.prune_ratio

    def validate(self) -> "PruneConfig":
        def bad(msg):
            raise UserError(msg)

        check_fields(self)  # types, finite floats: before any comparison below can raise TypeError
        if not 0.0 < self.prune_ratio < 1.0:
            bad(f"prune ratio must be strictly between 0 and 1, got {self.prune_ratio}")
        if not self.units or any(u not in UNIT_TYPES for u in self.units) or len(set(self.units)) != len(self.units):
            bad(f"units must be a comma list of {', '.join(UNIT_TYPES)}, got {','.join(self.units) or 'nothing'}")
        for name, value, allowed in (
            ("scope", self.scope, SCOPES),
            ("method", self.method, tuple(METHODS)),
            ("init", self.init, (*unit_metrics(), "random-progressive")),  # the registries as they are now
            ("layer init", self.layer_init, layer_metrics()),
            ("prob map", self.prob_map, tuple(PROB_MAPS)),
            ("lr schedule", self.lr_schedule, LR_SCHEDULES),
            ("dtype", self.dtype, tuple(DTYPES)),
            ("final mask", self.final_mask, FINAL_MASKS),
            ("sample forward", self.sample_forward, ("auto", *EXECUTORS)),
            ("within-layer ranking", self.within_layer_ranking, WITHIN_LAYER_RANKINGS),
        ):
            if value not in allowed:
                bad(f"unknown {name} {value!r}; choose from {', '.join(allowed)}")
        for name in ("steps", "batch_size", "seqlen", "num_mask_samples", "eval_seqlen",
                     "eval_batch_size", "checkpoint_every", "init_batches", "val_batches"):
            if getattr(self, name) < 1:
                bad(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        for name in ("seqlen", "eval_seqlen"):  # a loss needs a next token: 1 token gives a NaN loss
            if getattr(self, name) < 2:
                bad(f"{name.replace('_', ' ')} must be at least 2 tokens, got {getattr(self, name)}")
        if not 0 <= self.seed <= SEED_MAX:
            bad(f"seed must be between 0 and {SEED_MAX}, got {self.seed}")
        if self.max_windows is not None and self.max_windows < 1:
            bad(f"max windows must be at least 1, got {self.max_windows}")
        if self.checkpoint_minutes < 0:
            bad(f"checkpoint minutes must be 0 (off) or positive, got {self.checkpoint_minutes}")
        if self.val_every < 0:
            bad(f"val every must be 0 (off) or positive, got {self.val_every}")
        if self.final_mask == "best-val" and self.val_every == 0:
            bad("final mask best-val needs held-out validation: set val every to a positive step count")
        if self.lr <= 0:
            bad(f"learning rate must be positive, got {self.lr}")
        if not 0.5 < self.score_const < 1.0:
            bad(f"score-const c must be in (0.5, 1), got {self.score_const}")
        if self.init == "random-progressive" and not 0.0 < self.progressive_increment <= self.prune_ratio:
            bad(f"progressive increment must be in (0, prune ratio], got {self.progressive_increment}")
        for unit, n in self.unit_multiple.items():
            if unit not in self.units or UNIT_TYPES[unit].whole_layer:
                bad(f"unit multiple applies to the pruned unit types within layers "
                    f"({', '.join(u for u in self.units if not UNIT_TYPES[u].whole_layer)}), not {unit!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                bad(f"unit multiple of {unit} must be a whole number of at least 1, got {n!r}")
        # the method's own settings, validated by the method and stored whole (defaults written out)
        self.method_options = dataclasses.asdict(options) if (options := method_options(self.method, self.method_options, self)) else {}
        optimising = [name for name, m in METHODS.items() if m.optimises]
        if not METHODS[self.method].optimises and self.init == "random-progressive":
            bad(f"random-progressive is a schedule of the optimisation; method {self.method} has none (use init random)")
        if not METHODS[self.method].optimises and self.val_every:
            bad(f"method {self.method} runs no steps; held-out validation (val every) needs {' or '.join(optimising)}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        from .io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def of(cls, **values) -> "PruneConfig":
        """A config from keyword values, in today's fields or an earlier version's (e.g. baseline=..., now an
        option of method pg): for scripts and tests written against either."""
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, data: dict) -> "PruneConfig":
        """A config from its saved dict: unknown fields and wrongly typed values are UserErrors."""
        if not isinstance(data, dict):
            raise UserError(f"config must be a JSON object, got {type(data).__name__}")
        data = _migrate(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"config has unknown fields: {', '.join(sorted(unknown))}")
        config = cls(**data)
        check_fields(config)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):  # 2 in a float field is 2.0, as the CLI would have made it
            if hints.get(f.name) is float and isinstance(getattr(config, f.name), int):
                setattr(config, f.name, float(getattr(config, f.name)))
        return config

    @classmethod
    def load(cls, path: Path) -> "PruneConfig":
        try:
            data = json.loads(Path(path).read_text(), parse_constant=_no_constant)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"cannot read run config {path}: {e}") from e
        try:
            return cls.from_dict(data)
        except UserError as e:
            raise UserError(f"run config {path}: {e}") from e
