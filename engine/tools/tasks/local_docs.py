"""Document mappings for local copies whose schema differs from the hub dataset lm-eval expects."""


def boolq_label_from_answer(dataset):
    """google/boolq rows (`answer`: bool) -> super_glue/boolq rows (`label`: 0/1, 1 = yes)."""
    return dataset.map(lambda doc: {"label": int(doc["answer"])})
