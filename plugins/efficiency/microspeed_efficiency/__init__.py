"""microspeed-efficiency: DeepSpeed's training-efficiency features as microspeed plugins.

``import microspeed as deepspeed`` scripts reach the flops profiler as
``deepspeed.profiling.flops_profiler`` (``get_model_profile``, ``FlopsProfiler``).
"""
