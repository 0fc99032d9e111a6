"""oscar.pipeline: model loading, attention capture, accumulators, zarr block store (one process, no Ray)."""
