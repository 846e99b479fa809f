"""Files and caches: what the tool writes, written so that nothing is left half-written.

    io              atomic writes of files and folders, free-space checks, safe_load (the weights-only reader)
    outdir          the folders the tool writes into: one rule for every writing command, a lock per folder
    ppl_cache       the dense model's perplexity, remembered across runs
    model_cache     the de-quantised copy of a GGUF model, kept in the cache"""
