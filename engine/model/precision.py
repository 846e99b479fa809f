"""The dtype of a fresh run's one-shot passes: the statistics pass, the init metric and the joint mix; of its
evaluations (--eval-dtype) and of its steps' forwards (--step-dtype).

These passes only rank and measure (FLAP's moments, the refit's moments, Layerwise-PPL's losses, the mix's scores);
where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), torch's autocast runs their matrix products in
bfloat16 at about 3x the float32 speed, the weights and every sum staying float32. The evaluations, the steps and
the refit's solve keep the run's --dtype.

    with pass_precision(resolve_pass_dtype("auto", "float32", "cpu"), "cpu"):
        ...  # forwards whose matrix products run in bfloat16 on a CPU with native bfloat16, else as before
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

PASS_DTYPES = ("auto", "float32", "bfloat16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names for a CPU that multiplies bfloat16 itself
NATIVE_ENV = "PG_PRUNE_NATIVE_BF16"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty when it has none)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def native_bf16_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Does this CPU run bfloat16 matrix products natively (AVX-512 BF16 or AMX)? False where it cannot say.
    $PG_PRUNE_NATIVE_BF16 (1 or 0) answers instead of the CPU (the test suite sets 0: the same runs on any CPU)."""
    told = os.environ.get(NATIVE_ENV, "").strip()
    if told in ("0", "1"):
        return told == "1"
    return _cpu_has_bf16(cpuinfo_path)


@functools.cache
def _cpu_has_bf16(cpuinfo_path: str) -> bool:
    try:
        flags = cpu_flags(Path(cpuinfo_path).read_text())
    except OSError:
        return False
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def resolve_pass_dtype(setting: str, weights_dtype: str, device: str, native: bool | None = None) -> str:
    """The dtype the one-shot passes run in: float32 or bfloat16. auto is bfloat16 for float32 weights on a CPU with
    native bfloat16 (native: that answer, default this machine's), else the weights' own (float32 there: nothing
    changes); float32 is the weights' own dtype, whatever it is; bfloat16 asks for it anywhere."""
    if setting == "bfloat16":
        return "bfloat16"
    if setting == "auto" and weights_dtype == "float32" and device == "cpu":
        return "bfloat16" if (native_bf16_cpu() if native is None else native) else weights_dtype
    return weights_dtype


def pass_precision(dtype: str, device_type: str = "cpu"):
    """The context the one-shot passes run in: torch's autocast to bfloat16, or nothing for any other dtype."""
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def run_device_type(config, model=None) -> str:
    """The device type a run's model is on (without a model, its --device's: what a plan made before loading says)."""
    from .loading import model_device

    return model_device(model).type if model is not None else str(config.device).split(":")[0]


def run_pass_dtype(config, model=None) -> str:
    """A run's one-shot passes' dtype: its --pass-dtype resolved on the device its model is on (without a model,
    on its --device: what a plan made before loading says)."""
    return resolve_pass_dtype(config.pass_dtype, config.dtype, run_device_type(config, model))


def emulated_bf16_line(config, device_type: str, native: bool | None = None) -> str | None:
    """What a run says when it was asked for bfloat16 (--pass-dtype or --eval-dtype bfloat16) on a CPU that does not
    multiply it natively (native: that answer, default this machine's): autocast then emulates it, several times
    slower than float32 (a batch of 8 x 128 tokens of the default model at one thread on an AVX2-only EPYC: 40.2 s
    against 6.4 s); auto runs float32 on such a CPU. None where nothing is to be said."""
    asked = [f"--{name.replace('_', '-')} bfloat16" for name in ("pass_dtype", "eval_dtype")
             if getattr(config, name, None) == "bfloat16"]
    if not asked or device_type != "cpu" or (native_bf16_cpu() if native is None else native):
        return None
    return (f"note: {' and '.join(asked)} on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
            "its matrix products are emulated, several times slower than float32 here (auto runs float32 on this CPU)")


def run_step_dtype(config, model=None) -> str:
    """A run's steps' dtype: its --step-dtype resolved as --pass-dtype is (run_pass_dtype)."""
    return resolve_pass_dtype(config.step_dtype, config.dtype, run_device_type(config, model))


def step_dtype_problem(config, device_type: str, native: bool | None = None) -> str | None:
    """Why a run cannot take its steps in bfloat16 here: --step-dtype bfloat16 on a CPU that does not multiply it
    natively (native: that answer, default this machine's), where the steps, a run's longest part, would run
    several times slower than in float32. None where nothing stops it (auto runs float32 on such a CPU)."""
    if getattr(config, "step_dtype", None) != "bfloat16" or device_type != "cpu":
        return None
    if native_bf16_cpu() if native is None else native:
        return None
    return ("--step-dtype bfloat16: this CPU does not multiply bfloat16 natively (no avx512_bf16 or amx_bf16 in "
            "/proc/cpuinfo), so the steps would be emulated, several times slower than float32; use --step-dtype "
            "auto (float32 on this CPU) or float32")


def step_precision(dtype: str, device_type: str = "cpu"):
    """The context of a step's forwards: pass_precision's autocast, the LM head kept in float32 (the KL or CE each
    sample's score and the estimate read: engine/algo/evaluate.py's head_chunks)."""
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    from ..algo.evaluate import head_in_float32

    stack = contextlib.ExitStack()
    stack.enter_context(pass_precision(dtype, device_type))
    stack.enter_context(head_in_float32())
    return stack


def run_eval_dtype(config, model=None) -> str:
    """A run's evaluations' dtype: its --eval-dtype resolved as --pass-dtype is (run_pass_dtype)."""
    return resolve_pass_dtype(config.eval_dtype, config.dtype, run_device_type(config, model))


def run_passes(run):
    """The context of a run's one-shot passes (run_pass_dtype's autocast)."""
    from .loading import model_device

    return pass_precision(run_pass_dtype(run.config, run.model), model_device(run.model).type)
