"""What a setting names on the model side, kept apart from the loader so that the settings import no model code:
the default model's name and the weight dtypes a run loads in."""

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
