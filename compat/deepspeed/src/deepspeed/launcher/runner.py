"""``deepspeed.launcher.runner``: the names other launchers read (accelerate writes ``.deepspeed_env``).

DeepSpeed's multi-node ``deepspeed`` launcher (pdsh/ssh) has no counterpart here: microspeed
launches with ``microspeed run`` (torchrun), which starts multi-node jobs with ``--nnodes`` and
``--rdzv-endpoint``.
"""

import os

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""File of ``KEY=value`` lines a multi-node launcher exports on every node."""

DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
"""Folders searched for :data:`DEEPSPEED_ENVIRONMENT_NAME`."""

PDSH_MAX_FAN_OUT = 1024
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
