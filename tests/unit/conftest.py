import os
import socket
import sys

import pytest


@pytest.fixture(scope="module")
def gloo_group():
    """A real torch.distributed default group of one rank (gloo, on CPU), with the environment DeepSpeed
    reads; torn down after the module, with DeepSpeed's cached copy of it (a later module's new group would
    otherwise meet the dead one inside deepspeed.initialize: "Group ... is not registered")."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v
