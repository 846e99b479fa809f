"""The algorithms: what scores, samples, counts and refits the masks. Nothing here knows the run loop.

    policy          pure kernels: projection, estimator, baselines, schedules, the final mask
    budget          parameter accounting: what a unit weighs and what a set of masks removes
    joint           the joint method's one-shot mix of whole layers and width
    rewards         a sampled mask's score L_j (KL from the dense model, CE, ...)
    statistics      the one statistics pass over the calibration stream (inputs of every output projection)
    reconstruction  the least-squares refit of the kept columns
    evaluate        perplexity over fixed windows
    context         StepContext: what a method sees of one step
    methods/        pg, pg-alloc, gumbel, metric, flap, bonsai (METHODS; each owns its options)
    metrics/        the init metrics: wanda-sp, taylor, flap, sleb, block influence, ... (METRICS)"""
