"""What runs on the worker: the engine, generation state, the worker loop."""
