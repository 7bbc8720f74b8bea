"""What runs in an engine pod: the vLLM launcher and, later, the CPU reference engine."""
