"""Policy-gradient structural pruning of decoder-only LLMs (KV groups and MLP channels)."""

import time

IMPORTED = time.monotonic()  # before torch and transformers load: the CLI's --time-budget counts from here

_registered = False


def register_pruned_classes() -> None:
    """Let AutoConfig/AutoModelForCausalLM load our exports without trust_remote_code."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from .modeling_pruned import PRUNED_CLASSES

    for config_cls, model_cls in PRUNED_CLASSES.values():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    _registered = True
