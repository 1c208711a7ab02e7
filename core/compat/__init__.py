"""DeepSpeed compatibility: accelerator API, config key table, config object, tensor helpers, the stand-in."""
