"""PAD in decode: predicted FFN paths, so a decode step reads only the FFN weights that matter.

  room        the two training-free peers (top-k oracle on silu(gate)*up; CATS threshold on
              |silu(gate)|) and the byte accounting every method shares
  predictor   `PathPredictor`: a tiny whitened low-rank predictor per layer that reads the
              normalised FFN input and scores every channel; channels under a calibrated threshold
              are never read (gate row, up row, down column)
  sparse      `PathMLP` wraps `block.mlp` (inference only), `PathRuntime`, `install` / `remove`,
              and `sparse_mlp_gather`: the decode step that gathers only the chosen weights
  policies    `policies_from_artifact(model, meta, tensors)`: the artifact's per-layer policies
  ffn         `PathsFFN`: the decode step's FFN strategy (gather-GEMVs on the sparse layers)
  evaluate    `run_eval(model, ids, meta, tensors)`: dense vs paths perplexity, every token
  triton_gemv the fused gather-GEMV for CUDA (imported lazily); cuda_gemv the plugin library's kernels

Calibration (`calibrate_paths`) is workstation work: zeroedge.export.paths_calibrate. The decode
loop that runs them (`PathsDecoder`, with the FFN strategy of `ffn`) is serving: zeroedge.runtime.fast.

Nothing heavy is imported here.
"""
