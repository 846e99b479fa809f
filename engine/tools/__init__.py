"""Side tools around a pruned model: zero-shot accuracy, LoRA recovery fine-tuning, speed and memory
measurement, and chat. They use the engine; the engine never imports them."""
