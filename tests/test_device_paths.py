"""Device handling that a CPU-only machine can still check: token ids follow the model to its device
(the `gpu` tests in test_gpu.py run the real thing on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class _RecordingModel(nn.Module):
    """Stands for a model on another device: its one parameter lives on `meta`; it records the device of
    the ids it is fed and answers with CPU logits."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(1, device="meta"))
        self.seen: list[torch.device] = []

    def forward(self, input_ids, use_cache=False):
        self.seen.append(input_ids.device)
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 3))

    def merge_and_unload(self):
        return self


def test_finetune_merge_feeds_the_ids_on_the_models_device():
    """`finetune --device cuda` used to feed the CPU probe ids to the CUDA model at the merge, after training."""
    from engine.tools.finetune import merge

    model = _RecordingModel()
    merge(model, torch.zeros(2, 5, dtype=torch.long))
    assert model.seen == [torch.device("meta")] * 2  # before and after the merge


def test_zeroshot_of_a_run_loads_the_base_on_the_configured_device(tmp_path, monkeypatch):
    """`zeroshot --run` used to load the base model on the CPU whatever --device said."""
    import engine.tools.chat as chat
    from engine.tools.zeroshot import ZeroshotConfig, load_for_zeroshot

    run = tmp_path / "run"
    run.mkdir()
    (run / "masks.json").write_text('{"base_model": "some-model"}')
    asked = []

    def load_base(name, dtype="float32", device="cpu"):
        asked.append((name, dtype, device))
        raise RuntimeError("stop here")

    monkeypatch.setattr(chat, "load_base", load_base)
    try:
        load_for_zeroshot(ZeroshotConfig(run=str(run), device="cuda:1"))
    except RuntimeError:
        pass
    assert asked == [("some-model", "float32", "cuda:1")]
