"""Write a plain transformers copy (safetensors, model type unchanged) of a model, e.g. the default GGUF.

    python bench/plain_copy.py DEST [--model smollm2-135m-instruct]

transformers refuses save_pretrained on a model de-quantized from GGUF (it is flagged quantized);
the copy is rebuilt from its config without quantization_config and given the same state dict, so
lm-eval's own `--model hf --model_args pretrained=DEST` can load exactly the weights the engine uses.
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest")
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.loading import load_model, resolve_model

    model, tok = load_model(resolve_model(args.model))
    config = model.config.__class__.from_dict({k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(args.dest)
    tok.save_pretrained(args.dest)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = float((plain.eval()(input_ids=ids).logits - model(input_ids=ids).logits).abs().max())
    print(f"plain copy in {args.dest}; max |logit difference| vs the loaded model: {diff:.2e}")


if __name__ == "__main__":
    main()
