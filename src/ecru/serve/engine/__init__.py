"""Running a plan on a model: the request engine and its `ModelRunner`, the KV cache, sampling,
detokenisation, packed weights, the served model and static-batch generation."""
