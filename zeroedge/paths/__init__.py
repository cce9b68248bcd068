"""PAD in decode: predicted FFN paths, so a decode step reads only the FFN weights that matter.

  room        the two training-free peers (top-k oracle on silu(gate)*up; CATS threshold on
              |silu(gate)|) and the byte accounting every method shares
  predictor   `PathPredictor`: a tiny whitened low-rank predictor per layer that reads the
              normalised FFN input and scores every channel; channels under a calibrated threshold
              are never read (gate row, up row, down column)
  sparse      `PathMLP` wraps `block.mlp` (inference only), `PathRuntime`, `install` / `remove`,
              and `sparse_mlp_gather`: the decode step that gathers only the chosen weights
  calibrate   `calibrate_paths(model, token_lists, budget)`: per-layer thresholds (magnitude
              rule, default) or predictors, sparsity chosen with the held-out perplexity gate
  decode      `PathsDecoder`: the CUDA-graph decode loop with gather-GEMV FFNs
  evaluate    `run_eval(model, ids, meta, tensors)`: dense vs paths perplexity, every token
  triton_gemv the fused gather-GEMV for CUDA (imported lazily)

Nothing heavy is imported here.
"""
