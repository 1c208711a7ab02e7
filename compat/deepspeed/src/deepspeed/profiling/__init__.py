"""``deepspeed.profiling``: ``flops_profiler`` is microspeed's (the efficiency plugin's) flops profiler."""
