"""eaglepipe: EAGLE-3 draft training pipeline for vLLM targets."""
