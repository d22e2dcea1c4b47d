"""The launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): malformed, out of range, or left over in a shell without a launcher, each is one
line naming the variable (exit 2), before torch is asked to form a group. The CLI side (one line,
no traceback, nothing written) is in tests/cli/test_bad_input.py. Every other module asks
ndtrain/launch_env.py for what it needs of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ndtrain
from ndtrain import launch_env as launch
from ndtrain.errors import NdtrainError, UsageError
from ndtrain.launch_env import launch_env

TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


def test_what_a_launcher_sets_is_read():
    assert launch_env({}) == {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}
    got = launch_env(TORCHRUN)
    assert (got["WORLD_SIZE"], got["RANK"], got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"]) == (2, 1, 1, 2)
    assert launch_env({"WORLD_SIZE": "1", "RANK": "0"})["WORLD_SIZE"] == 1  # a harmless leftover


def test_what_the_rest_of_ndtrain_asks_of_them():
    agent = {**TORCHRUN, "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "TORCHELASTIC_RESTART_COUNT": "2",
             "TORCHELASTIC_MAX_RESTARTS": "5", launch.LAUNCHER_ENV: "4321"}
    asked = (launch.rank, launch.local_rank, launch.local_world_size, launch.given_a_rank, launch.under_launcher,
             launch.group_rank, launch.agents, launch.restart_count, launch.restarts_left, launch.run_id,
             launch.master_addr, launch.master_port, launch.launcher_pid)
    assert [f(agent) for f in asked] == [1, 1, 2, True, True, 1, 3, 2, 3, "x", "127.0.0.1", 29500, 4321]
    assert [f({}) for f in asked] == [0, 0, 1, False, False, 0, 1, 0, 0, "", "", None, None]  # one process, no launcher
    assert launch.launcher_pid({launch.LAUNCHER_ENV: "x"}) is None  # only a launcher's pid counts
    assert launch.run_id({"TORCHELASTIC_RUN_ID": "none"}) == ""  # torchrun's word for no id
    with pytest.raises(UsageError, match="RANK='x'"):
        launch.rank({**TORCHRUN, "RANK": "x"})  # each variable in the form launch_env checks
    stray = {"WORLD_SIZE": "4"}  # left in the shell of an `--nproc` launcher, whose workers never see it
    assert launch.rank(stray) == 0 and launch.local_world_size(stray) == 1
    with pytest.raises(UsageError, match="WORLD_SIZE=4 is set but RANK is not"):
        launch_env(stray)  # only forming a group checks the variables against each other


# Written by a launcher, read only by ndtrain/launch_env.py (parallel/launch.py, the test harness,
# only sets them for its ranks).
_NAME = r"""["'](RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|GROUP_RANK|GROUP_WORLD_SIZE|""" \
    r"""TORCHELASTIC_\w+)["']"""
LAUNCHER_VARIABLES = re.compile(rf"""\b(environ|env|getenv)(\.get\(|\[|\()\s*{_NAME}|{_NAME}\s+(not\s+)?in\s+(os\.)?environ""")


def test_no_other_module_reads_the_launchers_variables():
    for line in ("os.environ.get('RANK', '0')", '"RANK" not in os.environ', "env.get('MASTER_ADDR')",
                 'os.getenv("LOCAL_RANK")', 'os.environ["TORCHELASTIC_RUN_ID"]'):
        assert LAUNCHER_VARIABLES.search(line), line  # what the scan catches
    src = Path(ndtrain.__file__).parent
    readers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                     if p != src / "launch_env.py" and LAUNCHER_VARIABLES.search(p.read_text()))
    assert readers == [], readers


@pytest.mark.parametrize("env, names", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE=''"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK='-1'"),
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 must be below WORLD_SIZE=2"),
    ({"RANK": "3"}, "RANK=3 must be below WORLD_SIZE=1"),
    ({**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not"),  # left over in a shell, no launcher
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is not"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT is not"),
])
def test_each_bad_variable_is_one_line_naming_it(env, names):
    with pytest.raises(UsageError) as info:
        launch_env(env)
    msg = str(info.value)
    assert names in msg and "\n" not in msg and "torchrun" in msg, msg
    assert info.value.exit_code == 2


def test_a_group_that_cannot_form_is_one_line(monkeypatch):
    """A leftover WORLD_SIZE=2 with MASTER_* set: the peers never come; torch's timeout becomes
    one line saying what was asked, not torch's traceback."""
    import torch.distributed as dist

    from ndtrain.config import load_config
    from ndtrain.train import distributed

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)

    def no_peers(*args, **kwargs):
        raise dist.DistStoreError("Timed out after 1 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(dist, "init_process_group", no_peers)
    with pytest.raises(NdtrainError) as info:
        distributed.setup(load_config(None, {"train": {"device": "cpu", "timeout_s": 1}}).train)
    msg = str(info.value)
    assert "WORLD_SIZE=2" in msg and "MASTER_PORT=1" in msg and "1/2 clients joined" in msg and "\n" not in msg, msg
    assert info.value.exit_code == 1
