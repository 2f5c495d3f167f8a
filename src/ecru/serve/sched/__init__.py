"""The engine core's model-free, torch-free half: policy names, the scheduler (queues, admission,
preemption, kept KV, the KV budget) and the static policies' batch plans."""
