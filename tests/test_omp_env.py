"""OpenMP wait defaults per command (omp_env.py): serve spins briefly, offline commands sleep,
the user's setting always wins, and a server started by an offline command gets serve's own."""

import os
import subprocess
import sys

import pytest

from agentserve import omp_env


def test_serve_spins_briefly_and_offline_commands_sleep():
    env: dict[str, str] = {"PATH": "/bin"}
    omp_env.apply(env, serving=True)
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env
    env = {"PATH": "/bin"}
    omp_env.apply(env, serving=False)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


@pytest.mark.parametrize("key,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                       ("GOMP_SPINCOUNT", "0")])
@pytest.mark.parametrize("serving", [True, False])
def test_a_user_setting_is_never_changed_nor_dropped(key, value, serving):
    env = {key: value}
    omp_env.apply(env, serving)
    assert env == {key: value}
    assert omp_env.for_server(env) == {key: value}


def test_a_server_started_by_an_offline_command_gets_its_own_default():
    env = {"PATH": "/bin"}
    omp_env.apply(env, serving=False)
    child = omp_env.for_server(env)
    assert child == {"PATH": "/bin"}
    omp_env.apply(child, serving=True)  # what the child's own CLI then does
    assert child["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in child


@pytest.mark.parametrize("argv,expect", [(["serve", "--help"], "None 10000"), (["sim", "--help"], "PASSIVE None"),
                                         (["--help"], "PASSIVE None")])
def test_the_cli_sets_it_before_torch_loads(argv, expect):
    code = ("import os, sys\nfrom agentserve import cli\nassert 'torch' not in sys.modules\n"
            f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('RESULT', os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in omp_env.USER_KEYS and k != omp_env.MARK}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    assert line == f"RESULT {expect}", out.stderr[-2000:]
