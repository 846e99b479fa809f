"""Policy-gradient structural pruning of decoder-only LLMs: KV groups, MLP channels and whole layers.

From Python: `from engine import PruneConfig, default_run, prune` (docs/api.md), `engine.recover(run_dir, out, ...)`; from the
shell: `python -m engine` or `pg-prune`."""

import time

IMPORTED = time.monotonic()  # before torch and transformers load: the CLI's --time-budget counts from here

_registered = False


def register_pruned_classes() -> None:
    """Let AutoConfig/AutoModelForCausalLM load our exports without trust_remote_code."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model.modeling_pruned import PRUNED_CLASSES

    for config_cls, model_cls in PRUNED_CLASSES.values():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    _registered = True


_API = {"prune": "engine.api", "perplexity": "engine.api", "PruneResult": "engine.api", "PruneConfig": "engine.settings.config",
        "default_run": "engine.settings.config",
        "recover": "engine.tools.recover", "RecoverResult": "engine.tools.recover"}


def __getattr__(name: str):
    """`from engine import prune, PruneConfig` (docs/api.md), imported on first use: `import engine` alone stays
    light (torch loads later, and IMPORTED above is the CLI's start)."""
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
