"""What users run: `ecru serve ...` (argument parsing, the setups it builds), the OpenAI-compatible
server, the batch runner and the demo section."""
