"""The model side: what a transformers model is made of and how a mask acts on it.

    arch/            one ModelAdapter per model family (ARCHITECTURES): where the attention and MLP linears are
    unit_types/      KV groups, MLP channels, whole layers (UNIT_TYPES): a unit's hook target, weights and slices
    units            a model's units as flat score vectors, their budget pools and final hard masks (UnitLayout)
    masking          masks as hooks on an unmodified model (MaskHooks)
    slicing          sliced forwards: a masked model that computes only its kept units
    executors        how a step's N_s masked forwards are computed (EXECUTORS)
    distributed      data-parallel runs under torchrun (World, the step's forwards shared across ranks)
    loading          finding and loading a model: the packaged default, a folder, a .gguf file, a hub id
    names            the default model's name and the weight dtypes (what the settings name, without the loader)
    gguf_file        a GGUF file checked before anything reads it
    modeling_pruned  the pruned model classes every export carries (imports nothing of the engine)
    precision        the dtype of the one-shot passes, the steps and the evaluations
    memory_check     sizes that will not fit, refused before they are allocated"""
