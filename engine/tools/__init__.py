"""Side tools around a pruned model. They use the engine; the engine never imports them.

    zeroshot    zero-shot accuracy (lm-evaluation-harness on local task data; tasks/: their templates)
    recover     recovery by distillation from the dense model (engine.recover, `python -m engine recover`)
    finetune    LoRA recovery fine-tuning on next-token labels
    measure     deployment figures: parameters, memory, latency, generation speed
    chat        streaming generation from the dense, pruned and recovered models
    llamacpp    running a GGUF in llama.cpp; gguf_cache: GGUF files made on demand and kept
    model_copy  what a first run builds once, built at install time"""
