"""A run's checkpoint: what it holds (runstate.RunState, the config and the step's metrics line), when it is
read back, and what a resume checks and restores."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import UserError
from ..model.unit_types import renamed_units
from ..storage.io import SAFE_GLOBALS, atomic_file, safe_load  # noqa: F401  (SAFE_GLOBALS: read from here too)
from .folder import CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, trim_metrics
from .state import HOOK_DATA, RunState

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources


def _normalised(saved: dict) -> dict:
    """A config a checkpoint saved, in today's fields with every method option written out."""
    from ..settings.config import PruneConfig

    try:
        return json.loads(json.dumps(PruneConfig.from_dict(saved).resolved().to_dict()))
    except UserError:
        return saved  # compared as it is: any difference is reported


def read_checkpoint(path: Path) -> dict:
    """The checkpoint's content through safe_load: one that names a Python object is refused in one line."""
    return safe_load(path, "checkpoint", "Start again with --overwrite")


def _tensor_bytes(obj) -> int:
    """The bytes of the tensors inside obj (dicts, lists, tuples): about what a checkpoint of it takes on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(_tensor_bytes(v) for v in values)


class Checkpoints:
    """The checkpoint file of one run: snapshots of its state, written atomically, read back and checked."""

    def __init__(self, res: "RunResources"):
        self.res = res
        self.saved_step: int | None = None  # the step of the checkpoint on disk, once this process read or wrote one

    @cached_property
    def config_dict(self) -> dict:
        """The run's config as the checkpoint stores it (JSON types); a run's config does not change while it runs."""
        return json.loads(json.dumps(self.res.config.to_dict()))

    def snapshot(self, state: RunState, line: str | None = None) -> RunState:
        """A copy of the state as a checkpoint would hold it now (the sampler's and the mask rng's positions,
        the config, this step's metrics line); later steps do not change it."""
        snap = copy.copy(state)
        snap.scores = dict(state.scores)  # the loop replaces score tensors, never changes them in place
        snap.method_state = copy.deepcopy(state.method_state)
        snap.hooks = {name: dict(data) for name, data in state.hooks.items()}  # (a hook replaces its values, never
        # changes one in place)
        snap.sampler_state = copy.deepcopy(self.res.sampler.state_dict())
        snap.mask_rng_state = self.res.mask_rng.get_state()
        snap.config = self.config_dict
        if line is not None:
            snap.last_report = line
        return snap

    def save(self, state: RunState) -> None:
        self.write(self.snapshot(state))

    def write(self, snap: RunState) -> None:
        if self.res.out is None:  # a run in memory (engine.api.prune) keeps no checkpoint
            return
        data = asdict(snap)
        with atomic_file(self.res.out / CHECKPOINT_FILE, _tensor_bytes(data)) as tmp:
            torch.save(data, tmp)
        self.saved_step = snap.step

    def load(self) -> RunState:
        path = self.res.out / CHECKPOINT_FILE
        try:
            data = read_checkpoint(path)
        except UserError:
            raise
        except Exception as e:  # garbage, truncated or foreign: unpickling raises almost anything
            raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); it is damaged: "
                            "start again with --overwrite") from e
        try:
            data = renamed_units(data)  # (a unit type saved under an older name: by its name)
            control_moments = data.pop("control_moments", None)  # a checkpoint from before method_state
            if control_moments is not None:
                data.setdefault("method_state", {})["control_moments"] = control_moments
            if "best_val_ppl" in data:  # a checkpoint from before best_val's name said what it holds
                data["best_val"] = data.pop("best_val_ppl")
            for key, hook in HOOK_DATA.items():  # a checkpoint from before the hooks' data had their own field
                if key in data:
                    value = data.pop(key)
                    if value is not None:
                        data.setdefault("hooks", {}).setdefault(hook, {})[key] = value
            state = RunState(**data)
            self.res.sampler.load_state_dict(state.sampler_state)
            self.res.mask_rng.set_state(state.mask_rng_state)
            if not isinstance(state.step, int) or not 0 <= state.step:
                raise ValueError(f"step {state.step!r}")
            if set(state.scores) != set(self.res.layout.unit_types) or any(
                    s.shape != (self.res.layout.total(u),) for u, s in state.scores.items()):
                raise ValueError("scores do not fit this model and these units")
        except Exception as e:
            raise UserError(f"checkpoint {path} does not belong to this run ({type(e).__name__}: {e}); "
                            "start again with --overwrite") from e
        self.check_config_unchanged(state)
        self.saved_step = state.step
        return state

    def check_config_unchanged(self, state: RunState) -> None:
        """The config must be the one the checkpoint was written under. Only steps may differ (a longer or
        shorter run; the schedules then follow an N-step run from the checkpoint on), and not below the step
        the checkpoint holds."""
        c, path = self.res.config, self.res.out / CONFIG_FILE
        if state.config is not None:  # checkpoints from before this check carry no config
            now = self.config_dict
            then = _normalised(state.config)
            changed = [k for k in sorted(set(now) | set(then)) if k != "steps" and now.get(k) != then.get(k)]
            if changed:
                k = changed[0]
                raise UserError(f"{path} differs from the run's checkpoint in {', '.join(changed)} ({k}: "
                                f"{then.get(k)!r} when the run started, {now.get(k)!r} now); a run cannot "
                                "change its settings midway: restore them, or start again with --overwrite")
            if now["steps"] != then["steps"] and len(self.res.loop.stages) > 1:
                raise UserError(f"the number of steps of a random-progressive run cannot change on resume (its "
                                f"stages are laid out over them): keep steps {then['steps']}")
        if state.step > c.steps and c.time_budget is None:  # (a time budget plans its own count)
            raise UserError(f"the checkpoint is at step {state.step}, past steps {c.steps}: steps cannot go below "
                            "the steps already done")

    def restore_metrics(self, state: RunState) -> list[dict]:
        """After a resume, drop metric lines from steps past the checkpoint (they will be redone), and a
        last line cut short by a crash; the checkpoint's own step is put back from the checkpoint if its
        line was lost. Each step stays recorded once (the first record of it)."""
        kept = trim_metrics(self.res.out / METRICS_FILE, state.step, state.last_report)
        missing = sorted(set(range(1, state.step + 1)) - {r["step"] for r in kept})
        if missing and self.res.method.optimises:
            shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
            self.res.log(f"warning: {METRICS_FILE} lacks the records of {len(missing)} finished steps ({shown}): "
                         "their lines were lost; the loss curve has a gap there")
        return kept
