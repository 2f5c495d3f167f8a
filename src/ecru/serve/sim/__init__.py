"""The simulated runner: the scheduler's plans replayed on a cost-model clock with a trace's lengths."""
