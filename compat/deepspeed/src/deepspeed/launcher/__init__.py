"""``deepspeed.launcher``: constants launchers share; launch with ``microspeed run`` (torchrun)."""
