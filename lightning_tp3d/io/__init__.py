"""Files: sharded checkpoints (DCP), Hugging Face folders (safetensors) and the deploy shards, each
written atomically (`folders`)."""
